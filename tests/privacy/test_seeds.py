"""privacy.seeds: the secret seed, its binding to releases, and order-independent table digests."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy import seeds
from schemas import storage

SEED = bytes(range(32))


def test_new_seed_is_32_random_bytes():
    drawn = {seeds.new_seed() for _ in range(20)}
    assert len(drawn) == 20
    assert all(isinstance(s, bytes) and len(s) == 32 for s in drawn)


def test_seed_file_create_load_round_trip(tmp_path):
    path = str(tmp_path / "private" / "seed.json")
    created = seeds.SeedFile.create(path, SEED)
    assert created.seed == SEED and created.releases == {}
    loaded = seeds.SeedFile.load(path)
    assert loaded.seed == SEED and loaded.releases == {}
    assert json.loads(open(path).read())["seed"] == SEED.hex()


def test_seed_file_create_draws_a_fresh_seed(tmp_path):
    a = seeds.SeedFile.create(str(tmp_path / "a.json"))
    b = seeds.SeedFile.create(str(tmp_path / "b.json"))
    assert len(a.seed) == 32 and a.seed != b.seed
    assert seeds.SeedFile.load(str(tmp_path / "a.json")).seed == a.seed


def test_load_or_create(tmp_path):
    path = str(tmp_path / "seed.json")
    first = seeds.SeedFile.load_or_create(path)
    first.bind(0, "fp0")
    second = seeds.SeedFile.load_or_create(path)
    assert second.seed == first.seed and second.releases == {0: "fp0"}


def test_bind_same_fingerprint_twice_is_fine(tmp_path):
    path = str(tmp_path / "seed.json")
    sf = seeds.SeedFile.create(path, SEED)
    fp = sf.fingerprint({"name": "stats-1", "inputs": ["abc"]})
    sf.bind(3, fp)
    sf.bind(3, fp)
    assert sf.releases == {3: fp}
    seeds.SeedFile.load(path).bind(3, fp)  # also after a reload (a rerun)


def test_bind_other_fingerprint_raises_and_keeps_binding(tmp_path):
    path = str(tmp_path / "seed.json")
    sf = seeds.SeedFile.create(path, SEED)
    sf.bind(1, "first")
    with pytest.raises(seeds.SeedReuseError, match="release 1"):
        sf.bind(1, "second")
    assert issubclass(seeds.SeedReuseError, ValueError)
    assert sf.releases == {1: "first"}
    reloaded = seeds.SeedFile.load(path)
    assert reloaded.releases == {1: "first"}
    with pytest.raises(seeds.SeedReuseError):
        reloaded.bind(1, "second")
    reloaded.bind(2, "second")  # another release index is free
    assert seeds.SeedFile.load(path).releases == {1: "first", 2: "second"}


def test_binding_persists_across_load(tmp_path):
    path = str(tmp_path / "seed.json")
    sf = seeds.SeedFile.create(path, SEED)
    sf.bind(0, "a")
    sf.bind(10, "b")
    loaded = seeds.SeedFile.load(path)
    assert loaded.seed == SEED
    assert loaded.releases == {0: "a", 10: "b"}
    assert all(isinstance(k, int) for k in loaded.releases)


def test_a_seed_is_its_owners_alone_and_one_others_can_read_is_refused(tmp_path):
    import os
    import stat

    previous = os.umask(0o022)  # the common umask: new files readable by everyone
    try:
        seeds.SeedFile.create(str(tmp_path / "seed.json"), SEED)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "seed.json").st_mode) == 0o600
    os.chmod(tmp_path / "seed.json", 0o644)
    with pytest.raises(ValueError, match=r"seed.json: the secret noise seed .* can be read by others \(mode 0644\)"):
        seeds.SeedFile.load(str(tmp_path / "seed.json"))
    os.chmod(tmp_path / "seed.json", 0o600)
    assert seeds.SeedFile.load(str(tmp_path / "seed.json")).seed == SEED


def test_load_rejects_bad_files(tmp_path):
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"seed": "ab" * 16, "releases": {}}))
    short.chmod(0o600)
    with pytest.raises(ValueError, match="32 bytes"):
        seeds.SeedFile.load(str(short))
    not_seed = tmp_path / "other.json"
    not_seed.write_text(json.dumps({"hello": 1}))
    not_seed.chmod(0o600)
    with pytest.raises(ValueError, match="not a seed file"):
        seeds.SeedFile.load(str(not_seed))
    bad_hex = tmp_path / "hex.json"
    bad_hex.write_text(json.dumps({"seed": "zz" * 32}))
    bad_hex.chmod(0o600)
    with pytest.raises(ValueError, match="not a seed file"):
        seeds.SeedFile.load(str(bad_hex))


def test_fingerprint_deterministic_and_keyed(tmp_path):
    a = seeds.SeedFile(str(tmp_path / "a"), SEED, {})
    same = seeds.SeedFile(str(tmp_path / "b"), SEED, {})
    other = seeds.SeedFile(str(tmp_path / "c"), bytes(32), {})
    description = {"name": "stats/step-1", "clip_u": 1.0, "inputs": {"interactions": "d1", "embeddings": "d2"}}
    fp = a.fingerprint(description)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert same.fingerprint(description) == fp
    # key order in the description does not matter (canonical JSON)
    reordered = {"inputs": {"embeddings": "d2", "interactions": "d1"}, "clip_u": 1.0, "name": "stats/step-1"}
    assert a.fingerprint(reordered) == fp
    assert other.fingerprint(description) != fp
    assert a.fingerprint({**description, "clip_u": 1.5}) != fp


# ---------------------------------------------------------------------------------------------
# Digests


def sample_table(n=200, seed=0):
    rng = np.random.default_rng(seed)
    vectors = [list(rng.normal(size=int(rng.integers(0, 4)))) for _ in range(n)]
    names = [None if i % 7 == 0 else f"name-{int(rng.integers(0, 50))}" for i in range(n)]
    counts = [None if i % 5 == 0 else int(rng.integers(-3, 3)) for i in range(n)]
    return pa.table(
        {
            "id": pa.array(np.arange(n), pa.int64()),
            "x": pa.array(rng.normal(size=n), pa.float64()),
            "vec": pa.array(vectors, pa.list_(pa.float64())),
            "name": pa.array(names, pa.string()),
            "count": pa.array(counts, pa.int64()),
        }
    )


KEYED = seeds.SeedFile("unsaved", SEED, {})
DIGESTS = {
    "content": (seeds.content_digest_batches, seeds.content_digest_table),
    "keyed": (KEYED.digest_batches, KEYED.digest_table),
}


@pytest.fixture(params=sorted(DIGESTS))
def digest_batches(request):
    """Both multiset digests: the unkeyed content digest and the keyed one of the fingerprints."""
    return DIGESTS[request.param][0]


@pytest.fixture
def digest(digest_batches):
    return lambda table, chunk=None: digest_batches(table.to_batches(max_chunksize=chunk))


def test_digest_is_hex_sha256_and_deterministic(digest, digest_batches):
    t = sample_table()
    d = digest(t)
    assert len(d) == 64 and int(d, 16) >= 0
    assert digest(sample_table()) == d


def test_digest_independent_of_row_order_and_batching(digest, digest_batches):
    t = sample_table()
    d = digest(t)
    perm = np.random.default_rng(1).permutation(t.num_rows)
    shuffled = t.take(pa.array(perm))
    assert digest(shuffled) == d
    assert digest(t, chunk=1) == d
    assert digest(shuffled, chunk=17) == d
    # batches that are slices with offsets (as an engine would hand over)
    slices = [t.slice(0, 50), t.slice(50, 3), t.slice(53, 147)]
    assert digest_batches([b for s in slices for b in s.to_batches()]) == d
    assert digest_batches(reversed([b for s in slices for b in s.to_batches()])) == d


def test_digest_changes_when_one_value_changes(digest, digest_batches):
    t = sample_table()
    d = digest(t)
    for column, row, value in [
        ("x", 3, 0.5),
        ("id", 10, 999),
        ("name", 2, "other"),
        ("name", 0, "now set"),
        ("count", 5, 0),
        ("count", 6, None),
    ]:
        values = t[column].to_pylist()
        assert values[row] != value
        values[row] = value
        changed = t.set_column(t.schema.get_field_index(column), column, pa.array(values, t.schema.field(column).type))
        assert digest(changed) != d, (column, row, value)


def test_digest_changes_when_a_row_is_removed_or_duplicated(digest, digest_batches):
    t = sample_table()
    d = digest(t)
    assert digest(t.slice(1)) != d
    assert digest(pa.concat_tables([t, t.slice(4, 1)])) != d


def test_digest_list_columns_order_inside_a_list_matters(digest, digest_batches):
    base = pa.table({"vec": pa.array([[1.0, 2.0, 3.0], [4.0]], pa.list_(pa.float64()))})
    swapped = pa.table({"vec": pa.array([[2.0, 1.0, 3.0], [4.0]], pa.list_(pa.float64()))})
    moved = pa.table({"vec": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float64()))})
    rows_swapped = pa.table({"vec": pa.array([[4.0], [1.0, 2.0, 3.0]], pa.list_(pa.float64()))})
    assert digest(base) != digest(swapped)
    assert digest(base) != digest(moved)
    assert digest(base) == digest(rows_swapped)  # row order still does not matter
    changed = pa.table({"vec": pa.array([[1.0, 2.0, 3.5], [4.0]], pa.list_(pa.float64()))})
    assert digest(base) != digest(changed)


def test_digest_strings_and_nulls(digest, digest_batches):
    a = pa.table({"s": pa.array(["a", None, ""], pa.string()), "i": pa.array([1, None, 0], pa.int64())})
    assert digest(a) == digest(a.take(pa.array([2, 0, 1])))
    b = pa.table({"s": pa.array(["a", "", ""], pa.string()), "i": pa.array([1, None, 0], pa.int64())})
    c = pa.table({"s": pa.array(["a", None, ""], pa.string()), "i": pa.array([1, 0, 0], pa.int64())})
    assert len({digest(a), digest(b), digest(c)}) == 3
    # a null float differs from 0.0 and from NaN
    f = [pa.table({"f": pa.array(v, pa.float64())}) for v in ([None], [0.0], [float("nan")])]
    assert len({digest(t) for t in f}) == 3
    # nulls inside lists are hashed too
    l1 = pa.table({"v": pa.array([[1.0, None]], pa.list_(pa.float64()))})
    l2 = pa.table({"v": pa.array([[1.0, 0.0]], pa.list_(pa.float64()))})
    assert digest(l1) != digest(l2)


def test_digest_null_list_differs_from_empty_list(digest, digest_batches):
    with_null = pa.table({"v": pa.array([[1.0], None], pa.list_(pa.float64()))})
    with_empty = pa.table({"v": pa.array([[1.0], []], pa.list_(pa.float64()))})
    assert digest(with_null) != digest(with_empty)


def test_digest_depends_on_columns(digest, digest_batches):
    t = pa.table({"a": pa.array([1, 2], pa.int64()), "b": pa.array([3, 4], pa.int64())})
    renamed = t.rename_columns(["a", "c"])
    swapped_values = pa.table({"a": pa.array([3, 4], pa.int64()), "b": pa.array([1, 2], pa.int64())})
    mixed = pa.table({"a": pa.array([1, 4], pa.int64()), "b": pa.array([3, 2], pa.int64())})
    assert len({digest(t), digest(renamed), digest(swapped_values), digest(mixed)}) == 4


def test_digest_of_empty_batches_without_list_columns(digest, digest_batches):
    t = sample_table().drop_columns(["vec"])
    empty_batch = pa.RecordBatch.from_pylist([], schema=t.schema)
    d = digest_batches([empty_batch])
    assert d == digest_batches([empty_batch, empty_batch])  # empty batches add nothing
    assert d != digest(t.slice(0, 1))
    # an empty batch among real ones changes nothing
    assert digest_batches([*t.to_batches(), empty_batch]) == digest(t)


def test_digest_of_empty_batch_with_list_column(digest, digest_batches):
    t = sample_table()
    empty_batch = pa.RecordBatch.from_pylist([], schema=t.schema)
    assert digest_batches([*t.to_batches(), empty_batch]) == digest(t)


@pytest.mark.parametrize("rows_per_file", [1_000_000, 37])
def test_digest_table_on_stored_table_equals_in_memory(tmp_path, rows_per_file, digest, digest_batches):
    t = sample_table(300, seed=4)
    path = str(tmp_path / "t.parquet")
    storage.write_table(t, path, rows_per_file=rows_per_file)
    if rows_per_file == 37:
        assert len([f for f in os.listdir(path) if f.endswith(".parquet")]) == 9
    digest_table = next(table for batches, table in DIGESTS.values() if batches is digest_batches)
    assert digest_table(path) == digest(t)
    # a different stored table gives a different digest
    storage.write_table(t.slice(1), str(tmp_path / "u.parquet"))
    assert digest_table(str(tmp_path / "u.parquet")) != digest(t)


def test_keyed_digest_depends_on_the_key_and_is_the_content_digest_of_no_one():
    t = sample_table()
    other = seeds.SeedFile("other", bytes(32), {})
    assert KEYED.digest_batches(t.to_batches()) != other.digest_batches(t.to_batches())
    assert KEYED.digest_batches(t.to_batches()) != seeds.content_digest_batches(t.to_batches())


def test_release_seed_is_keyed_by_index_and_fingerprint(tmp_path):
    """A copy of a seed file gives different noise keys to the same index on different inputs."""
    sf = seeds.SeedFile.create(str(tmp_path / "seed"), SEED)
    copy = seeds.SeedFile(str(tmp_path / "copy"), SEED, {})
    sf.bind(0, sf.fingerprint({"inputs": "with the user"}))
    copy.bind(0, copy.fingerprint({"inputs": "without the user"}))
    assert sf.release_seed(0) != copy.release_seed(0)
    assert len(sf.release_seed(0)) == 32 and sf.release_seed(0) != SEED
    again = seeds.SeedFile(str(tmp_path / "again"), SEED, {})
    again.bind(0, again.fingerprint({"inputs": "with the user"}))
    assert again.release_seed(0) == sf.release_seed(0)  # identical inputs reproduce identical noise
    sf.bind(1, sf.fingerprint({"inputs": "with the user"}))
    assert sf.release_seed(1) != sf.release_seed(0)
    with pytest.raises(ValueError, match="release 2 is not bound"):
        sf.release_seed(2)


def test_a_seed_serves_one_ledger(tmp_path):
    sf = seeds.SeedFile.create(str(tmp_path / "seed"), SEED)
    sf.bind(0, "fp0", "ledger-a")
    sf.bind(1, "fp1", "ledger-a")
    with pytest.raises(seeds.SeedReuseError, match="bound to another privacy ledger"):
        sf.bind(2, "fp2", "ledger-b")
    assert seeds.SeedFile.load(sf.path).ledgers == {"ledger-a": [0, 1]}


def test_load_or_new_writes_nothing_until_bound(tmp_path):
    path = str(tmp_path / "private" / "seed")
    fresh = seeds.SeedFile.load_or_new(path)
    assert not os.path.exists(path)
    fresh.bind(0, "fp0")
    assert seeds.SeedFile.load(path).seed == fresh.seed


def test_keyed_digest_equals_its_definition_row_by_column():
    """The in-place, buffer-reusing chain (seeds._Chain, its number columns XORed in directly) gives
    the bits of the definition: per row, x <- AES(x ^ block) over the columns' blocks
    (`_value_blocks`, lists included), from zero; the digest hashes the rows' sum."""
    key = bytes(range(32))
    t = sample_table(300, seed=9)
    batches = t.to_batches(max_chunksize=64) + [pa.RecordBatch.from_pylist([], schema=t.schema)]
    row_key, list_key = seeds._ecb(seeds._hkdf(key, b"rows")), seeds._ecb(seeds._hkdf(key, b"list values"))
    total = np.zeros(2, dtype=np.uint64)
    for batch in batches:
        x = np.zeros((batch.num_rows, 2), dtype=np.uint64)
        for name in batch.schema.names:
            for block in seeds._value_blocks(batch.column(name), list_key):
                x = seeds._prf(row_key, x ^ block)
        with np.errstate(over="ignore"):
            total += x.sum(axis=0, dtype=np.uint64)
    payload = json.dumps({"columns": t.schema.names, "rows": t.num_rows, "sum": [int(v) for v in total]}).encode()
    assert seeds.keyed_digest_batches(batches, key) == hashlib.sha256(payload).hexdigest()


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 300), max_size=5), order=st.randoms(use_true_random=False))
def test_keyed_digest_parts_of_any_split_in_any_order_make_the_tables_digest(cuts, order):
    """What an engine's tasks take of their files (`keyed_digest_part`) adds up, whatever the rows'
    split into parts (empty parts included) and the parts' order, to the digest of the whole table;
    a part left out does not."""
    key = bytes(range(32))
    t = sample_table(300, seed=5)
    edges = [0, *sorted(cuts), t.num_rows]
    pieces = [t.slice(a, b - a) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    parts = [seeds.keyed_digest_part(piece.to_batches(), key) for piece in pieces]
    order.shuffle(parts)
    whole = seeds.keyed_digest_batches(t.to_batches(), key)
    assert seeds.keyed_digest_of(parts) == whole
    assert seeds.keyed_digest_of([part for part in parts if part[1]][1:]) != whole


def test_keyed_digest_of_numbers_and_strings_from_first_principles():
    """The blocks themselves, which the test above takes from `_value_blocks`: per row, in plain
    Python, the state starts at 0, each column's 16-byte block (a number's 64 bits and a null flag;
    a string's BLAKE2b-128) is XORed in and the state encrypted with AES-256 under the row key; the
    states' two 64-bit halves are summed mod 2^64."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    rng = np.random.default_rng(3)
    n = 300
    table = pa.table(
        {
            "user_id": pa.array(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)),
            "small": pa.array(rng.integers(-100, 100, n, dtype=np.int32)),
            "label": pa.array([None if k % 7 == 0 else float(rng.standard_normal()) for k in range(n)]),
            "timestamp": pa.array([None if k % 5 == 0 else k for k in range(n)], pa.int64()),
            "name": pa.array([None if k % 11 == 0 else f"x{k}" for k in range(n)]),
        }
    )
    aes = Cipher(algorithms.AES(seeds._hkdf(KEYED.digest_key(), b"rows")), modes.ECB()).encryptor()
    total = [0, 0]
    for row in table.to_pylist():
        state = bytes(16)
        for name, value in row.items():
            if name == "name":
                block = hashlib.blake2b(value.encode(), digest_size=16).digest() if value is not None else b"\xff" * 16
            else:
                bits = np.array([0 if value is None else value], np.float64 if name == "label" else np.int64)
                flag = 2**64 - 1 if value is None else 0
                block = bits.view(np.uint64).tobytes() + int(flag).to_bytes(8, "little")
            state = aes.update(bytes(a ^ b for a, b in zip(state, block, strict=True)))
        total = [(t + int.from_bytes(state[8 * k : 8 * k + 8], "little")) % 2**64 for k, t in enumerate(total)]
    payload = json.dumps({"columns": table.column_names, "rows": n, "sum": total}).encode()
    for chunk in (None, 1, 64):
        assert KEYED.digest_batches(table.to_batches(max_chunksize=chunk)) == hashlib.sha256(payload).hexdigest()


@pytest.mark.parametrize("ragged", [False, True])
def test_keyed_digest_of_list_columns_from_first_principles(ragged):
    """A list's two blocks, in plain Python: its length and null flag; then the sum mod 2^64 of its
    values' PRF values, each AES-256 under the list key of (the value's 64 bits, its position in the
    list XOR its null flag). Lists of one length and ragged ones, null values and null lists."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 5, 60) if ragged else np.full(60, 3)
    floats = [None if ragged and k % 9 == 0 else [float(v) for v in rng.normal(size=n)] for k, n in enumerate(lengths)]
    if ragged:
        floats[1] = [1.5, None, 2.0]
    ints = [[int(v) for v in rng.integers(-50, 50, 2)] for _ in lengths]
    table = pa.table(
        {"embedding": pa.array(floats, pa.list_(pa.float64())), "pair": pa.array(ints, pa.list_(pa.int32()))}
    )
    key = KEYED.digest_key()
    rows_aes = Cipher(algorithms.AES(seeds._hkdf(key, b"rows")), modes.ECB()).encryptor()
    list_aes = Cipher(algorithms.AES(seeds._hkdf(key, b"list values")), modes.ECB()).encryptor()

    def half(block: bytes, k: int) -> int:
        return int.from_bytes(block[8 * k : 8 * k + 8], "little")

    def block_of(a: int, b: int) -> bytes:
        return a.to_bytes(8, "little") + b.to_bytes(8, "little")

    total = [0, 0]
    for row in table.to_pylist():
        state = bytes(16)
        for name, values in row.items():
            summed = [0, 0]
            for position, value in enumerate(values or []):
                bits = np.array([0 if value is None else value], np.float64 if name == "embedding" else np.int64)
                flag = 2**64 - 1 if value is None else 0
                prf = list_aes.update(block_of(int(bits.view(np.uint64)[0]), position ^ flag))
                summed = [(s + half(prf, k)) % 2**64 for k, s in enumerate(summed)]
            head = block_of(len(values or []), 2**64 - 1 if values is None else 0)
            for block in (head, block_of(*summed)):
                state = rows_aes.update(bytes(a ^ b for a, b in zip(state, block, strict=True)))
        total = [(t + half(state, k)) % 2**64 for k, t in enumerate(total)]
    payload = json.dumps({"columns": table.column_names, "rows": table.num_rows, "sum": total}).encode()
    for chunk in (None, 7):
        assert KEYED.digest_batches(table.to_batches(max_chunksize=chunk)) == hashlib.sha256(payload).hexdigest()


