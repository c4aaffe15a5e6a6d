"""Tables of complete users from batches sorted by user, cut anywhere."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.data.chunks import complete_users


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=0, max_size=40),
    st.lists(st.integers(1, 9), min_size=1, max_size=10),
    st.integers(1, 12),
)
def test_every_user_lands_whole_in_one_chunk_in_order(rows_per_user, cuts, chunk_rows):
    users = np.repeat(np.arange(len(rows_per_user)), rows_per_user)
    table = pa.table({"user_id": users, "row": np.arange(users.size)})
    batches, start, index = [], 0, 0
    while start < users.size:  # batches of the sizes in `cuts`, cycled: boundaries fall inside users
        size = cuts[index % len(cuts)]
        batches.append(table.slice(start, size).to_batches()[0] if size else None)
        start, index = start + size, index + 1
    chunks = list(complete_users(batches, chunk_rows))
    assert np.array_equal(
        np.concatenate([c["row"].to_numpy() for c in chunks]) if chunks else np.zeros(0), np.arange(users.size)
    )
    seen = [set(c["user_id"].to_pylist()) for c in chunks]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])  # no user in two chunks
    assert all(c.num_rows >= chunk_rows for c in chunks[:-1])  # every chunk but the last is full
