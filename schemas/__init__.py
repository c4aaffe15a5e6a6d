"""Data contracts of the project: one Arrow schema and validator per table, and table storage.

Every table that moves between jobs (interactions, items, user and item embeddings, DP item counts,
stats, the privacy ledger) is an Arrow table with a schema defined in `schemas.tables`, stored as
Parquet through `schemas.storage` on a local path or `gs://`.

Privacy: contracts and storage; which tables are private is said where they are written (the run
directory, docs/privacy.md).
"""

import warnings

from schemas.errors import SchemaError

# google-api-core (under Beam and gcsfs) warns at every import that it will drop this Python in 2027: a
# notice for the maintainers (CONTRIBUTING.md), not for every command's user. Set here, before the entry
# points (ssp, python -m bench, python -m pipelines...) import it.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

__all__ = ["SchemaError"]
