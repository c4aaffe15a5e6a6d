"""Engine-free pieces of the stats job, shared by the Spark job and the Beam pipeline.

The job is one pass: rows (user, item, label) joined with the user's embedding and the item's DP
count -> per user, weights (privacy.weights) and clipped, weighted contributions -> per batch,
partial sums per item (privacy.accumulator.grouped_sums) -> merged by item -> noise added once per
item (privacy.accumulator.finalize), for EVERY catalog item, rows or not -> one stats table per
resample, written as part files by the workers and committed by the driver.

Privacy: the functions here see private rows; what leaves them (the finished stats tables) is
noised. Weights need all of a user's rows at once: callers hand `user_contributions` complete users.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from privacy import accumulator
from privacy.clipping import check_bound
from privacy.weights import DEFAULT_EXPONENT, example_level_weights, user_level_weights
from schemas.arrays import binary_to_matrix, matrix_to_binary, matrix_to_list_column
from schemas.tables import STATS

# A partial sum of one item's statistics: `sums` holds a_upper then b as float64 bytes (null: the
# row only declares a catalog item); `source` orders partials for a deterministic merge.
PARTIALS = pa.schema(
    [
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("source", pa.int64(), nullable=False),
        pa.field("sums", pa.binary()),
    ]
)
UNITS = ("user", "example")


@dataclass(frozen=True)
class StatsSettings:
    """How rows become statistics: dimension, clip norms, unit of privacy and weights."""

    dim: int
    clip_u: float
    clip_y: float
    unit: str = "user"
    wbar: float = 1.0
    weight_exponent: float = DEFAULT_EXPONENT

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"--dim must be a positive integer, got {self.dim}")
        check_bound("--clip-u", self.clip_u, allow_inf=True)  # inf: no clipping, for non-private runs only
        check_bound("--clip-y", self.clip_y, allow_inf=True)
        check_bound("--wbar", self.wbar)
        if self.unit not in UNITS:
            raise ValueError(f"unit of privacy must be one of {UNITS}, got {self.unit!r}")
        if self.unit == "example" and self.wbar != 1.0:
            raise ValueError("example-level privacy has weights 1 (wbar = 1)")
        if not math.isfinite(self.weight_exponent):
            raise ValueError(f"--weight-exponent must be finite, got {self.weight_exponent}")

    def to_json(self) -> dict:
        return asdict(self)


def user_contributions(
    user_ids: np.ndarray, item_ids: np.ndarray, labels: np.ndarray, embeddings: np.ndarray, counts: np.ndarray, settings: StatsSettings
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(item_ids, x, c) for complete users' rows: x = sqrt(w) Clip(u), c = w Clip(y) Clip(u)."""
    if settings.unit == "user":
        weights = user_level_weights(user_ids, counts, settings.wbar, settings.weight_exponent)
    else:
        weights = example_level_weights(len(item_ids))
    x, c = accumulator.prepare_rows(embeddings, labels, weights, settings.clip_u, settings.clip_y)
    return np.asarray(item_ids), x, c


def partials_batches(keys: np.ndarray, a_upper: np.ndarray, b: np.ndarray, source: int, rows_per_batch: int = 8192):
    """Partial sums as Arrow record batches of the PARTIALS schema."""
    sums = np.hstack([a_upper, b])
    for start in range(0, len(keys), rows_per_batch):
        part = slice(start, start + rows_per_batch)
        yield pa.RecordBatch.from_arrays(
            [pa.array(keys[part], pa.int64()), pa.array(np.full(len(keys[part]), source, np.int64)), matrix_to_binary(sums[part])], schema=PARTIALS
        )


class PartialSums:
    """The partial sums of a set of items, merged in order of (item, source).

    All partials are held until `result()` and summed in that fixed order, so the result is
    bit-identical whatever order an engine delivers them in (memory: the partials of the items
    this worker merges).
    """

    def __init__(self, d: int):
        self.d, self.t = d, accumulator.packed_size(d)
        self._keys, self._sources, self._a, self._b = [], [], [], []
        self._items = [np.zeros(0, np.int64)]

    def add(self, keys: np.ndarray, sources: np.ndarray, a_upper: np.ndarray, b: np.ndarray) -> None:
        self._keys.append(np.asarray(keys, np.int64))
        self._sources.append(np.asarray(sources, np.int64))
        self._a.append(np.asarray(a_upper, np.float64).reshape(-1, self.t))
        self._b.append(np.asarray(b, np.float64).reshape(-1, self.d))

    def declare(self, items: np.ndarray) -> None:
        """Items that must appear in the result even without rows (every catalog item)."""
        self._items.append(np.asarray(items, np.int64))

    def add_batch(self, batch: pa.RecordBatch) -> None:
        """Add rows of the PARTIALS schema; rows with null sums only declare their item."""
        present = batch.column("sums").is_valid()
        self.declare(batch.column("item_id").to_numpy())
        if pc.any(present).as_py():
            kept = batch.filter(present)
            sums = binary_to_matrix(kept.column("sums"), self.t + self.d)
            self.add(kept.column("item_id").to_numpy(), kept.column("source").to_numpy(), sums[:, : self.t], sums[:, self.t :])

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(every item added or declared, sorted; summed a_upper; summed b), zeros where no rows."""
        keys = np.concatenate(self._keys) if self._keys else np.zeros(0, np.int64)
        items = np.union1d(np.concatenate(self._items), keys)
        a = np.zeros((items.size, self.t))
        b = np.zeros((items.size, self.d))
        if keys.size:
            order = np.lexsort((np.concatenate(self._sources), keys))
            keys, a_sum, b_sum = accumulator.reduce_by_key(keys[order], np.concatenate(self._a)[order], np.concatenate(self._b)[order])
            rows = np.searchsorted(items, keys)
            a[rows], b[rows] = a_sum, b_sum
        return items, a, b


def stats_table(items: np.ndarray, a_upper: np.ndarray, b: np.ndarray, metadata: dict[str, str]) -> pa.Table:
    """Finished statistics as a table of the STATS schema with the release parameters as metadata."""
    return pa.Table.from_arrays(
        [pa.array(items, pa.int64()), matrix_to_list_column(a_upper), matrix_to_list_column(b)],
        schema=STATS.with_metadata({key.encode(): str(value).encode() for key, value in metadata.items()}),
    )


def release_metadata(settings: StatsSettings, spec: accumulator.NoiseSpec, resample: int) -> dict[str, str]:
    """The stats file metadata: enough for anyone to check the noise scale."""
    return {
        "d": str(settings.dim),
        "noise_multiplier": repr(spec.noise_multiplier),
        "clip_u": repr(settings.clip_u),
        "clip_y": repr(settings.clip_y),
        "wbar": repr(settings.wbar),
        "release": str(spec.release),
        "resample": str(resample),
        "unit": settings.unit,
        "weight_exponent": repr(settings.weight_exponent),
    }
