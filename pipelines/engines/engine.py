"""The engine seam: what a run asks of an engine, and the one registry from engine name to engine.

An engine (`Engine`) does a run's row work: the prepare stage's operations (the split, the DP
counts' and the DP mean's aggregates, the centred rows), the statistics release and the user
update. `local` does it in this process (small tables, no JVM: pipelines.engines.local), `spark` on
a Spark session's executors (pipelines.engines.prepare_spark), `beam` as Beam pipelines on any
runner (pipelines.engines.prepare_beam), `federated` with each user's device as a client of a
simulated secure-aggregation round (pipelines.engines.federated). For the same inputs and seed
every engine writes the same tables and makes the same releases (the federated round's Skellam
noise excepted). Every entry point gets its engine from `engine_of`, and what an engine lacks is
said here, in one place (`ENGINES[name].lacks`, `check_supported`).

Privacy: none of its own; each operation's is its module's.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from privacy import secure_aggregation
from schemas.errors import UserError

if TYPE_CHECKING:
    from pipelines.releases.mean import CentredOutput
    from pipelines.releases.train_sums import TrainSums, TrainSumsRequest


class Engine(Protocol):
    """What a run asks of an engine (each method documented where the local engine implements it)."""

    name: str
    solves_users_in_release: (
        bool  # the users' embeddings are solved inside the statistics release (no user update before it)
    )

    def split(self, interactions: str, rule, out: str) -> tuple[dict, int]: ...

    def check_count_rows(self, interactions: str, catalog: np.ndarray) -> None: ...

    def count_aggregates(
        self, interactions: str, catalog: np.ndarray, unit: str, max_items_per_user: int, key: int
    ) -> tuple[np.ndarray, int]: ...

    def mean_sums(
        self, interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float
    ) -> tuple[float, float]: ...

    def train_sums(self, interactions: str, request: TrainSumsRequest) -> TrainSums: ...

    def item_gram_sums(self, interactions: str, items: np.ndarray) -> np.ndarray: ...

    def write_centred(
        self,
        train: str,
        outputs: list[CentredOutput],
        mean: float,
        protocol: str,
        confidence_alpha: float | None = None,
    ) -> None: ...

    def release_stats(self, job) -> dict: ...

    def user_update(self, interactions: str, item_embeddings: str, out: str, solve) -> object: ...


@dataclass(frozen=True)
class EngineInfo:
    """An engine as the settings see it, before anything is imported: what it is, and what it lacks
    (feature -> why), checked by `check_supported` before anything is spent."""

    summary: str
    lacks: dict[str, str] = field(default_factory=dict)
    accountant: str | None = None  # the accountant its releases need, when not the run's default


FEDERATED_SERVERS = secure_aggregation.SERVERS  # what `--federated-server` simulates

FEATURES = {  # what a run may need of its engine, as the flag that needs it says it
    "logistic": "--loss logistic (SSP-convex statistics around the item embeddings)",
    "biases": "--biases (user and item bias statistics)",
    "rounds": "--federated-server and the federated round's settings",
    "no-statistics": "--item-update dpsgd or none (no statistics release)",
}
ENGINES: dict[str, EngineInfo] = {
    "spark": EngineInfo(
        "on a Spark session's executors: local[*], or the cluster's under spark-submit or --master",
        {"rounds": "only the federated engine runs federated rounds"},
    ),
    "beam": EngineInfo(
        "as Beam pipelines on any runner ($SSP_BEAM_PIPELINE_OPTIONS; the DirectRunner by default)",
        {
            "logistic": "its statistics pipeline sums no logistic expansion",
            "rounds": "only the federated engine runs federated rounds",
        },
    ),
    "local": EngineInfo(
        "in this process, no JVM (small tables)", {"rounds": "only the federated engine runs federated rounds"}
    ),
    "federated": EngineInfo(
        "each user's device a client of a simulated secure-aggregation round (Beam); statistics releases only",
        {
            "logistic": "its clients compute no logistic expansion",
            "biases": "its clients solve no bias",
            "no-statistics": "it releases statistics from the clients, so it needs an --item-update that uses them",
        },
        accountant="rdp-integer",
    ),
}


def supports(name: str, feature: str) -> bool:
    return feature not in ENGINES[name].lacks


def check_supported(name: str, needs: dict[str, bool]) -> None:
    """Refuse an engine name that is not registered, or one that lacks a feature the run needs
    (`needs`: feature -> whether the run needs it), naming the flag and the engines that have it."""
    if name not in ENGINES:
        raise UserError(f"--engine must be one of {tuple(ENGINES)}, got {name!r}")
    for feature, needed in needs.items():
        if needed and not supports(name, feature):
            others = [other for other in ENGINES if supports(other, feature)]
            wanted = FEATURES.get(feature, feature)
            raise UserError(
                f"--engine {name} cannot serve this run: {ENGINES[name].lacks[feature]} ({wanted}); use --engine "
                f"{' or '.join(others)}"
            )


def add_engine_argument(
    parser: argparse.ArgumentParser, default: str = "spark", names: tuple[str, ...] = ("local", "spark", "beam")
) -> None:
    parser.add_argument(
        "--engine",
        choices=names,
        default=default,
        help="where the rows are worked on: "
        + "; ".join(f"{name}, {ENGINES[name].summary}" for name in names)
        + " (default: %(default)s); the same output on each",
    )


@contextmanager
def engine_of(
    name: str,
    *,
    app: str = "ssp",
    master: str | None = None,
    spark=None,
    scratch: str | None = None,
    beam_options=None,
    rounds=None,
) -> Iterator[Engine]:
    """The engine `name` for the duration of the block.

    spark: a Spark session opened on first use (`master`, else local[*] or the one spark-submit
    gives) and stopped when the block ends, or the session (or a function returning it) given as
    `spark`. beam: `beam_options` (default: $SSP_BEAM_PIPELINE_OPTIONS, else the DirectRunner),
    its aggregates through `scratch`. federated: Beam's, with `rounds(job)` the federated round of a
    step's release (pipelines.engines.federated.FederatedJob)."""
    check_supported(name, {})
    if name == "local":
        from pipelines.engines.local import LocalEngine

        yield LocalEngine()
    elif name == "spark":
        from pipelines.engines.prepare_spark import SparkEngine

        if spark is not None:
            yield SparkEngine(spark)
            return
        from pipelines.engines.spark import session_on_demand

        with session_on_demand(app, master) as spark_of:
            yield SparkEngine(spark_of)
    else:
        from pipelines.engines.prepare_beam import BeamEngine, options_from_environment

        options = beam_options if beam_options is not None else options_from_environment()
        if name == "beam":
            yield BeamEngine(options, scratch=scratch)
        else:
            from pipelines.engines.federated import FederatedEngine

            yield FederatedEngine(rounds, options, scratch=scratch)
