"""The secret noise seed of a run, and what binds it to the releases it was used for.

The seed is 32 bytes from the OS CSPRNG, kept in a seed file in the run's private directory with
the fingerprint of every release made with it, the ledger it serves and the run it is bound to.

- A release's fingerprint (an HMAC under the seed of its name, parameters and a keyed digest of
  every input table) is checked before the noise: the same index with another fingerprint is
  refused, the same fingerprint reproduces the release byte for byte.
- The noise is keyed by the fingerprint too (`release_seed`), so copies of a run folder that make
  one release on different data get independent noise.
- The file is bound to the first ledger that records with it and lists what it recorded
  (`missing_from` detects a ledger that lost rows); `bind_run` binds the seed to the run's settings
  and data; `start_round` records federated rounds.
- Table digests are order-independent multiset hashes: keyed (`SeedFile.digest_*`, MSet-Add-Hash
  over an AES-256 CBC-MAC of each row) for fingerprints, unkeyed (`content_digest_*`) for a data
  source's identity across runs.

docs/noise.md ("The seed and what binds it") has each rule and why.

Privacy: whoever holds the seed can remove the noise from every release of the run, so the file
stays in RUN/private/. Every change re-reads the file and is written atomically; callers serialise
releases with pipelines.base.lock.release_lock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.noise import SEED_BYTES
from schemas import storage
from schemas.errors import UserError

ROUND_STARTED, ROUND_UNREVEALED = "started", "refused unrevealed"  # SeedFile.rounds: the states of a federated round


class SeedReuseError(UserError):
    """A seed presented for a release it was not bound to."""


RELEASE_SEED_INFO = (
    b"ssp-recsys release seed v3\0"  # HKDF info, then the release index (8 bytes, big-endian) and its fingerprint
)
DIGEST_KEY_INFO = b"ssp-recsys table digest v1"  # HKDF info of the key of the fingerprints' table digests


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def new_seed() -> bytes:
    """A fresh secret seed from the OS CSPRNG."""
    return secrets.token_bytes(SEED_BYTES)


class SeedFile:
    """A seed and the release fingerprints it is bound to, stored as JSON at `path`."""

    def __init__(
        self,
        path: str,
        seed: bytes,
        releases: dict[int, str],
        *,
        ledgers: dict[str, list[int]] | None = None,
        run: str | None = None,
        outputs: dict[int, str] | None = None,
        rounds: dict[int, str] | None = None,
        account_charges: int = 0,
    ):
        self.path, self.seed, self.releases = path, seed, releases
        self.ledgers, self.run, self.outputs = ledgers or {}, run, outputs or {}
        self.rounds = (
            rounds or {}
        )  # release index -> ROUND_STARTED or ROUND_UNREVEALED (federated rounds, `start_round`)
        self.account_charges = (
            account_charges  # the most charges this run saw in its budget account (`witness_account`)
        )

    @classmethod
    def create(cls, path: str, seed: bytes | None = None) -> SeedFile:
        """Write a new seed file (a fresh CSPRNG seed unless one is given)."""
        seed = seed if seed is not None else new_seed()
        if len(seed) != SEED_BYTES:
            raise UserError(f"a seed has {SEED_BYTES} bytes, got {len(seed)}")
        seed_file = cls(path, seed, {})
        seed_file._save()
        return seed_file

    @classmethod
    def load(cls, path: str) -> SeedFile:
        storage.check_private(
            path, "the secret noise seed (whoever reads it can subtract the noise from every release)"
        )
        try:
            document = storage.read_json(path)
            seed = bytes.fromhex(document["seed"])
            releases = {int(index): str(fp) for index, fp in document.get("releases", {}).items()}
            ledgers = {
                str(ledger): sorted(int(i) for i in indices) for ledger, indices in document.get("ledgers", {}).items()
            }
            run = document.get("run")
            outputs = {int(index): str(digest) for index, digest in document.get("outputs", {}).items()}
            rounds = {int(index): str(state) for index, state in document.get("rounds", {}).items()}
            account_charges = int(document.get("account_charges", 0))
        except storage.MissingTableError:
            raise storage.MissingTableError(f"seed file not found: {path}") from None
        except (KeyError, ValueError, AttributeError, TypeError) as exc:
            raise UserError(f"{path} is not a seed file ({type(exc).__name__}: {exc})") from None
        if len(seed) != SEED_BYTES:
            raise UserError(f"{path}: a seed has {SEED_BYTES} bytes, this one has {len(seed)}")
        return cls(
            path,
            seed,
            releases,
            ledgers=ledgers,
            run=run,
            outputs=outputs,
            rounds=rounds,
            account_charges=account_charges,
        )

    def reload(self) -> None:
        """Take in what other holders of the file bound since it was read (the seed must not change)."""
        current = SeedFile.load(self.path)
        if current.seed != self.seed:
            raise SeedReuseError(
                f"{self.path} was replaced by another seed while in use; refusing to release with either"
            )
        self.releases, self.ledgers, self.run, self.outputs = (
            current.releases,
            current.ledgers,
            current.run,
            current.outputs,
        )
        self.rounds, self.account_charges = current.rounds, current.account_charges

    @classmethod
    def load_or_create(cls, path: str) -> SeedFile:
        return cls.load(path) if storage.exists(path) else cls.create(path)

    @classmethod
    def load_or_new(cls, path: str) -> SeedFile:
        """The seed file at `path`, or a fresh seed for it that is written on its first binding
        (so a job refused before its first release leaves no seed file behind)."""
        return cls.load(path) if storage.exists(path) else cls(path, new_seed(), {})

    def release_seed(self, release: int) -> bytes:
        """The secret that keys release `release`'s noise (privacy.noise takes it as its seed):
        HKDF-SHA256 of the seed with the index and the fingerprint the release is bound to, so
        different inputs never get the same noise, whatever happens to the seed file."""
        fingerprint = self.releases.get(int(release))
        if fingerprint is None:
            raise UserError(
                f"{self.path}: release {release} is not bound to this seed; its noise is keyed by its fingerprint"
            )
        return _hkdf(self.seed, RELEASE_SEED_INFO + int(release).to_bytes(8, "big") + bytes.fromhex(fingerprint))

    def digest_table(self, path: str) -> str:
        """The keyed (cryptographic) multiset digest of a stored table, for fingerprints."""
        return keyed_digest_batches(storage.iter_batches(path), self.digest_key())

    def digest_batches(self, batches: Iterable[pa.RecordBatch]) -> str:
        """The keyed (cryptographic) multiset digest of a table given as record batches."""
        return keyed_digest_batches(batches, self.digest_key())

    def digest_key(self) -> bytes:
        """The key of this seed's table digests (`keyed_digest_part`, for an engine's tasks): secret
        like the seed."""
        return _hkdf(self.seed, DIGEST_KEY_INFO)

    def _save(self) -> None:
        document = {
            "seed": self.seed.hex(),
            "releases": {str(i): fp for i, fp in sorted(self.releases.items())},
            "ledgers": {ledger: sorted(indices) for ledger, indices in sorted(self.ledgers.items())},
        }
        if self.run is not None:
            document["run"] = self.run
        if self.outputs:
            document["outputs"] = {str(i): digest for i, digest in sorted(self.outputs.items())}
        if self.rounds:
            document["rounds"] = {str(i): state for i, state in sorted(self.rounds.items())}
        if self.account_charges:
            document["account_charges"] = self.account_charges
        storage.write_json(document, self.path, private=True)

    def witness_account(self, path: str, charges: int) -> None:
        """Refuse a budget account with fewer charges than this run last saw in it (rolled back, or
        replaced by a copy from before), else remember its count: the run is a witness of every
        run's charges it has seen, not only of its own."""
        if storage.exists(self.path):
            self.reload()
        if charges < self.account_charges:
            raise UserError(
                f"the budget account {path} lists {charges} charges, fewer than the {self.account_charges} this run "
                "saw there "
                "(its seed file is the witness): it was rolled back or replaced. Those releases still count; restore "
                "it (nothing was released)"
            )
        if charges != self.account_charges and storage.exists(self.path):
            self.account_charges = charges
            self._save()

    def fingerprint(self, description: dict) -> str:
        """HMAC-SHA256 under the seed of a release description (canonical JSON)."""
        payload = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.seed, b"ssp-release-v1\0" + payload, hashlib.sha256).hexdigest()

    def check(self, release: int, fingerprint: str) -> None:
        """Refuse (without writing) if `release` is bound to another fingerprint."""
        bound = self.releases.get(release)
        if bound is not None and bound != fingerprint:
            raise SeedReuseError(
                f"the seed in {self.path} was already used for release {release} on different data or "
                "settings; reusing it would add the same noise to different statistics and reveal their "
                "difference exactly. Use a new run (no --seed-file) or the original inputs and flags."
            )

    def bind(self, release: int, fingerprint: str, ledger: str | None = None) -> None:
        """Bind `release` to `fingerprint` (and note that `ledger` recorded it), or refuse if it is
        bound to another one. Re-reads the file first, so no other holder's binding is dropped."""
        if storage.exists(self.path):
            self.reload()
        self.check(release, fingerprint)
        self.check_ledger(ledger)
        listed = ledger is None or release in self.ledgers.get(ledger, [])
        if self.releases.get(release) == fingerprint and listed:
            return
        self.releases[release] = fingerprint
        if ledger is not None:
            self.ledgers[ledger] = sorted(set(self.ledgers.get(ledger, [])) | {release})
        self._save()

    def check_ledger(self, ledger: str | None) -> None:
        """Refuse (without writing) a ledger other than the one this seed is bound to: a seed
        serves one run's ledger, so a seed file copied into another run is refused."""
        if ledger is not None and self.ledgers and ledger not in self.ledgers:
            raise SeedReuseError(
                f"the seed in {self.path} is bound to another privacy ledger (id {next(iter(self.ledgers))}), not "
                f"{ledger}; "
                "a seed serves one run: use a new run (no --seed-file)"
            )

    def record_output(self, release: int, digest: str) -> None:
        """Note the digest of what release `release` wrote, so a later job can check that a table
        it is handed is that release (and not, say, exact counts with the same schema)."""
        if storage.exists(self.path):
            self.reload()
        if release not in self.releases:
            raise UserError(
                f"{self.path}: release {release} is not bound to this seed; record its output after the release"
            )
        self.outputs[release] = digest
        self._save()

    def start_round(self, release: int) -> None:
        """Record that a federated round of release `release` starts (pipelines.engines.federated), or
        refuse if one started before and was not recorded refused unrevealed: the server may have
        unmasked its sum, and a new round would draw new noise for the same statistics. Callers
        hold the release lock, so two rounds of one release never both start."""
        if storage.exists(self.path):
            self.reload()
        if release not in self.releases:
            raise UserError(
                f"{self.path}: release {release} is not bound to this seed; start its round after the release"
            )
        if self.rounds.get(release) == ROUND_STARTED:
            raise UserError(
                f"a federated round of release {release} already ran (recorded in the seed file {self.path}): the "
                "server may have "
                "unmasked its sum, and a new round would draw new noise for the same statistics, a release the "
                "ledger has not "
                "planned; start a new run"
            )
        self.rounds[release] = ROUND_STARTED
        self._save()

    def round_unrevealed(self, release: int) -> None:
        """Record that release `release`'s round was refused before any client revealed a share
        (the server learned nothing): the one round that may run again, at no new charge."""
        if storage.exists(self.path):
            self.reload()
        if self.rounds.get(release) != ROUND_STARTED:
            raise UserError(f"{self.path}: no round of release {release} is running")
        self.rounds[release] = ROUND_UNREVEALED
        self._save()

    def missing_from(self, ledger: str, recorded: dict[int, str]) -> list[int]:
        """The releases this seed file saw recorded in `ledger` that it no longer lists with the
        same fingerprint (`recorded`: index -> fingerprint): a lost or replaced ledger."""
        return [i for i in self.ledgers.get(ledger, []) if recorded.get(i) != self.releases.get(i)]

    def run_fingerprint(self, description: dict) -> str:
        """The fingerprint of a training run's identity (its settings and data)."""
        return self.fingerprint({"run": description})

    def check_run(self, fingerprint: str) -> None:
        """Refuse (without writing) a seed bound to another training run, or already used for
        releases outside a training run."""
        if self.run == fingerprint:
            return
        if self.run is not None:
            raise SeedReuseError(
                f"the seed in {self.path} belongs to a run with other data or settings; reusing it would add the same "
                "noise to different statistics. Use a new run (no --seed-file) or the original data and flags."
            )
        if self.releases:
            raise SeedReuseError(
                f"the seed in {self.path} was already used for releases outside a training run; use a new seed (no "
                "--seed-file)"
            )

    def bind_run(self, fingerprint: str) -> None:
        """Bind the seed to one training run's settings and data; refuse it for any other."""
        if storage.exists(self.path):
            self.reload()
        self.check_run(fingerprint)
        if self.run != fingerprint:
            self.run = fingerprint
            self._save()


