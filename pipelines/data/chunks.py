"""Tables of complete users from a stream of record batches sorted by user.

The user-local steps (the split's dedup and eligibility, the user solve) must see each user's rows
together; an engine partition sorted by user_id arrives as batches whose cuts fall anywhere. This
cuts the stream at user boundaries and gathers whole users into tables of about `rows` rows, so a
task's memory is bounded by the chunk (and the largest user), not by its partition.

A table whose every file holds whole users sorted by user_id (the split's parts, and the centred
rows a Spark task writes from one of them) says so in its files' Parquet metadata (USERS_TOGETHER):
a user-local step can then give each file to a task as it is, with no shuffle by user
(`users_together`, `sorted_by_user` checks the order as it reads).

Privacy: private rows regrouped by user on the trusted side; nothing is released.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from schemas import storage
from schemas.errors import UserError

DEFAULT_CHUNK_ROWS = 262_144
USERS_TOGETHER = {b"ssp.users_together": b"1"}  # a file's Parquet metadata: it holds whole users, sorted by user_id


def users_together(path: str) -> bool:
    """Whether every file of the table at `path` declares USERS_TOGETHER."""
    return all(USERS_TOGETHER.items() <= storage.file_metadata(file).items() for file in storage.table_files(path))


def sorted_by_user(batches: Iterable[pa.RecordBatch], source: str) -> Iterator[pa.RecordBatch]:
    """The batches of a file that declares USERS_TOGETHER, refused at the first row out of user order."""
    last = None
    for batch in batches:
        users = batch.column("user_id").to_numpy()
        if users.size and ((last is not None and users[0] < last) or np.any(users[1:] < users[:-1])):
            raise UserError(
                f"{source}: its rows are not sorted by user_id, though its metadata says each file holds "
                "whole users in order"
            )
        last = users[-1] if users.size else last
        yield batch


def complete_users(batches: Iterable[pa.RecordBatch], rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[pa.Table]:
    """Tables of whole users, in order, from batches sorted by user_id (each at least about `rows`
    rows, except the last)."""
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        users = batch.column("user_id").to_numpy()
        cut = int(np.searchsorted(users, users[-1], side="left"))  # the last user may go on in the next batch
        if cut > 0:
            pending.append(batch.slice(0, cut))
            pending_rows += cut
            if pending_rows >= rows:
                yield pa.Table.from_batches(pending).combine_chunks()
                pending, pending_rows = [], 0
        pending.append(batch.slice(cut))
        pending_rows += batch.num_rows - cut
    if pending:
        yield pa.Table.from_batches(pending).combine_chunks()
