"""Training runs for the paper's experiments: the methods, their tuning, one measured run per cell.

The methods are a table (METHODS): a name, the TrainConfig fields that make the method (item update,
encoder, non-private), the protocols it runs under, and its tuning search space (TrainConfig field
-> a `Range`, continuous or integer, on a log scale where the field is a scale, or a `Choice`). A
method whose item update `pipelines.training` does not offer yet is reported as unavailable and
skipped, and a search-space field TrainConfig does not have yet is left at its default and named in
the report, so a method starts to run, and to be tuned, as soon as the pipeline has it.

Tuning is Optuna's TPE sampler (`suggest`), seeded and replayable: the configuration of trial t is a
pure function of (the study seed, t, the configurations and validation values of trials 0..t-1),
with trial 0 always the method's defaults; the sampler is rebuilt for every trial from the finished
trials, so a study replayed from its recorded cells suggests exactly what it suggested when it ran
(bench.privacy_utility keeps every trial as a harness cell and resumes from them).

A cell is one real run of `pipelines.training.stages.run` (Spark jobs, ledger, TensorFlow trainer; nothing of
the privacy path is replaced): its parameters are {data, protocol, method, epsilon, config, seed},
where `config` holds every TrainConfig field the cell sets, and its value the validation and test
metric (overall and per popularity bucket; ranking cells also every metric of trainer.metrics.RANKING
under "ranking", while tuning reads Recall@20), the epsilon the ledger spent, the wall time and the
trajectory: the metrics after every outer step (the step's item embeddings with the user update
made against them) at the wall time that step finished. The run directory is deleted once the cell
is measured (a d=64 run writes gigabytes of statistics); only the cell is kept. The DP popularity
ranker ("dp-popularity", ranking protocol only) is the exception: its cell is `prepare.prepare` of
its config (the split and the DP counts release, nothing more) and the held-out users' candidates
scored by their DP count with trainer.evaluate's metrics. The implicit-ALS reference ("ials",
ranking protocol only, non-private) is the other: a textbook implicit ALS (bench.ladder's) on the
same split, with its own (alpha, lambda) grid chosen on validation users, so it has nothing to tune.

Privacy: the runs are the pipeline's own, each with a fresh noise seed from the OS CSPRNG; the
metrics are evaluations on held-out private ratings (trusted side), as the pipeline's metrics.json.
Tuning on validation ratings is itself not private (as in the paper); the transfer mode of
bench.privacy_utility tunes on another data set instead.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

from pipelines.data import ingest
from pipelines.training import evaluation, prepare, sections, settings, stages
from pipelines.training.run_dir import Run, config_of
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.tables import validate_item_embeddings
from trainer.metrics import RANKING

DELTA = 1e-5
BUCKETS = 5  # popularity buckets of the sliced metrics, least to most popular
SEARCH_SEED = 20240101  # a tuning study's seed is a function of (this, method, epsilon)
STARTUP_TRIALS = 5  # TPE draws at random (seeded) until this many trials are finished, the defaults included
TEST_SEED = 100  # test runs use model seeds TEST_SEED + s, apart from the trials' 0..T-1


@dataclass(frozen=True)
class Metric:
    """The protocol's metric: the key in pipelines.training's metrics, how to name and plot it."""

    key: str
    name: str
    unit: str
    lower_is_better: bool

    def better(self, a: float, b: float) -> bool:
        return a < b if self.lower_is_better else a > b


METRICS = {
    "rmse": Metric("rmse", "RMSE", "rating stars", True),
    "recall": Metric("recall_at_20", "Recall@20", "fraction of targets", False),
}


@dataclass(frozen=True)
class Range:
    """A tuned field's interval [low, high], uniform or on a log scale, of floats or integers."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def capped(self, cap) -> Range:
        return Range(min(self.low, cap), min(self.high, cap), self.log, self.integer)

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return False
        return self.low <= value <= self.high and (not self.integer or float(value).is_integer())

    def distribution(self):
        from optuna import distributions

        if self.integer:
            return distributions.IntDistribution(int(self.low), int(self.high), log=self.log)
        return distributions.FloatDistribution(float(self.low), float(self.high), log=self.log)

    def __str__(self) -> str:
        return f"{'log ' if self.log else ''}{self.low:g}..{self.high:g}{' (integer)' if self.integer else ''}"


