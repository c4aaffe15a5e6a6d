"""Training runs for the paper's experiments: the methods, their tuning draws, one measured run per cell.

The methods are a table (METHODS): a name, the TrainConfig fields that make the method (item update,
encoder, non-private) and its tuning search space (TrainConfig field -> candidate values). A method
whose item update `pipelines.train` does not offer yet is reported as unavailable and skipped, and a
search-space field TrainConfig does not have yet is left at its default and named in the report, so
a method starts to run, and to be tuned, as soon as the pipeline has it.

A cell is one real run of `pipelines.train.run` (Spark jobs, ledger, TensorFlow trainer; nothing of
the privacy path is replaced): its parameters are {data, protocol, method, epsilon, config, seed},
where `config` holds every TrainConfig field the cell sets, and its value the validation and test
metric (overall and per popularity bucket), the epsilon the ledger spent, the wall time and the
trajectory: the metrics after every outer step (the step's item embeddings with the user update
made against them) at the wall time that step finished. The run directory is deleted once the cell
is measured (a d=64 run writes gigabytes of statistics); only the cell is kept.

Privacy: the runs are the pipeline's own, each with a fresh noise seed from the OS CSPRNG; the
metrics are evaluations on held-out private ratings (trusted side), as the pipeline's metrics.json.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import shutil
import zlib
from dataclasses import dataclass, fields

import numpy as np

from pipelines import ingest, train
from pipelines.run_dir import Run
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.tables import validate_item_embeddings

DELTA = 1e-5
BUCKETS = 5  # popularity buckets of the sliced metrics, least to most popular
SEARCH_SEED = 20240101  # the random search's draws are a function of (this, method, epsilon)
TEST_SEED = 100  # test runs use model seeds TEST_SEED + s, apart from the trials' 0..T-1


@dataclass(frozen=True)
class Metric:
    """The protocol's metric: the key in pipelines.train's metrics, how to name and plot it."""

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
class Method:
    """One method: its label, the TrainConfig fields that make it, its tuning search space."""

    label: str
    overrides: dict
    space: dict

    @property
    def private(self) -> bool:
        return not self.overrides.get("non_private", False)


_GRID = {  # candidate values shared by the methods (the paper: d up to 64)
    "dim": [8, 16, 32, 64],
    "outer_steps": [1, 2, 3, 4],
    "clip_u": [0.5, 1.0, 2.0],
    "clip_y": [1.0, 2.0, 3.0],
    "wbar": [0.5, 1.0, 2.0],
    "count_share": [0.05, 0.1, 0.2],
    "max_items_per_user": [50, 100, 200],
    "lambda_u": [0.03, 0.1, 0.3, 1.0],
    "ridge": [0.03, 0.1, 0.3, 1.0],
    "learning_rate": [0.003, 0.01, 0.03],
    "epochs": [10, 20, 30],
}
_PRIVACY = ["clip_u", "clip_y", "wbar", "count_share", "max_items_per_user"]  # clip norms, wbar, count share, cap K
_SOLVE = ["dim", "outer_steps", "lambda_u", "ridge"]


def _space(*names: str, **extra: list) -> dict:
    return {**{name: _GRID[name] for name in names}, **extra}


METHODS: dict[str, Method] = {
    "nonprivate-ssp": Method("non-private (features)", {"non_private": True, "item_update": "ssp", "encoder": "features"},
                             _space(*_SOLVE, "learning_rate", "epochs", dim=[16, 32, 64])),
    "nonprivate-als": Method("non-private ALS (id)", {"non_private": True, "item_update": "als", "encoder": "id"}, _space(*_SOLVE, dim=[16, 32, 64])),
    "als": Method("DP-ALS", {"item_update": "als", "encoder": "id"}, _space(*_SOLVE, *_PRIVACY)),
    "cmf": Method("DP-CMF", {"item_update": "cmf", "encoder": "id"},
                  _space(*_SOLVE, *_PRIVACY, feature_weight=[0.1, 1.0, 10.0], feature_ridge=[0.1, 1.0, 10.0])),
    "dpsgd": Method("AM-DPSGD", {"item_update": "dpsgd", "encoder": "features"},  # DP-SGD has its own step size, epochs and clip; no ridge
                    _space("dim", "outer_steps", "lambda_u", *_PRIVACY, dpsgd_learning_rate=[0.003, 0.01, 0.03], dpsgd_epochs=[2.0, 5.0, 10.0],
                           dpsgd_clip=[0.3, 1.0, 3.0], dpsgd_batch_size=[32, 64, 128])),
    "ssp": Method("AM-SSP", {"item_update": "ssp", "encoder": "features"}, _space(*_SOLVE, *_PRIVACY, "learning_rate", "epochs")),
}
_FIELDS = {item.name for item in fields(train.TrainConfig)}


def color(name: str) -> str:
    """The method's colour, the same in every figure."""
    return f"C{list(METHODS).index(name)}"


def available(name: str) -> bool:
    """Whether pipelines.train offers the method's item update."""
    return METHODS[name].overrides["item_update"] in train.ITEM_UPDATES


def untunable(name: str) -> list[str]:
    """Search-space fields TrainConfig does not have (yet): left at the method's default."""
    return [key for key in METHODS[name].space if key not in _FIELDS]