# ---------------------------------------------------------------------------------------------
# Order-independent digests of tables

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic), into `out` (which may be
    `h` itself) or a new array: in place, with one scratch array (a new array per operation costs
    more than the operations)."""
    if out is None:
        out = np.array(h, dtype=np.uint64)
    elif out is not h:
        np.copyto(out, h)
    scratch = np.empty_like(out)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
        np.right_shift(out, np.uint64(shift), out=scratch)
        np.bitwise_xor(out, scratch, out=out)
        if factor is not None:
            np.multiply(out, np.uint64(factor), out=out)
    return out


def _value_bits(column: pa.Array) -> np.ndarray | None:
    """A numeric column's values as 64-bit words (`_number_bits`' words; a null: a fixed word);
    None for a list or string column."""
    if pa.types.is_list(column.type) or _is_text(column.type):
        return None
    bits, flags = _number_bits(column)
    return bits if flags is None else np.where(flags != 0, np.uint64(0x9E3779B97F4A7C15), bits)


def _salt_word(salt: int) -> np.uint64:
    """What a column's salt adds to each of its values' words (modulo 2^64)."""
    return np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)


def _column_hash(column: pa.Array, salt: int) -> np.ndarray:
    """One uint64 per row, from the column's values (nulls hash to a fixed value)."""
    salt64 = np.uint64(salt)
    if pa.types.is_list(column.type):
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if lengths.size == 0:
            return np.zeros(0, dtype=np.uint64)
        flat = _column_hash(column.flatten(), salt + 1)
        position = np.arange(flat.size, dtype=np.int64) - np.repeat(np.r_[0, np.cumsum(lengths)[:-1]], lengths)
        with np.errstate(over="ignore"):
            per_value = mix64(flat ^ mix64(position.astype(np.uint64) + salt64))
        sums = np.zeros(lengths.size, dtype=np.uint64)
        filled = lengths > 0  # reduceat over the non-empty lists' starts (strictly increasing)
        if filled.any():
            sums[filled] = np.add.reduceat(per_value, np.r_[0, np.cumsum(lengths)[:-1]][filled])
        with np.errstate(over="ignore"):
            hashed = mix64(sums + lengths.astype(np.uint64) * salt64)
        if column.null_count:  # a null list differs from an empty one
            hashed = np.where(
                column.is_null().to_numpy(zero_copy_only=False), np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(salt), hashed
            )
        return hashed
    bits = _value_bits(column)
    if bits is None:  # a string column
        values = [
            hashlib.blake2b(v.encode(), digest_size=8).digest() if v is not None else b"\0" * 8
            for v in column.to_pylist()
        ]
        bits = np.frombuffer(b"".join(values), dtype=np.uint64) if values else np.zeros(0, np.uint64)
    with np.errstate(over="ignore"):
        hashed = np.add(bits, _salt_word(salt))  # a new array: bits may be Arrow's
    return mix64(hashed, out=hashed)


