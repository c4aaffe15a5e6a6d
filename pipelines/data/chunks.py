"""Tables of complete users from a stream of record batches sorted by user.

The user-local steps (the split's dedup and eligibility, the user solve) must see each user's rows
together; an engine partition sorted by user_id arrives as batches whose cuts fall anywhere. This
cuts the stream at user boundaries and gathers whole users into tables of about `rows` rows, so a
task's memory is bounded by the chunk (and the largest user), not by its partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

DEFAULT_CHUNK_ROWS = 262_144


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
