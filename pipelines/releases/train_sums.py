"""The prepare stage's sums over the training rows, taken before its first release: every row
checked as `ssp counts` checks it (counts.row_problem), the DP counts' exact aggregates, the DP
mean's weighted sums and the rows' keyed digest. An engine that reads its table a file at a time
takes them in one pass (the Spark engine); the others call their operations one after another
(`one_by_one`): the same numbers either way.

Privacy: the sums are private and only ever noised (pipelines.releases.counts, .mean); the digest
is keyed by the run's seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privacy.seeds import keyed_digest_batches
from schemas import storage


@dataclass(frozen=True)
class TrainSumsRequest:
    """What to sum: the counts' (sorted catalog, unit of privacy, K, sampling key), the mean's
    (`rating_range` None: no mean, the ranking protocol) and the digest's key."""

    catalog: np.ndarray
    unit: str
    max_items_per_user: int
    sampling_key: int
    rating_range: tuple[float, float] | None
    user_cap: float
    digest_key: bytes


@dataclass(frozen=True)
class TrainSums:
    """The exact item counts and number of units, the mean's (weighted sum, weighted count) (None
    without a mean) and the table's keyed digest."""

    counts: np.ndarray
    units: int
    mean_sums: tuple[float, float] | None
    digest: str


def one_by_one(engine, interactions: str, request: TrainSumsRequest) -> TrainSums:
    """`TrainSums` from the engine's operations, one after another (the digest in this process)."""
    engine.check_count_rows(interactions, request.catalog)
    counts, units = engine.count_aggregates(
        interactions, request.catalog, request.unit, request.max_items_per_user, request.sampling_key
    )
    mean_sums = (
        None
        if request.rating_range is None
        else engine.mean_sums(interactions, request.rating_range, request.unit, request.user_cap)
    )
    return TrainSums(
        counts, units, mean_sums, keyed_digest_batches(storage.iter_batches(interactions), request.digest_key)
    )