_FOLD = np.uint64(0xD6E8FEB86659FD93)


def content_digest_batches(batches: Iterable[pa.RecordBatch]) -> str:
    """The unkeyed order-independent digest of a table given as record batches (hex SHA-256 of
    sums of 64-bit mixes): identifies content, resists no adversary. A numeric column is mixed into
    its rows' numbers by the compiled kernels (privacy.mixing) straight from its values."""
    from privacy import mixing  # numba's import, on the first digest

    total = folded = np.uint64(0)
    rows = 0
    names = None
    for batch in batches:
        if names is None:
            names = batch.schema.names
        row = np.zeros(batch.num_rows, dtype=np.uint64)
        for salt, name in enumerate(batch.schema.names, start=1):
            column = batch.column(name)
            bits = _value_bits(column)
            if bits is None:
                mixing.absorb_hashes(row, _column_hash(column, salt * 1000))
            else:
                mixing.absorb_values(row, bits, _salt_word(salt * 1000))
        batch_total, batch_folded = mixing.sums(row, _FOLD)
        with np.errstate(over="ignore"):
            total, folded = total + np.uint64(batch_total), folded + np.uint64(batch_folded)
        rows += batch.num_rows
    payload = json.dumps({"columns": names, "rows": rows, "sum": int(total), "mixed": int(folded)}).encode()
    return hashlib.sha256(payload).hexdigest()