@dataclass(frozen=True)
class Choice:
    """A tuned field's candidate values."""

    values: tuple

    def capped(self, cap) -> Choice:
        return Choice(tuple(v for v in self.values if v <= cap) or (cap,))

    def contains(self, value) -> bool:
        return value in self.values

    def distribution(self):
        from optuna import distributions

        return distributions.CategoricalDistribution(self.values)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{v:g}" for v in self.values) + "}"


@dataclass(frozen=True)
class Method:
    """One method: its label, the TrainConfig fields that make it, its tuning search space, the
    protocols it runs under and how a cell runs it ("train": pipelines.training.stages.run; "popularity": the
    DP popularity ranker)."""

    label: str
    overrides: dict
    space: dict
    protocols: tuple = ("rmse", "recall")
    kind: str = "train"

    @property
    def private(self) -> bool:
        return not self.overrides.get("non_private", False)


# The search spaces (the paper: d up to 64). Scales are searched on a log scale over ranges wide
# enough to hold every method's good region: ridges and penalties are stated in the release's units
# (pipelines.training), so one range serves the private and the non-private runs.
_USER = {
    "dim": Choice((8, 16, 32, 64)),
    "lambda_u": Range(1e-3, 1.0, log=True),
    "outer_steps": Range(1, 4, integer=True),
}
_NON_PRIVATE_STEPS = {
    "outer_steps": Range(1, 12, integer=True)
}  # no budget to split: up to convergence (settings.NON_PRIVATE_OUTER_STEPS)
_RIDGE = {"ridge": Range(1e-3, 3.0, log=True)}
_NOISE_RIDGE = {"noise_ridge": Range(0.01, 3.0, log=True)}
_SGD = {"learning_rate": Range(1e-3, 0.1, log=True), "epochs": Range(5, 200, log=True, integer=True)}
_RESIDUAL = {
    "residual_penalty": Range(0.1, 30.0, log=True)
}  # AM-SSP's per-item residual (the features encoder with the id residual)
_ANCHOR = {"anchor": Range(0.3, 100.0, log=True)}  # AM-SSP's hold on the shared encoder's start
_COUNTS = {
    "count_share": Range(0.02, 0.3, log=True),
    "max_items_per_user": Range(20, 400, log=True, integer=True),
}  # the DP counts release
_CLIPS = {"clip_u": Range(0.05, 2.0, log=True), "clip_y": Range(0.5, 3.0)}
# wbar is a pure scale of AM-SSP's statistics, noise and penalties (all in units of wbar Gamma_u^2),
# so it is tuned only where it is not: DP-ALS/DP-CMF (their count-grown ridge) and AM-DPSGD (weights)
_WBAR = {"wbar": Range(0.3, 3.0, log=True)}
_DPSGD = {
    "dpsgd_learning_rate": Range(1e-3, 0.3, log=True),
    "dpsgd_epochs": Range(1, 20, log=True, integer=True),
    "dpsgd_clip": Range(0.1, 10.0, log=True),
    "dpsgd_batch_size": Choice((32, 64, 128, 256, 512)),
}
_CMF = {"feature_weight": Range(0.03, 30.0, log=True), "feature_ridge": Range(0.03, 30.0, log=True)}
_ITEM_GRAM = {"item_gram_share": Range(0.0, 0.6)}  # AM-SSP's start from the DP item Gram: a ranking's release
RANKING_ONLY = set(_ITEM_GRAM)  # tuned under the recall protocol only; at most 0.6: it fits beside counts of 0.3