def select(names: list[str] | None) -> list[str]:
    """The requested methods in table order (all when None); an unknown name is an error."""
    unknown = sorted(set(names or []) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    return [name for name in METHODS if names is None or name in names]


def draws(name: str, epsilon: float | None, trials: int, caps: dict) -> list[dict]:
    """The random search's `trials` configurations of a method at an epsilon: the first is the
    method's defaults, the others draw every tunable field uniformly from its candidates (those
    within `caps`, field -> largest value, or the cap itself when none is), seeded by
    (SEARCH_SEED, method, epsilon)."""
    rng = np.random.default_rng([SEARCH_SEED, zlib.crc32(name.encode()), 0 if epsilon is None else round(epsilon * 1000)])
    space = {key: [v for v in values if v <= caps.get(key, math.inf)] or [caps[key]] for key, values in METHODS[name].space.items() if key in _FIELDS}
    out = [{}]
    for _ in range(trials - 1):
        out.append({key: values[rng.integers(len(values))] for key, values in space.items()})
    return out


def cell_config(name: str, base: dict, draw: dict) -> dict:
    """Every TrainConfig field a cell sets: the method's, the experiment's base (those of its fields
    the method tunes), the draw (in that order of precedence, lowest first); plain JSON numbers."""
    base = {key: value for key, value in base.items() if key in METHODS[name].space}
    return {key: value.item() if isinstance(value, np.generic) else value for key, value in {**METHODS[name].overrides, **base, **draw}.items()}


def data_of(data: str | None) -> str:
    """The --data of the training experiments: the bundled ml-latest-small when not given."""
    return data or ingest.BUNDLED


def dataset(out: str, data: str) -> str:
    """The data set folder of `data`: itself when it is one, else its ingest under OUT/data (once)."""
    path = os.path.abspath(data)
    slug = f"{os.path.basename(path.rstrip('/'))}-{zlib.crc32(path.encode()):08x}"
    return ingest.load_or_ingest(path, os.path.join(out, "data", slug)).path


_SPARK = contextlib.ExitStack()


def spark():
    """The active Spark session, or one started for the bench and kept until the process ends
    (starting Spark costs seconds; every run of every experiment shares it)."""
    from pyspark.sql import SparkSession

    from pipelines.spark import session

    active = SparkSession.getActiveSession()
    if active is None:
        active = _SPARK.enter_context(session("bench"))
        atexit.register(_SPARK.close)
    return active


def cell_params(data: str, protocol: str, name: str, epsilon: float | None, config: dict, seed: int) -> dict:
    return {"data": os.path.abspath(data), "protocol": protocol, "method": name, "epsilon": epsilon, "config": config, "seed": seed}


def train_config(params: dict, data_set: str, out: str) -> train.TrainConfig:
    epsilon = {} if params["epsilon"] is None else {"epsilon": params["epsilon"]}
    return train.TrainConfig(data=data_set, protocol=params["protocol"], out=out, delta=DELTA, model_seed=params["seed"], **epsilon, **params["config"])


def run_cell(out: str, params: dict) -> dict:
    """Train one cell's configuration on the shared Spark session and measure it (see module doc)."""
    key = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    root = os.path.join(out, "runs", key)
    config = train_config(params, dataset(out, params["data"]), root)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    with open(os.path.join(out, "runs", "train.log"), "a", encoding="utf-8") as log, contextlib.redirect_stderr(log):
        print(f"== {key} {params}", file=log, flush=True)
        metrics = train.run(config, spark=spark(), progress=False)
        steps = trajectory(Run(root), config)
    metric = METRICS[params["protocol"]].key
    spent = metrics["epsilon_spent"]
    value = {
        "valid": metrics[f"valid_{metric}"], "test": metrics[f"test_{metric}"], "test_sliced": metrics[f"test_{metric}_sliced"],
        "epsilon_spent": spent if math.isfinite(spent) else None, "seconds": metrics["seconds"], "trajectory": steps,
    }
    shutil.rmtree(root)
    return value


def trajectory(run: Run, config: train.TrainConfig) -> list[dict]:
    """Valid and test metric after each outer step s = 0..S (0: the initial encoder, public features
    only) against the wall time since the run started when step s was done. The users of step s
    are the user update made against step s's item embeddings: step s+1's, or the final one."""
    from trainer.features import FeatureSpace

    manifest = run.read_manifest()
    prepared = manifest["prepared"]
    space = FeatureSpace(storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy(), [])
    marks = [prepared["at"]] + [manifest["step_done_at"][str(s)] for s in range(1, config.outer_steps + 1)]
    metric = METRICS[config.protocol].key
    out = []
    for s, mark in enumerate(marks):
        table = validate_item_embeddings(storage.read_table(run.item_embeddings(s)), dim=config.dim)
        vectors = np.zeros((space.size, config.dim))
        vectors[space.index_of(table["item_id"].to_numpy())] = list_column_to_matrix(table["embedding"], config.dim, "item embedding")
        users = run.user_embeddings(s + 1 if s < config.outer_steps else None)
        metrics = train._evaluate(config, space, run.split, storage.join(run.split, "train.parquet"), vectors, users, prepared["mean"], config.unit_of_privacy())
        out.append({"step": s, "seconds": mark - prepared["started_at"], "valid": metrics[f"valid_{metric}"], "test": metrics[f"test_{metric}"]})
    return out


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0