def content_digest_table(path: str) -> str:
    """The unkeyed content digest of a stored table, streamed batch by batch (the next read beside
    the last one's hashing)."""
    return content_digest_batches(storage.read_ahead(storage.iter_batches(path)))


# ---------------------------------------------------------------------------------------------
# Keyed multiset digests: MSet-Add-Hash over an AES-256 CBC-MAC of each row

_BLOCK = 16
_NULL = np.uint64(0xFFFFFFFFFFFFFFFF)


def _ecb(key: bytes):
    return Cipher(algorithms.AES(key), modes.ECB()).encryptor()


def _prf(encryptor, blocks: np.ndarray) -> np.ndarray:
    """AES of each 16-byte row of `blocks` (uint64 pairs), vectorised."""
    return np.frombuffer(encryptor.update(np.ascontiguousarray(blocks).tobytes()), dtype=np.uint64).reshape(-1, 2)


class _Chain:
    """The CBC-MAC state of a batch's rows, x <- AES(x ^ block), kept in one buffer reused from batch
    to batch and encrypted in place (AES-ECB maps each 16 bytes to 16 bytes): no fresh memory per
    column, which costs more here than the AES itself."""

    def __init__(self, encryptor):
        self._encryptor, self._buffer = encryptor, np.zeros(0, dtype=np.uint64)

    def start(self, rows: int) -> np.ndarray:
        """The zeroed state of `rows` rows ((rows, 2) uint64)."""
        if self._buffer.size < 2 * rows + 2:  # update_into wants a block's room beyond the data
            self._buffer = np.empty(2 * rows + 2, dtype=np.uint64)
        self._bytes = 16 * rows
        state = self._buffer[: 2 * rows].reshape(rows, 2)
        state[:] = 0
        return state

    def absorb(self, state: np.ndarray, block: np.ndarray) -> None:
        """state <- AES(state ^ block), in place."""
        np.bitwise_xor(state, block, out=state)
        self.encrypt(state)

    def absorb_numbers(self, state: np.ndarray, column: pa.Array) -> None:
        """`absorb` of a number column's block (`_number_bits`), XORed into the state's two halves
        directly: no block array."""
        bits, flags = _number_bits(column)
        np.bitwise_xor(state[:, 0], bits, out=state[:, 0])
        if flags is not None:
            np.bitwise_xor(state[:, 1], flags, out=state[:, 1])
        self.encrypt(state)

    def encrypt(self, state: np.ndarray) -> None:
        """state <- AES(state), in place."""
        if not self._bytes:  # an empty batch
            return
        written = self._encryptor.update_into(memoryview(state).cast("B"), memoryview(self._buffer).cast("B"))
        if written != self._bytes:
            raise RuntimeError(f"AES-ECB wrote {written} bytes of {self._bytes}")