METHODS: dict[str, Method] = {
    "nonprivate-ssp": Method(
        "non-private (features)",
        {"non_private": True, "item_update": "ssp", "encoder": "features"},
        {**_USER, **_NON_PRIVATE_STEPS, **_RIDGE, **_RESIDUAL, **_SGD},
    ),
    "nonprivate-als": Method(
        "non-private ALS (id)",
        {"non_private": True, "item_update": "als", "encoder": "id"},
        {**_USER, **_NON_PRIVATE_STEPS, **_RIDGE},
    ),
    "none": Method("starting point (public features)", {"item_update": "none", "encoder": "features"}, dict(_USER)),
    "dp-popularity": Method(
        "DP popularity",
        {"item_update": "none", "encoder": "id"},
        dict(_COUNTS),
        protocols=("recall",),
        kind="popularity",
    ),
    "ials": Method(
        "implicit ALS (non-private, id)",
        {"non_private": True, "item_update": "none", "encoder": "id"},
        {},
        protocols=("recall",),
        kind="ials",
    ),
    "als": Method(
        "DP-ALS",
        {"item_update": "als", "encoder": "id"},
        {**_USER, **_RIDGE, **_NOISE_RIDGE, **_CLIPS, **_WBAR, **_COUNTS},
    ),
    "cmf": Method(
        "DP-CMF",
        {"item_update": "cmf", "encoder": "id"},
        {**_USER, **_RIDGE, **_NOISE_RIDGE, **_CLIPS, **_WBAR, **_COUNTS, **_CMF},
    ),
    "dpsgd": Method(
        "AM-DPSGD",
        {"item_update": "dpsgd", "encoder": "features"},  # DP-SGD has its own step size, epochs and clip; no ridge
        {**_USER, **_CLIPS, **_WBAR, **_COUNTS, **_DPSGD},
    ),
    "ssp": Method(
        "AM-SSP",
        {"item_update": "ssp", "encoder": "features"},
        {**_USER, **_RIDGE, **_NOISE_RIDGE, **_RESIDUAL, **_ANCHOR, **_CLIPS, **_COUNTS, **_SGD, **_ITEM_GRAM},
    ),
    # the baseline every model must beat on ratings (last: the methods' colours keep their order)
    "item-mean": Method(
        "DP per-item mean",
        {"item_update": "item-mean", "encoder": "id"},
        {"clip_y": _CLIPS["clip_y"], **_COUNTS},
        protocols=("rmse",),
    ),
    "gram": Method(
        "DP item Gram",
        {"item_update": "gram", "encoder": "id"},
        {"dim": _USER["dim"], "lambda_u": _USER["lambda_u"], **_COUNTS},
        protocols=("recall",),
    ),
    "ease": Method(
        "EASE (non-private, id)",
        {"non_private": True, "item_update": "none", "encoder": "id"},
        {},
        protocols=("recall",),
        kind="ease",
    ),
}
_FIELDS = set(sections.FLAGS)


def color(name: str) -> str:
    """The method's colour, the same in every figure."""
    return f"C{list(METHODS).index(name)}"


def available(name: str) -> bool:
    """Whether pipelines.training offers the method's item update."""
    return METHODS[name].overrides["item_update"] in settings.ITEM_UPDATES


def runs_under(name: str, protocol: str) -> bool:
    """Whether the method has a meaning under the protocol (the popularity ranker ranks, it predicts no rating)."""
    return protocol in METHODS[name].protocols


def untunable(name: str) -> list[str]:
    """Search-space fields TrainConfig does not have (yet): left at the method's default."""
    return [key for key in METHODS[name].space if key not in _FIELDS]


