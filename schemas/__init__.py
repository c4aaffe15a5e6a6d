"""Data contracts of the project: one Arrow schema and validator per table, and table storage.

Every table that moves between jobs (interactions, items, user and item embeddings, DP item counts,
stats, the privacy ledger) is an Arrow table with a schema defined in `schemas.tables`, stored as
Parquet through `schemas.storage` on a local path or `gs://`.
"""

from schemas.errors import SchemaError

__all__ = ["SchemaError"]
