"""Engine-free pieces of the stats job, shared by the Spark job and the Beam pipeline.

The job is one pass: rows (user, item, label) joined with the user's embedding and the item's DP
count -> weights (privacy.weights: each row's user-level weight needs its user's normaliser, a
sum over all of the user's rows) and clipped, weighted contributions -> sums per item
(privacy.accumulator.grouped_sums, merged when an engine pre-aggregates) -> noise added once per
item (privacy.accumulator.finalize), for EVERY catalog item, rows or not -> one stats table per
resample, written as part files by the workers and committed by the driver.

Privacy: the functions here see private rows; what leaves them (the finished stats tables) is
noised. The weights bound a user's contribution only if the normaliser covers all of the user's
rows: callers pass complete users, or normalisers computed over complete users.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from privacy import accumulator, quadratic
from privacy.clipping import biased_row_clip, check_bound, clip_labels, clip_rows_into, row_scales
from privacy.mixing import mixed_modulo
from privacy.weights import DEFAULT_EXPONENT, example_level_weights, user_level_weights, weights_from_normalisers
from schemas import storage
from schemas.arrays import matrix_to_list_column
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import STATS

UNITS = ("user", "example")
LOSSES = ("square", *quadratic.LOSSES)
# Noised statistics are incompressible and their min/max say nothing: Parquet writes them as they are
STATS_PARQUET = {"compression": "none", "use_dictionary": False, "write_statistics": False}
ROWS_PER_SHARD = 2_000_000  # rows per item shard, at most on average: a reduce task's rows (24 bytes each) and sort
ITEM_SHARDS = b"ssp.item_shards"  # a file's Parquet metadata: S, each of its row groups holds one item shard of S


@dataclass(frozen=True)
class StatsSettings:
    """How rows become statistics: dimension, clip norms, unit of privacy and weights."""

    dim: int
    clip_u: float
    clip_y: float
    unit: str = "user"
    wbar: float = 1.0
    weight_exponent: float = DEFAULT_EXPONENT
    loss: str = (
        "square"  # "logistic": SSP-convex's H_j, g_j of implicit feedback around an expansion point (privacy.quadratic)
    )
    # > 0: user vectors are [u, 1, b_u], released as [Clip(u), c] with labels y - b_u, c = bias x clip_u (see
    # `user_contributions`)
    bias: float = 0.0
    # the labels are each row's confidence (the ranking protocol): its weight within the user's budget, label 1
    confidence: bool = False

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 1:
            raise UserError(f"--dim must be a positive integer, got {self.dim}")
        check_bound("--clip-u", self.clip_u, allow_inf=True)  # inf: no clipping, for non-private runs only
        check_bound("--clip-y", self.clip_y, allow_inf=True)
        check_bound("--wbar", self.wbar)
        if self.unit not in UNITS:
            raise UserError(f"unit of privacy must be one of {UNITS}, got {self.unit!r}")
        if self.unit == "example" and self.wbar != 1.0:
            raise UserError("example-level privacy has weights 1 (wbar = 1)")
        if not math.isfinite(self.weight_exponent):
            raise UserError(f"--weight-exponent must be finite, got {self.weight_exponent}")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "logistic" and self.weight_exponent != 0:
            raise UserError(
                "--loss logistic weighs each user's positives and negatives itself (privacy.quadratic): weight "
                "exponent 0"
            )
        if not (math.isfinite(self.bias) and self.bias >= 0):
            raise UserError(f"the bias coordinate must be a finite number >= 0 (0: no biases), got {self.bias}")
        if self.bias and self.loss != "square":
            raise UserError("biases need the square loss")
        if self.confidence and self.loss != "square":
            raise UserError(
                "row confidences need the square loss (the logistic loss weighs each user's positives itself)"
            )

    @property
    def user_dim(self) -> int:
        """Length of the user vectors the job reads: d, or with biases d + 1 ([u, 1, b_u] for d - 1
        embedding coordinates, none for the per-item mean, and the released bias coordinate)."""
        return self.dim + 1 if self.bias else self.dim

    @property
    def bias_scale(self) -> float:
        """c, the constant coordinate appended to Clip(u) with biases: `bias` times clip_u, the share
        of the clip it takes (its cost: the noise grows by sqrt(1 + bias^2)); 1 when nothing is
        clipped (no noise to share: the bias is then as free as the embedding)."""
        if not self.bias:
            return 0.0
        return self.bias * self.clip_u if math.isfinite(self.clip_u) else 1.0

    def noise_clips(self) -> tuple[float, float]:
        """(clip_u, clip_y) that set the noise's scale: the clips themselves, or for the logistic
        loss the effective ones that bound its H_j and g_j (privacy.quadratic.effective_clips)."""
        if self.loss == "logistic":
            return quadratic.effective_clips(self.clip_u)
        if not self.bias:
            return self.clip_u, self.clip_y
        if not math.isfinite(self.clip_u):  # non-private: nothing is clipped
            return self.clip_u, self.clip_y
        return biased_row_clip(self.clip_u, self.bias, has_embedding=self.dim > 1), self.clip_y

    def to_json(self) -> dict:
        return asdict(self)


def user_contributions(
    user_ids: np.ndarray,
    item_ids: np.ndarray,
    labels: np.ndarray,
    embeddings: np.ndarray,
    counts: np.ndarray,
    *,
    settings: StatsSettings,
    normalisers: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(item_ids, kernel rows [sqrt(w) Clip(u), sqrt(w) Clip(y)]) for rows (privacy.accumulator.prepare_rows).

    User-level weights need each row's user normaliser: given (computed by the engine over all
    the user's rows), or computed here, in which case the rows must hold complete users.

    With biases the user vectors are [u, 1, b_u] and the rows [sqrt(w) [Clip(u), c], sqrt(w) Clip(y - b_u)]:
    the constant c makes the last coordinate of A_j the item's weighted count (times c^2) and of b_j
    its label sum, so the item bias is fitted with the embedding; the user's own bias leaves the
    label first. |[Clip(u), c]| <= sqrt(clip_u^2 + c^2), the clip the noise is scaled to (`noise_clips`).

    With `settings.confidence` each row's label is its confidence (implicit feedback's repeats): it
    scales the row's weight inside the user's normalised budget (privacy.weights), and the label
    itself is 1, a positive. The normalisers must then be computed with the same confidences.
    """
    weights, labels = row_weights(user_ids, labels, counts, settings, normalisers)
    if settings.bias:
        embeddings, user_biases = biased_user_rows(embeddings, settings)
        labels = labels - user_biases
    return np.asarray(item_ids), accumulator.prepare_rows(
        embeddings, labels, weights, settings.noise_clips()[0], settings.clip_y
    )