def select(names: list[str] | None) -> list[str]:
    """The requested methods in table order (all when None); an unknown name is an error."""
    unknown = sorted(set(names or []) - set(METHODS))
    if unknown:
        raise UserError(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    return [name for name in METHODS if names is None or name in names]


def search_space(name: str, caps: dict, protocol: str = "rmse") -> dict:
    """The method's tunable fields under `protocol` (those TrainConfig has), each within `caps`
    (field -> largest value)."""
    return {
        key: dim.capped(caps[key]) if key in caps else dim
        for key, dim in METHODS[name].space.items()
        if key in _FIELDS and (protocol == "recall" or key not in RANKING_ONLY)
    }


def describe_space(space: dict) -> str:
    return ", ".join(f"{key} {dim}" for key, dim in space.items()) or "nothing"


def study_seed(name: str, epsilon: float | None) -> int:
    """The seed of the (method, epsilon) tuning study."""
    sequence = np.random.SeedSequence(
        [SEARCH_SEED, zlib.crc32(name.encode()), 0 if epsilon is None else round(epsilon * 1000)]
    )
    return int(sequence.generate_state(1)[0])


def tuned_values(name: str, config: dict, caps: dict, epsilon: float | None = None, protocol: str = "rmse") -> dict:
    """The values a cell config gives the method's tuned fields (TrainConfig's defaults at the cell's
    epsilon and protocol for those it leaves out: d follows both), those inside the search space:
    what the sampler is told of a finished trial."""
    run = {"protocol": protocol, **({} if epsilon is None else {"epsilon": epsilon})}
    effective = settings.TrainConfig.create(**run, **{key: value for key, value in config.items() if key in _FIELDS})
    values = {
        key: getattr(effective, key)
        for key, dim in search_space(name, caps, protocol).items()
        if dim.contains(getattr(effective, key))
    }
    return {
        key: int(value) if getattr(METHODS[name].space[key], "integer", False) else value
        for key, value in values.items()
    }


def suggest(
    name: str,
    seed: int,
    history: list[tuple[dict, float | None]],
    caps: dict,
    lower_is_better: bool,
    startup: int = STARTUP_TRIALS,
    protocol: str = "rmse",
) -> dict:
    """The draw (tuned field -> value) of trial len(history) of a study: {} (the method's defaults)
    for trial 0; then Optuna's (multivariate) TPE given the finished trials `history`, pairs of
    (tuned values, validation metric or None for a failed trial), seeded by (seed, trial number);
    the first `startup` trials are seeded random draws, over the space under `protocol`. The same
    arguments give the same draw."""
    if not history:
        return {}
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = search_space(name, caps, protocol)
    if not space:
        return {}
    distributions = {key: dim.distribution() for key, dim in space.items()}
    trial_seed = int(np.random.SeedSequence([seed, len(history)]).generate_state(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=trial_seed, n_startup_trials=startup, multivariate=True)
        study = optuna.create_study(direction="minimize" if lower_is_better else "maximize", sampler=sampler)
        for params, value in history:
            params = {key: value for key, value in params.items() if key in distributions}
            finished = value is not None and math.isfinite(value)
            study.add_trial(
                optuna.trial.create_trial(
                    params=params,
                    distributions={key: distributions[key] for key in params},
                    value=float(value) if finished else None,
                    state=optuna.trial.TrialState.COMPLETE if finished else optuna.trial.TrialState.FAIL,
                )
            )
        trial = study.ask(distributions)
    return {key: _plain(trial.params[key]) for key in distributions}


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def cell_config(name: str, base: dict, draw: dict) -> dict:
    """Every TrainConfig field a cell sets: the method's, the experiment's base (those of its fields
    the method tunes), the draw (in that order of precedence, lowest first); plain JSON numbers."""
    base = {key: value for key, value in base.items() if key in METHODS[name].space}
    return {
        key: value.item() if isinstance(value, np.generic) else value
        for key, value in {**METHODS[name].overrides, **base, **draw}.items()
    }


def data_of(data: str | None) -> str:
    """The --data of the training experiments: the bundled ml-latest-small when not given."""
    return data or ingest.BUNDLED


def dataset(out: str, data: str) -> str:
    """The data set folder of `data`: itself when it is one, else its ingest under OUT/data (once)."""
    path = os.path.abspath(data)
    slug = f"{os.path.basename(path.rstrip('/'))}-{zlib.crc32(path.encode()):08x}"
    return ingest.load_or_ingest(path, os.path.join(out, "data", slug)).path


@contextlib.contextmanager
def own_budget_accounts(root: str):
    """A cell's own budget-account registry (privacy.lifetime_budget), fresh for each run of the cell: the
    cells of an experiment train on one generated data set, which in a shared registry keeps one
    account, so a cell that names its own account, or a rerun of one, would be refused. An
    experiment's cells are independent deployments: each gets a registry of its own, removed after."""
    from privacy.lifetime_budget import ACCOUNTS_ENV

    folder = root + ".accounts"
    shutil.rmtree(folder, ignore_errors=True)
    before = os.environ.get(ACCOUNTS_ENV)
    os.environ[ACCOUNTS_ENV] = folder
    try:
        yield os.path.join(folder, "account.json")
    finally:
        if before is None:
            os.environ.pop(ACCOUNTS_ENV, None)
        else:
            os.environ[ACCOUNTS_ENV] = before
        shutil.rmtree(folder, ignore_errors=True)


_SPARK = contextlib.ExitStack()


def movielens_like(out: str, users: int) -> str:
    """`ssp synth --like movielens --users N` (seed 0), written once under OUT/data."""
    from pipelines.data import synth
    from pipelines.data.datasets import is_dataset

    path = os.path.join(out, "data", f"movielens-like-{users}")
    if not is_dataset(path):
        synth.generate(path, like="movielens", users=users, seed=0)
    return path


def spark():
    """The active Spark session, or one started for the bench and kept until the process ends
    (starting Spark costs seconds; every run of every experiment shares it)."""
    from pyspark.sql import SparkSession

    from pipelines.engines.spark import session

    active = SparkSession.getActiveSession()
    if active is None:
        active = _SPARK.enter_context(session("bench"))
        atexit.register(_SPARK.close)
    return active


def cell_params(data: str, protocol: str, name: str, epsilon: float | None, config: dict, seed: int) -> dict:
    return {
        "data": os.path.abspath(data),
        "protocol": protocol,
        "method": name,
        "epsilon": epsilon,
        "config": config,
        "seed": seed,
    }


def train_config(params: dict, data_set: str, out: str) -> settings.TrainConfig:
    epsilon = {} if params["epsilon"] is None else {"epsilon": params["epsilon"]}
    return settings.TrainConfig.create(
        data=data_set,
        protocol=params["protocol"],
        out=out,
        delta=DELTA,
        model_seed=params["seed"],
        **epsilon,
        **params["config"],
    )


def run_root(out: str, params: dict) -> str:
    """The run directory of a cell (deleted once the cell is measured)."""
    return os.path.join(out, "runs", hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16])


def run_cell(out: str, params: dict) -> dict:
    """Train one cell's configuration on the shared Spark session and measure it (see module doc)."""
    if METHODS[params["method"]].kind == "popularity":
        return popularity_cell(out, params)
    if METHODS[params["method"]].kind in ("ials", "ease"):
        return reference_cell(out, params)
    root = run_root(out, params)
    config = train_config(params, dataset(out, params["data"]), root)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    with open(os.path.join(out, "runs", "train.log"), "a", encoding="utf-8") as log, contextlib.redirect_stderr(log):
        print(f"== {os.path.basename(root)} {params}", file=log, flush=True)
        metrics = stages.run(config, spark=spark(), progress=False)
        steps = trajectory(Run(root))
    metric = METRICS[params["protocol"]].key
    spent = metrics["epsilon_spent"]
    value = {
        "valid": metrics[f"valid_{metric}"],
        "test": metrics[f"test_{metric}"],
        "test_sliced": metrics[f"test_{metric}_sliced"],
        "epsilon_spent": spent if math.isfinite(spent) else None,
        "seconds": metrics["seconds"],
        "trajectory": steps,
    }
    if params["protocol"] == "recall":
        value["ranking"] = {part: {key: metrics[f"{part}_{key}"] for key in RANKING} for part in ("valid", "test")}
    shutil.rmtree(root)
    return value


def run_trial(out: str, params: dict) -> dict:
    """A tuning trial's cell: `run_cell`, or, when the run fails (a configuration the pipeline
    refuses, or one that diverges to non-finite predictions), a failed cell that records the
    error (the sampler is told the trial failed; it is never chosen). Trial 0, the method's
    defaults, must run: its failure is raised."""
    try:
        return run_cell(out, params)
    except Exception as error:
        if params["seed"] == 0:
            raise
        shutil.rmtree(run_root(out, params), ignore_errors=True)
        return {
            "valid": None,
            "test": None,
            "test_sliced": [None] * BUCKETS,
            "epsilon_spent": None,
            "seconds": None,
            "trajectory": [],
            "failed": f"{type(error).__name__}: {str(error)[:300]}",
        }


def _prepared_split(out: str, params: dict) -> tuple[Run, dict]:
    """`prepare.prepare` of a ranking-only cell's config (the split and the counts release; nothing
    else is released there): the run and its `prepared` record."""
    if params["protocol"] != "recall":
        raise UserError(
            f"{METHODS[params['method']].label} ranks items: it runs under the recall protocol only, not "
            f"{params['protocol']!r}"
        )
    root = run_root(out, params)
    config = train_config(params, dataset(out, params["data"]), root)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    with open(os.path.join(out, "runs", "train.log"), "a", encoding="utf-8") as log, contextlib.redirect_stderr(log):
        print(f"== {os.path.basename(root)} {params}", file=log, flush=True)
        with prepare.run_directory(config):
            prepared = prepare.prepare(config, progress=False)["prepared"]
    return Run(root), prepared


def reference_cell(out: str, params: dict) -> dict:
    """A non-private reference's cell: Hu, Koren and Volinsky's implicit ALS (bench.ladder.ials: d =
    32, its (alpha, lambda) grid chosen on validation users) or EASE (bench.ladder.ease, its lambda
    chosen on validation users), trained on the split's training positives of the top 10% items by
    exact count (the protocol's training restriction), held-out users scored from their history,
    every catalog item scored (the others score 0), the ranking metrics as every other method's. It
    answers how far the non-private pipeline is from a standard implicit-feedback recommender on the
    same split."""
    from bench import ladder
    from pipelines.data import splits

    run, prepared = _prepared_split(out, params)
    catalog = np.sort(storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy())
    train_rows = storage.read_table(storage.join(run.split, "train.parquet"), columns=["user_id", "item_id"])
    users, user_index = np.unique(train_rows["user_id"].to_numpy(), return_inverse=True)
    item_index = np.searchsorted(catalog, train_rows["item_id"].to_numpy())
    counts = np.bincount(item_index, minlength=catalog.size)
    top = np.isin(catalog, splits.top_items(catalog, counts))
    keep = top[item_index]
    held = {}
    for part in ("valid", "test"):
        history = storage.read_table(storage.join(run.split, f"{part}_history.parquet"), columns=["user_id", "item_id"])
        targets = storage.read_table(storage.join(run.split, f"{part}_targets.parquet"), columns=["user_id", "item_id"])
        h_user, t_user = history["user_id"].to_numpy(), targets["user_id"].to_numpy()
        members = np.intersect1d(h_user, t_user)  # users with a history and targets, as trainer.evaluate
        h_rows, t_rows = np.isin(h_user, members), np.isin(t_user, members)
        held[part] = (
            np.searchsorted(members, h_user[h_rows]),
            np.searchsorted(catalog, history["item_id"].to_numpy()[h_rows]),
            np.searchsorted(members, t_user[t_rows]),
            np.searchsorted(catalog, targets["item_id"].to_numpy()[t_rows]),
            members.size,
        )
    split = ladder.RankingSplit(catalog.size, user_index[keep], item_index[keep], users.size, held)
    result = ladder.ials(split, seed=params["seed"]) if METHODS[params["method"]].kind == "ials" else ladder.ease(split)
    shutil.rmtree(run.root)
    seconds = time.time() - prepared["started_at"]
    return {
        "valid": result["valid"],
        "test": result["test"],
        "test_sliced": [None] * BUCKETS,
        "epsilon_spent": None,
        "seconds": seconds,
        "trajectory": [{"step": 0, "seconds": seconds, "valid": result["valid"], "test": result["test"]}],
        "ranking": result["ranking"],
    }


def popularity_cell(out: str, params: dict) -> dict:
    """The DP popularity ranker's cell: `prepare.prepare` of the cell's config (split, DP counts; the
    ranking protocol releases nothing else there), then every held-out user's candidates (every
    catalog item outside the user's history) ranked by DP count, scored with trainer.evaluate's
    ranking metrics. The epsilon spent is the counts release's (the ledger's)."""
    run, prepared = _prepared_split(out, params)
    catalog = storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy()
    train_items = storage.read_table(storage.join(run.split, "train.parquet"), columns=["item_id"])[
        "item_id"
    ].to_numpy()
    counts = storage.read_table(run.counts, columns=["item_id", "count"])
    metrics = popularity_ranking(
        run.split, catalog, train_items, counts["item_id"].to_numpy(), counts["count"].to_numpy()
    )
    spent = Ledger.open(run.ledger).epsilon_spent()
    seconds = time.time() - prepared["started_at"]
    value = {
        "valid": metrics["valid"]["recall_at_20"],
        "test": metrics["test"]["recall_at_20"],
        "test_sliced": metrics["test"]["sliced"],
        "epsilon_spent": spent if math.isfinite(spent) else None,
        "seconds": seconds,
        "trajectory": [
            {
                "step": 0,
                "seconds": seconds,
                "valid": metrics["valid"]["recall_at_20"],
                "test": metrics["test"]["recall_at_20"],
            }
        ],
        "ranking": {part: {key: metrics[part][key] for key in RANKING} for part in ("valid", "test")},
    }
    shutil.rmtree(run.root)
    return value


def popularity_ranking(
    split_dir: str, catalog: np.ndarray, train_items: np.ndarray, count_items: np.ndarray, counts: np.ndarray
) -> dict:
    """Valid and test ranking metrics (Recall@20 overall and per popularity bucket, Recall@50,
    NDCG@100, coverage@20) of ranking every catalog item by its DP count
    (trainer.evaluate.popularity_ranking_report: the same metric code as every method)."""
    from trainer import evaluate
    from trainer.features import FeatureSpace

    space = FeatureSpace(np.asarray(catalog), [])
    in_catalog_order = np.zeros(space.size)
    in_catalog_order[space.index_of(np.asarray(count_items))] = np.asarray(counts, dtype=np.float64)
    buckets = evaluate.popularity_buckets(space.item_ids, np.asarray(train_items))
    out = {}
    for part in ("valid", "test"):
        history = storage.read_table(storage.join(split_dir, f"{part}_history.parquet"), columns=["user_id", "item_id"])
        targets = storage.read_table(storage.join(split_dir, f"{part}_targets.parquet"), columns=["user_id", "item_id"])
        out[part] = evaluate.popularity_ranking_report(
            (history["user_id"].to_numpy(), space.index_of(history["item_id"].to_numpy())),
            (targets["user_id"].to_numpy(), space.index_of(targets["item_id"].to_numpy())),
            in_catalog_order,
            buckets,
        )
    return out


def trajectory(run: Run) -> list[dict]:
    """Valid and test metric after each outer step s = 0..S (0: the initial encoder, public features
    only) against the wall time since the run started when step s was done. The users of step s
    are the user update made against step s's item embeddings: step s+1's, or the final one."""
    from trainer.features import FeatureSpace

    manifest = run.read_manifest()
    config = config_of(run, manifest)  # d as prepare chose it
    prepared = manifest["prepared"]
    space = FeatureSpace(storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy(), [])
    marks = [prepared["at"]] + [manifest["step_done_at"][str(s)] for s in range(1, config.outer_steps + 1)]
    metric = METRICS[config.protocol].key
    counts = evaluation.fold_in_counts(run, config, space)  # one release for every step
    out = []
    for s, mark in enumerate(marks):
        table = validate_item_embeddings(storage.read_table(run.item_embeddings(s)), dim=config.vector_dim)
        vectors = np.zeros((space.size, config.vector_dim))
        vectors[space.index_of(table["item_id"].to_numpy())] = list_column_to_matrix(
            table["embedding"], config.vector_dim, "item embedding"
        )
        users = run.user_embeddings(s + 1 if s < config.outer_steps else None)
        metrics = evaluation._evaluate(
            config,
            space,
            split_dir=run.split,
            train_rows=storage.join(run.split, "train.parquet"),
            item_vectors=vectors,
            final_users=users,
            mean=prepared["mean"],
            unit=config.unit_of_privacy(),
            ratings=prepare.prepared_rating_range(prepared),
            counts=counts,
            confidence_alpha=prepared.get("confidence_alpha"),
        )
        out.append(
            {
                "step": s,
                "seconds": mark - prepared["started_at"],
                "valid": metrics[f"valid_{metric}"],
                "test": metrics[f"test_{metric}"],
            }
        )
    return out


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0