def _value_blocks(column: pa.Array, list_key) -> list[np.ndarray]:
    """A column as fixed-width blocks per row ((rows, 2) uint64 each), injective per value type:
    numbers as their 64 bits and a null flag; strings as their BLAKE2b-128; lists as their length
    and null flag, and the keyed sum of their (position, value) PRF values."""
    rows = len(column)
    if _is_list(column.type):
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        flat = column.flatten()
        summed = np.zeros((rows, 2), dtype=np.uint64)
        if len(flat):
            x = _list_value_prfs(flat, lengths, starts, list_key)
            filled = lengths > 0
            with np.errstate(over="ignore"):
                if lengths.min() == lengths.max():  # lists of one length: each row's run of values summed
                    from privacy import mixing  # numba's import, on the first digest

                    mixing.row_pair_sums(x, int(lengths[0]), summed)
                else:
                    summed[filled] = np.add.reduceat(x, starts[filled], axis=0)
        head = np.zeros((rows, 2), dtype=np.uint64)
        head[:, 0] = lengths.astype(np.uint64)
        if column.null_count:
            head[:, 1] = np.where(column.is_null().to_numpy(zero_copy_only=False), _NULL, np.uint64(0))
        return [head, summed]
    block = np.zeros((rows, 2), dtype=np.uint64)
    if _is_text(column.type):
        values = [
            hashlib.blake2b(v.encode(), digest_size=_BLOCK).digest() if v is not None else b"\xff" * _BLOCK
            for v in column.to_pylist()
        ]
        return [np.frombuffer(b"".join(values), dtype=np.uint64).reshape(-1, 2) if values else block]
    block[:, 0], flags = _number_bits(column)
    if flags is not None:
        block[:, 1] = flags
    return [block]