def item_user_order(users: np.ndarray, rated: np.ndarray) -> np.ndarray:
    """The rows' order by (item, user), as np.lexsort((users, rated)): the order a task sums its rows
    in, so that reruns give the same bits whatever order the shuffle delivered them in. Two stable
    passes, by user then by item (compiled counting sorts where the ids are dense)."""
    by_user = accumulator.stable_order(users)
    return by_user[accumulator.stable_order(rated[by_user])]


def item_sums(
    user_ids: np.ndarray,
    item_ids: np.ndarray,
    labels: np.ndarray,
    *,
    users: tuple[np.ndarray, np.ndarray | None],
    user_rows: np.ndarray,
    counts: np.ndarray,
    settings: StatsSettings,
    normalisers: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted items, a_upper, b): the sums of `user_contributions`' rows per item, read from one
    clipped vector per user (`clipped_users`: `users`, row i's user at position user_rows[i]) instead
    of a copy of it per row (privacy.accumulator.weighted_grouped_sums); the same math."""
    weights, labels = row_weights(user_ids, labels, counts, settings, normalisers)
    vectors, offsets = users
    if offsets is not None:
        labels = labels - offsets[user_rows]
    return accumulator.weighted_grouped_sums(
        item_ids, vectors, user_rows, weights, clip_labels(labels, settings.clip_y)
    )


def clipped_users(
    embeddings: np.ndarray, settings: StatsSettings, out: tuple[np.ndarray, np.ndarray | None] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """(each user's vector as the statistics read it, clipped to `noise_clips()[0]`; the users' biases,
    which leave the label first, or None): `user_contributions`' vectors, once per user (`item_sums`),
    written into `out` when given, in one compiled pass (privacy.clipping.clip_rows_into)."""
    width = embeddings.shape[1] - (1 if settings.bias else 0)  # [u, 1, b_u] -> [Clip(u), c]
    vectors, offsets = out or (np.empty((len(embeddings), width)), np.empty(len(embeddings)) if settings.bias else None)
    bound = settings.noise_clips()[0]
    if settings.bias:
        clip_rows_into(embeddings, bound, vectors, head_bound=settings.clip_u, constant=settings.bias_scale)
        offsets[:] = embeddings[:, -1]
    else:
        clip_rows_into(embeddings, bound, vectors)
    return vectors, offsets


def row_weights(
    user_ids: np.ndarray,
    labels: np.ndarray,
    counts: np.ndarray,
    settings: StatsSettings,
    normalisers: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(each row's weight, its label) as `user_contributions` describes: with confidences the label
    becomes the weight's factor and the label 1."""
    confidence = None
    labels = np.asarray(labels, dtype=np.float64)
    if settings.confidence:
        confidence, labels = labels, np.ones(len(labels))
    if settings.unit == "example":
        weights = example_level_weights(len(labels)) * (1.0 if confidence is None else confidence)
    elif normalisers is None:
        weights = user_level_weights(user_ids, counts, settings.wbar, settings.weight_exponent, confidence)
    else:
        weights = weights_from_normalisers(counts, normalisers, settings.wbar, settings.weight_exponent, confidence)
    return weights, labels


def biased_user_rows(vectors: np.ndarray, settings: StatsSettings) -> tuple[np.ndarray, np.ndarray]:
    """([Clip(u), c], b_u) of user vectors [u, 1, b_u]: what a biased model's item update fits to,
    the label less the user's bias (the statistics here, AM-DPSGD's rows too). Its norm is at most
    `noise_clips()[0]`."""
    vectors = np.asarray(vectors, dtype=np.float64)
    u = vectors[:, :-2]
    return np.hstack(
        [u * row_scales(u, settings.clip_u)[:, None], np.full((u.shape[0], 1), settings.bias_scale)]
    ), vectors[:, -1]


@dataclass(frozen=True)
class RowLookups:
    """What an engine's item task looks up per row (broadcast once): the catalog's DP counts and,
    at user level, each user's weight normaliser (None at example level). The rows were checked
    by `StatsJob.prepare()`: every item is in the catalog, every user has a normaliser."""

    catalog: IdIndex
    counts: np.ndarray
    users: IdIndex | None
    normalisers: np.ndarray | None

    def of(self, users: np.ndarray, rated: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(DP count of each row's item, normaliser of each row's user or None)."""
        counts = self.counts[self.catalog.positions(rated, "catalog item")]
        return counts, None if self.users is None else self.normalisers[self.users.positions(users, "user")]


def shards_for(rows: int, shards: int) -> int:
    """A release's item shards: `shards`, or more when `rows` need more reduce tasks' memory."""
    return max(shards, -(-rows // ROWS_PER_SHARD))


def declared_item_shards(path: str) -> int | None:
    """S when every file of the table at `path` declares that each of its row groups holds the rows
    of one item shard of S (ITEM_SHARDS, written by `mean.write_centred_parts`); else None. A
    declaration is a claim: `StatsJob.prepare()` checks every row against it before any release."""
    declared = {storage.file_metadata(file).get(ITEM_SHARDS) for file in storage.table_files(path)}
    if len(declared) != 1 or None in declared:
        return None
    value = next(iter(declared))
    return int(value) if value.isdigit() and int(value) > 0 else None


def by_shard(item_ids: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rows' order grouped by item shard, each keeping the rows' order; cuts: shard k's rows
    are order[cuts[k] : cuts[k + 1]])."""
    shard = shard_of(item_ids, shards)
    order = accumulator.stable_order(shard)
    return order, np.searchsorted(shard[order], np.arange(shards + 1))


def shard_of(item_ids: np.ndarray, shards: int) -> np.ndarray:
    """The item shard (0..shards-1) of each item id: a fixed hash, the same on every worker and run."""
    values = np.ascontiguousarray(item_ids, dtype=np.int64)
    shard = np.empty(values.shape, np.int64)
    mixed_modulo(values.view(np.uint64), np.uint64(shards), shard)  # compiled: splitmix64, then the modulo
    return shard


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
        "loss": settings.loss,
        "bias": repr(settings.bias),
    }
