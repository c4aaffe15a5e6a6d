"""The Spark stats job's numpy parts: item shards, row blocks, and the groups a task noises and writes."""

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.engines import spark_stats as stats
from pipelines.releases.stats_core import shard_of


def test_shard_of_is_a_balanced_function_of_the_item():
    items = np.arange(-50_000, 50_000)
    shards = shard_of(items, 4)
    assert shards.min() == 0 and shards.max() == 3
    np.testing.assert_array_equal(shard_of(items[::-1], 4), shards[::-1])  # per item, not per position
    counts = np.bincount(shards)
    assert counts.min() > 0.97 * items.size / 4  # consecutive ids spread evenly
    assert np.all(shard_of(np.array([2**62, -(2**62)]), 7) < 7)


def test_shard_of_is_splitmix64_of_the_id_modulo_the_shards():
    """The fixed hash, from its definition in Python integers (a negative id as its 64-bit two's
    complement), so that every worker and every run, old or new, shards an item alike."""
    mask = 2**64 - 1

    def splitmix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    ids = [0, 1, 7, 123_456_789, 2**63 - 1, -1, -(2**63)]
    for shards in (1, 4, 7):
        assert shard_of(np.array(ids), shards).tolist() == [splitmix(i & mask) % shards for i in ids]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 300), shards=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_packed_blocks_hold_each_row_once_in_its_shard(n, shards, seed):
    rng = np.random.default_rng(seed)
    users, rated = rng.integers(-(10**12), 10**12, n), rng.integers(-(10**12), 10**12, n)
    labels = rng.normal(size=n) * 1e6
    keys = np.arange(100, 100 + shards, dtype=np.int32)
    batches = [
        pa.RecordBatch.from_pydict({"user_id": users[k::3], "item_id": rated[k::3], "label": labels[k::3]})
        for k in range(3)
    ]
    blocks = pa.Table.from_batches(list(stats.pack_rows(iter(batches), shards, keys)), schema=stats.BLOCK_SCHEMA)
    got = []
    for shard in range(shards):
        mine = blocks.filter(pa.compute.equal(blocks["shard"], shard))
        assert set(mine["key"].to_pylist()) <= {int(keys[shard])}
        u, i, y = stats.decode_rows(mine["block"].to_pylist())
        assert np.all(shard_of(i, shards) == shard)
        got += list(zip(u.tolist(), i.tolist(), y.tolist(), strict=True))
    assert sorted(got) == sorted(zip(users.tolist(), rated.tolist(), labels.tolist(), strict=True))  # bit-exact labels


def test_decode_of_no_blocks_or_empty_blocks_is_no_rows():
    for blocks in ([], [b"", b""]):
        users, items, labels = stats.decode_rows(blocks)
        assert users.size == items.size == labels.size == 0 and labels.dtype == np.float64


@settings(max_examples=80, deadline=None)
@given(
    rows_per_item=st.lists(st.integers(0, 90), min_size=1, max_size=60),
    chunk=st.integers(1, 100),
    per_group=st.integers(1, 12),
)
def test_groups_cover_items_and_rows_in_order_within_the_limits(rows_per_item, chunk, per_group):
    items = np.arange(len(rows_per_item)) * 3 + 5
    rated = np.repeat(items, rows_per_item)
    groups = list(stats._groups(items, rated, per_group, chunk))
    np.testing.assert_array_equal(np.concatenate([group for group, _ in groups]), items)
    assert [part.start for _, part in groups] == [0] + [part.stop for _, part in groups[:-1]] and groups[-1][
        1
    ].stop == rated.size
    for group, part in groups:
        assert 1 <= group.size <= per_group
        assert set(rated[part].tolist()) <= set(group.tolist())
        assert part.stop - part.start <= chunk or group.size == 1  # only a single item may hold more rows than a chunk
        if group is not groups[-1][0]:  # greedy: the next item would have broken a limit
            following = items[np.searchsorted(items, group[-1]) + 1]
            assert group.size == per_group or (part.stop - part.start) + np.count_nonzero(rated == following) > chunk