def _list_value_prfs(flat: pa.Array, lengths: np.ndarray, starts: np.ndarray, list_key) -> np.ndarray:
    """The PRF value of each list value (flattened: `flat`): the CBC-MAC under the list key of its
    (position in its list, value) blocks. A number's one block is written straight into the buffer
    that AES encrypts in place (no block arrays: they cost more than the AES)."""
    x = np.empty(2 * len(flat) + 2, dtype=np.uint64)  # AES-ECB wants a block's room beyond the data
    pairs = x[: 2 * len(flat)].reshape(-1, 2)
    if lengths.min() == lengths.max():
        pairs.reshape(lengths.size, -1, 2)[:, :, 1] = np.arange(lengths[0], dtype=np.uint64)
    else:
        pairs[:, 1] = (np.arange(len(flat), dtype=np.int64) - np.repeat(starts, lengths)).astype(np.uint64)
    if _is_list(flat.type) or _is_text(flat.type):
        pairs[:, 0] = 0
        for block in _value_blocks(flat, list_key):
            pairs[:] = _prf(list_key, pairs ^ block)
        return pairs
    pairs[:, 0], flags = _number_bits(flat)
    if flags is not None:
        np.bitwise_xor(pairs[:, 1], flags, out=pairs[:, 1])
    written = list_key.update_into(memoryview(pairs).cast("B"), memoryview(x).cast("B"))
    if written != 16 * len(flat):
        raise RuntimeError(f"AES-ECB wrote {written} bytes of {16 * len(flat)}")
    return pairs


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _number_bits(column: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A number column's block halves: each row's 64 bits (floats as float64, the rest as int64,
    nulls 0) and, when it has nulls, their flags (None otherwise)."""
    target = pa.float64() if pa.types.is_floating(column.type) else pa.int64()
    array = column if column.type == target else column.cast(target)
    data = (array.fill_null(0) if array.null_count else array).to_numpy(zero_copy_only=False)
    flags = np.where(array.is_null().to_numpy(zero_copy_only=False), _NULL, np.uint64(0)) if array.null_count else None
    return data.view(np.uint64), flags


def keyed_digest_batches(batches: Iterable[pa.RecordBatch], key: bytes) -> str:
    """The keyed multiset digest of a table given as record batches (hex SHA-256 of the column
    names, the row count and the sum of the rows' PRF values; see the module docstring)."""
    return keyed_digest_of([keyed_digest_part(batches, key)])


def keyed_digest_part(batches: Iterable[pa.RecordBatch], key: bytes) -> tuple[list[str] | None, int, list[int]]:
    """What some of a table's rows add to its keyed digest: (column names, None for no batch; rows;
    the sum of their PRF values as two 64-bit halves). The sum is order-free, so the parts of a
    table's files, taken anywhere, make its digest (`keyed_digest_of`)."""
    chain, list_key = _Chain(_ecb(_hkdf(key, b"rows"))), _ecb(_hkdf(key, b"list values"))
    total = np.zeros(2, dtype=np.uint64)
    rows, columns = 0, None
    for batch in batches:
        columns = columns or batch.schema.names
        x = chain.start(batch.num_rows)
        for column in batch.columns:
            if _is_list(column.type) or _is_text(column.type):
                for block in _value_blocks(column, list_key):
                    chain.absorb(x, block)
            else:
                chain.absorb_numbers(x, column)
        with np.errstate(over="ignore"):  # each half summed alone: numpy sums pairs along axis 0 far slower
            total += np.array([x[:, 0].sum(dtype=np.uint64), x[:, 1].sum(dtype=np.uint64)])
        rows += batch.num_rows
    return columns, rows, [int(v) for v in total]


def keyed_digest_of(parts: Iterable[tuple[list[str] | None, int, list[int]]]) -> str:
    """The keyed digest of a table from the `keyed_digest_part`s of its rows (any split, any order)."""
    columns, rows, total = None, 0, [0, 0]
    for names, count, halves in parts:
        columns = columns or names
        rows += count
        total = [(a + b) % 2**64 for a, b in zip(total, halves, strict=True)]
    payload = json.dumps({"columns": columns, "rows": rows, "sum": total}).encode()
    return hashlib.sha256(payload).hexdigest()
