"""Data contracts of the project: one Arrow schema and validator per table, and table storage.

Every table that moves between jobs (interactions, items, user and item embeddings, DP item counts,
stats, the privacy ledger) is an Arrow table with a schema defined in `schemas.tables`, stored as
Parquet through `schemas.storage` on a local path or `gs://`.

Privacy: contracts and storage; which tables are private is said where they are written (the run
directory, docs/privacy.md).
"""

from schemas.errors import SchemaError

__all__ = ["SchemaError"]