@settings(max_examples=25, deadline=None)
@given(
    bias=st.sampled_from([0.0, 0.5]),
    unit=st.sampled_from(["user", "example"]),
    confidence=st.booleans(),
    given_normalisers=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_item_sums_from_one_vector_per_user_equal_the_rows_contributions(
    bias, unit, confidence, given_normalisers, seed
):
    # the Spark task's path (each user's vector clipped once, rows pointing into it) gives the sums
    # of user_contributions' per-row kernel rows, for every kind of release
    from pipelines.releases.stats_core import StatsSettings, clipped_users, item_sums, user_contributions
    from privacy import accumulator
    from privacy.weights import user_normalisers

    rng = np.random.default_rng(seed)
    users, n = 9, 60
    settings_ = StatsSettings(3, clip_u=0.8, clip_y=2.0, unit=unit, bias=bias, confidence=confidence)
    vectors = rng.normal(size=(users, settings_.user_dim)) * 2  # some above the clip
    user_rows = rng.integers(0, users, n)
    user_ids, item_ids = user_rows * 10 + 3, rng.integers(0, 7, n)
    labels = rng.uniform(0.5, 3.0, n) if confidence else rng.normal(size=n) * 3
    counts = rng.uniform(1, 50, n)
    normalisers = None
    if given_normalisers and unit == "user":
        known, sums = user_normalisers(
            user_ids, counts, settings_.weight_exponent, confidence=labels if confidence else None
        )
        normalisers = sums[np.searchsorted(known, user_ids)]
    got = item_sums(
        user_ids,
        item_ids,
        labels,
        users=clipped_users(vectors, settings_),
        user_rows=user_rows,
        counts=counts,
        settings=settings_,
        normalisers=normalisers,
    )
    want = accumulator.grouped_sums(
        *user_contributions(
            user_ids, item_ids, labels, vectors[user_rows], counts, settings=settings_, normalisers=normalisers
        )
    )
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def _clipped_by_definition(row: list[float], bound: float) -> list[float]:
    """Clip(row, bound) in Python floats: the norm summed in the row's order (rescaled by the largest
    entry when the squares overflow), then min(1, bound / norm)."""
    squares = sum((value * value for value in row), 0.0)
    if math.isinf(squares):
        largest = max(abs(value) for value in row)
        norm = largest * math.sqrt(sum(((value / largest) * (value / largest) for value in row), 0.0))
    else:
        norm = math.sqrt(squares)
    scale = 1.0 if norm <= bound else bound / norm
    return [value * scale for value in row]


@pytest.mark.parametrize("bias", [0.0, 1.5])
def test_clipped_users_are_their_definition_row_by_row_to_the_bit(bias):
    # each user's vector is [Clip(u, clip_u), c] (with biases; u alone without) clipped to the noise's
    # bound, its bias apart: the compiled pass gives the bits of that arithmetic done row by row
    from pipelines.releases import stats_core

    settings_ = stats_core.StatsSettings(4, clip_u=0.9, clip_y=2.0, bias=bias)
    vectors = np.random.default_rng(3).normal(size=(301, settings_.user_dim)) * 2
    vectors[0] = 0.0  # a zero vector: nothing to scale
    vectors[1, :2] = 1e200  # squares that overflow
    vectors[2] *= 1e-3  # inside the clip: unchanged
    clipped, offsets = stats_core.clipped_users(vectors, settings_)
    bound = settings_.noise_clips()[0]
    width = settings_.user_dim - (2 if bias else 0)  # u
    for row, got in zip(vectors, clipped, strict=True):
        if bias:
            want = _clipped_by_definition(
                [*_clipped_by_definition(row[:width].tolist(), settings_.clip_u), settings_.bias_scale], bound
            )
        else:
            want = _clipped_by_definition(row.tolist(), bound)
        np.testing.assert_array_equal(got, want)
    assert np.all(np.linalg.norm(clipped, axis=1) <= bound * (1 + 1e-12))
    np.testing.assert_allclose(np.linalg.norm(clipped[1, :width]), settings_.clip_u if bias else bound, rtol=1e-15)
    np.testing.assert_array_equal(clipped[0, :width], 0.0)
    np.testing.assert_array_equal(clipped[2, :width], vectors[2, :width])
    if bias:
        np.testing.assert_array_equal(clipped[:, width], settings_.bias_scale)
        np.testing.assert_array_equal(offsets, vectors[:, -1])
        assert clipped.shape == (301, settings_.user_dim - 1)
    else:
        assert offsets is None and clipped.shape == vectors.shape


@pytest.mark.parametrize("bias", [0.0, 1.5])
def test_a_workers_users_are_clipped_as_read_to_the_bits_of_the_whole_clip(tmp_path, monkeypatch, bias):
    # read_clipped clips each batch as it reads it, into one array: the same ids, vectors and
    # offsets as reading the table and clipping it whole; a vector of the wrong length is refused
    from pipelines.releases import stats_core
    from schemas import storage
    from schemas.arrays import matrix_to_list_column

    settings_ = stats_core.StatsSettings(3, clip_u=0.8, clip_y=2.0, bias=bias)
    vectors = np.random.default_rng(5).normal(size=(700, settings_.user_dim))
    ids = np.random.default_rng(6).permutation(10**6)[:700]
    path = str(tmp_path / "users.parquet")
    table = pa.table({"user_id": ids, "embedding": matrix_to_list_column(vectors)})
    storage.write_table(table, path, rows_per_file=256)  # three files
    monkeypatch.setattr(stats, "READ_BATCH_ROWS", 100)  # several batches, across row groups
    owners, (clipped, offsets) = stats.read_clipped(path, settings_)
    whole, whole_offsets = stats_core.clipped_users(vectors, settings_)
    np.testing.assert_array_equal(owners.ids, ids)
    np.testing.assert_array_equal(clipped, whole)
    assert (offsets is None) == (bias == 0.0) and (offsets is None or np.array_equal(offsets, whole_offsets))
    short = table.set_column(1, "embedding", matrix_to_list_column(vectors[:, :-1]))
    storage.write_table(short, path)
    with pytest.raises(ValueError, match=f"user embedding of row 0 has {settings_.user_dim - 1} entries"):
        stats.read_clipped(path, settings_)


def _users_table(tmp_path, settings_, rows=700, seed=5):
    from schemas import storage
    from schemas.arrays import matrix_to_list_column

    vectors = np.random.default_rng(seed).normal(size=(rows, settings_.user_dim))
    ids = np.random.default_rng(seed + 1).permutation(10**6)[:rows]
    path = str(tmp_path / f"users-{seed}.parquet")
    storage.write_table(
        pa.table({"user_id": ids, "embedding": matrix_to_list_column(vectors)}), path, rows_per_file=256
    )
    return path


@pytest.mark.parametrize("bias", [0.0, 1.5])
def test_an_executors_workers_share_one_copy_of_the_clipped_users_with_the_bits_of_their_own(
    tmp_path, monkeypatch, bias
):
    # the first worker writes the copy into the executor's folder; the next maps it without reading
    # the table; a new release replaces it, and the maps already made stay readable
    import os
    import stat

    from pipelines.releases import stats_core

    settings_ = stats_core.StatsSettings(3, clip_u=0.8, clip_y=2.0, bias=bias)
    path, folder = _users_table(tmp_path, settings_), tmp_path / "executor"
    folder.mkdir()
    own_index, (own, own_offsets) = stats.read_clipped(path, settings_)
    index, (shared, offsets) = stats.shared_clipped(path, "digest-1", settings_, str(folder))
    np.testing.assert_array_equal(index.ids, own_index.ids)
    np.testing.assert_array_equal(shared, own)
    assert (offsets is None) == (bias == 0.0) and (offsets is None or np.array_equal(offsets, own_offsets))
    (copy,) = [entry for entry in folder.iterdir() if entry.is_dir()]
    assert stat.S_IMODE(copy.stat().st_mode) == 0o700

    def unread(*args, **kwargs):
        raise AssertionError("the table was read again")

    monkeypatch.setattr(stats, "read_clipped", unread)
    again_index, (again, _) = stats.shared_clipped(path, "digest-1", settings_, str(folder))
    np.testing.assert_array_equal(again_index.ids, own_index.ids)
    np.testing.assert_array_equal(again, own)
    monkeypatch.undo()
    other = _users_table(tmp_path, settings_, rows=300, seed=9)
    _, (newer, _) = stats.shared_clipped(other, "digest-2", settings_, str(folder))
    assert newer.shape[0] == 300 and [entry for entry in folder.iterdir() if entry.is_dir()] != [copy]
    assert not copy.exists() and os.path.exists(folder / "ssp-clipped-lock")
    np.testing.assert_array_equal(shared, own)  # mapped before its files were removed


def test_workers_that_ask_at_once_wait_for_one_copy(tmp_path, monkeypatch):
    # two workers of an executor ask for the same release's vectors at once: one reads the table,
    # the other waits on the lock and maps what it wrote
    import threading
    import time

    from pipelines.releases import stats_core

    settings_ = stats_core.StatsSettings(3, clip_u=0.8, clip_y=2.0)
    path, reads, results = _users_table(tmp_path, settings_), [], []
    read = stats.read_clipped

    def slow_read(*args, **kwargs):
        reads.append(1)
        time.sleep(0.3)  # the other worker asks meanwhile
        return read(*args, **kwargs)

    monkeypatch.setattr(stats, "read_clipped", slow_read)
    workers = [
        threading.Thread(target=lambda: results.append(stats.shared_clipped(path, "d", settings_, str(tmp_path))))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(reads) == 1 and len(results) == 2
    np.testing.assert_array_equal(results[0][1][0], results[1][1][0])