def splitmix64_finaliser(x: int) -> int:
    """The splitmix64 finaliser on one Python int (Steele, Lea and Flood 2014), modulo 2^64."""
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_content_digest_is_sha256_of_the_rows_mixed_columns_summed_by_hand():
    """Each row's number mixes its numeric columns' 64-bit words in order (a null: a fixed word),
    each plus its salt (1000 x its position x the golden ratio word); the digest is SHA-256 of the
    rows' sums, plain and mixed once more (the compiled kernels give the same bits)."""
    table = pa.table({"id": pa.array([3, None, -1], pa.int64()), "x": pa.array([0.5, 2.0, -0.0])})
    mask, golden = 2**64 - 1, 0x9E3779B97F4A7C15
    total = mixed = 0
    for i in range(table.num_rows):
        row = 0
        for salt, name in enumerate(table.column_names, start=1):
            value = table[name][i].as_py()
            if value is None:
                word = golden
            elif isinstance(value, int):
                word = value & mask
            else:
                word = struct.unpack("<Q", struct.pack("<d", value))[0]
            row = splitmix64_finaliser(row ^ splitmix64_finaliser((word + salt * 1000 * golden) & mask))
        total, mixed = (total + row) & mask, (mixed + splitmix64_finaliser(row ^ 0xD6E8FEB86659FD93)) & mask
    payload = json.dumps({"columns": ["id", "x"], "rows": 3, "sum": total, "mixed": mixed}).encode()
    for chunk in (None, 1, 2):
        assert (
            seeds.content_digest_batches(table.to_batches(max_chunksize=chunk)) == hashlib.sha256(payload).hexdigest()
        )


def test_mix64_is_the_splitmix64_finaliser_in_place_or_into_a_new_array():
    values = np.random.default_rng(7).integers(0, 2**63, 1000, dtype=np.int64).view(np.uint64) * np.uint64(2)
    values[:3] = [0, 1, 2**64 - 1]
    expected = np.array([splitmix64_finaliser(int(v)) for v in values], dtype=np.uint64)
    given = values.copy()
    assert np.array_equal(seeds.mix64(given), expected) and np.array_equal(given, values)  # the input untouched
    out = np.empty_like(values)
    assert seeds.mix64(values, out=out) is out and np.array_equal(out, expected)
    assert seeds.mix64(given, out=given) is given and np.array_equal(given, expected)
