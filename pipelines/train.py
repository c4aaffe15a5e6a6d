"""`ssp train`: the end-to-end private training run, alternating minimization with SSP.

    data -> split (protocol) -> DP item counts -> DP mean label -> centred, clipped labels
    -> initial item embeddings from public features only (no privacy cost)
    -> S outer steps of: user update (Spark) -> stats release (Spark or Beam) -> SSP trainer
    -> evaluation (RMSE or Recall@20, sliced by popularity) -> metrics.json, encoder, item embeddings

Everything lands in the run directory RUN: `ledger.parquet` (every release), `manifest.json`
(settings, steps done), `counts/`, `step-<s>/stats/` (released statistics of step s),
`step-<s>/item_embeddings.parquet` and `step-<s>/checkpoint/` (the encoder after step s),
`encoder/` (SavedModel), `item_embeddings.parquet`, `metrics.json`; and `RUN/private/`, which must
never leave the trusted zone: the noise seed, the ingested data, the split, the centred training
labels, the user embeddings. A run killed mid-way resumes after its last completed step, and its
releases are not spent twice (the ledger and seed binding recognise a release made before).

Usable from a scheduler: `run(TrainConfig(...))` returns the metrics.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import pyarrow as pa

from pipelines import ingest, release, splits, stats_job, user_update
from pipelines.counts import COUNTS_TABLE, DEFAULT_MAX_ITEMS_PER_USER, dp_counts
from pipelines.gram import dp_gram
from pipelines.lock import run_lock
from pipelines.mean import dp_mean
from pipelines.stats_core import StatsSettings
from privacy.ledger import Ledger
from schemas import storage
from schemas.tables import INTERACTIONS, validate_user_embeddings

ITEM_UPDATES = ("ssp", "als")  # SSP2 trainer; DP-ALS closed-form solve (id-only encoder)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run (a resumed run must be started with the same)."""

    data: str = ingest.BUNDLED
    protocol: str = "rmse"
    out: str = "runs/train"
    epsilon: float = 10.0
    delta: float = 1e-5
    non_private: bool = False
    seed_file: str | None = None
    engine: str = "spark"
    item_update: str = "ssp"
    encoder: str = "features"
    item_id_feature: bool | None = None  # None: on for non-private runs, off for private ones
    dim: int | None = None  # None: 32 for non-private runs, 8 for private ones
    outer_steps: int = 3
    resamples: int = 1
    unit: str = "user"
    clip_u: float = 1.0
    clip_y: float = 2.0
    wbar: float = 1.0
    weight_exponent: float = -0.25
    max_items_per_user: int = DEFAULT_MAX_ITEMS_PER_USER
    count_share: float = 0.1
    mean_share: float = 0.05
    lambda_u: float = 0.1
    epochs: int = 30
    batch_size: int = 512
    learning_rate: float = 0.01
    ridge: float = 0.1
    noise_ridge: float = 0.25
    gravity: float | None = None  # None: 0.1 for the ranking protocol (implicit feedback), 0 otherwise
    gram_share: float = 0.05
    psd_projection: bool = True
    rating_min: float = 0.5
    rating_max: float = 5.0
    split_seed: int = splits.DEFAULT_SEED
    model_seed: int = 0
    shards: int = 4

    def __post_init__(self):
        # Defaults tuned per mode on the validation split of ml-latest-small and synthetic data: under
        # user-level noise a small dimension and no per-item id embedding (which can only fit its own
        # item's noise) generalise best; without noise the id embedding and a larger d win.
        if self.dim is None:
            object.__setattr__(self, "dim", 32 if self.non_private else 8)
        if self.item_id_feature is None:
            object.__setattr__(self, "item_id_feature", self.non_private)
        if self.gravity is None:
            object.__setattr__(self, "gravity", 0.1 if self.protocol == "recall" else 0.0)
        if self.protocol not in splits.PROTOCOLS:
            raise ValueError(f"--protocol must be one of {splits.PROTOCOLS}, got {self.protocol!r}")
        if self.engine not in ("spark", "beam"):
            raise ValueError(f"--engine must be spark or beam, got {self.engine!r}")
        if self.item_update not in ITEM_UPDATES:
            raise ValueError(f"--item-update must be one of {ITEM_UPDATES}, got {self.item_update!r}")
        if self.item_update == "als" and self.encoder != "id":
            raise ValueError("--item-update als (DP-ALS) solves one free vector per item: use it with --encoder id")
        if not self.rating_min < self.rating_max:
            raise ValueError(f"rating range must have min < max, got [{self.rating_min}, {self.rating_max}]")
        self.privacy()  # validates the budget and plan
        self.settings()

    def privacy(self) -> release.PrivacySettings:
        mean_share = self.mean_share if self.protocol == "rmse" else 0.0
        gram_share = self.gram_share if self.gravity > 0 else 0.0
        common = dict(delta=self.delta, outer_steps=self.outer_steps, resamples=self.resamples, count_share=self.count_share,
                      mean_share=mean_share, gram_share=gram_share)
        if self.non_private:
            return release.PrivacySettings(noise_multiplier=0.0, **common)
        return release.PrivacySettings(epsilon=self.epsilon, **common)

    def settings(self) -> StatsSettings:
        if self.non_private:  # no noise, no clipping limits, plain sums
            return StatsSettings(self.dim, math.inf, math.inf, "example", 1.0, self.weight_exponent)
        return StatsSettings(self.dim, self.clip_u, self.clip_y, self.unit, self.wbar if self.unit == "user" else 1.0, self.weight_exponent)

    def unit_of_privacy(self) -> str:
        return "example" if self.non_private else self.unit


class Run:
    """The paths of a run directory."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def private(self, *parts: str) -> str:
        return storage.join(self.root, "private", *parts)

    def step(self, s: int, *parts: str) -> str:
        return storage.join(self.root, f"step-{s}", *parts)


def _check_manifest(run: Run, config: TrainConfig) -> dict:
    """The run's manifest: new, or the one of an interrupted run with the same settings."""
    path = run.path("manifest.json")
    wanted = {key: value for key, value in asdict(config).items() if key != "out"}
    if storage.exists(path):
        manifest = storage.read_json(path)
        differing = sorted(key for key, value in wanted.items() if manifest["config"].get(key) != value)
        if differing:
            raise ValueError(f"{run.root} holds a run with other settings ({', '.join(differing)}); resume it with the same flags or use a new --out")
        return manifest
    manifest = {"config": wanted, "steps_done": [], "status": "running"}
    storage.write_json(manifest, path)
    return manifest


def _write_centred(train: str, out: str, mean: float, protocol: str, keep_items: np.ndarray | None) -> None:
    """The training rows with labels centred by the DP mean (regression) or set to 1 (ranking:
    positives), restricted to `keep_items` when given."""
    with storage.TableWriter(out, INTERACTIONS) as writer:
        for batch in storage.iter_batches(train):
            table = pa.Table.from_batches([batch])
            if keep_items is not None:
                table = table.filter(pa.array(np.isin(table["item_id"].to_numpy(), keep_items)))
            labels = np.ones(table.num_rows) if protocol == "recall" else table["label"].to_numpy() - mean
            writer.write(table.set_column(2, INTERACTIONS.field("label"), pa.array(labels, pa.float64())))


def ledger_multiplier(ledger_path: str) -> float:
    """The stats noise multiplier the run's budget planned."""
    return float(Ledger.open(ledger_path).budget["multipliers"]["stats"])


def _item_embeddings_path(run: Run, step: int) -> str:
    return run.step(step, "item_embeddings.parquet")


def run(config: TrainConfig, spark=None, progress: bool = True) -> dict:
    """Run (or resume) the whole training; returns the metrics written to RUN/metrics.json.

    Holds the run directory's lock throughout: a second run on the same directory is refused.
    """
    with run_lock(config.out):
        return _run(config, spark, progress)


def _run(config: TrainConfig, spark, progress: bool) -> dict:
    import tensorflow as tf

    from trainer import encoder as encoders
    from trainer import ssp
    from trainer.features import FeatureSpace

    started = time.perf_counter()
    run_dir = Run(config.out)
    manifest = _check_manifest(run_dir, config)
    privacy, settings, unit = config.privacy(), config.settings(), config.unit_of_privacy()
    ledger_path = run_dir.path("ledger.parquet")

    data = ingest.load_or_ingest(config.data, run_dir.private("data"), progress=progress)
    split_dir = run_dir.private("split")
    if not storage.exists(storage.join(split_dir, splits.SPLIT_MANIFEST)):
        splits.make_split(data, config.protocol, split_dir, config.split_seed)
    train_rows = storage.join(split_dir, "train.parquet")
    items = storage.read_table(data.items)

    privacy.open_ledger(ledger_path, unit)  # creates the run's budget, or checks it on resume
    seeds = release.open_seed_file(config.seed_file, ledger_path)
    counts_out = run_dir.path("counts")
    dp_counts(train_rows, data.items, counts_out, privacy, unit, config.max_items_per_user, ledger_path, seeds.path)
    counts = storage.read_table(storage.join(counts_out, COUNTS_TABLE))
    mean = 0.0
    if config.protocol == "rmse":
        mean = dp_mean(train_rows, Ledger.open(ledger_path), seeds, (config.rating_min, config.rating_max), unit)["mean"]
    keep_items, stats_items = None, data.items
    if config.protocol == "recall":  # train on the top 10% items by DP count (not exact counts)
        keep_items = splits.top_items(counts["item_id"].to_numpy(), counts["count"].to_numpy(), splits.TRAIN_ITEM_FRACTION)
        stats_items = run_dir.path("train_items.parquet")
        storage.write_table(items.filter(pa.array(np.isin(items["item_id"].to_numpy(), keep_items))), stats_items)
    centred = run_dir.private("train_centred.parquet")
    _write_centred(train_rows, centred, mean, config.protocol, keep_items)

    tf.keras.utils.set_random_seed(config.model_seed)
    space = FeatureSpace.from_items(items, use_item_id=config.item_id_feature or config.encoder == "id")
    model = encoders.ItemEncoder(space, config.dim, config.encoder, seed=config.model_seed)
    checkpoint = tf.train.Checkpoint(model=model)
    if not storage.exists(_item_embeddings_path(run_dir, 0)):
        storage.write_table(ssp.item_embeddings_table(model), _item_embeddings_path(run_dir, 0))
    # Each item's ridge: weighted-lambda, growing like the item's weighted row count (DP count n^(1+e)
    # under user-level weights w ~ n^e), plus a floor at the scale of the noise in A_j (about
    # 2 sqrt(d) sigma Gamma_u^2 in spectral norm), so that pure noise shrinks to 0.
    noise_scale = ledger_multiplier(ledger_path) * settings.wbar * settings.clip_u**2 * 2 * math.sqrt(config.dim) if not config.non_private else 0.0
    ridge_scale = np.full(space.size, config.noise_ridge * noise_scale / config.ridge) if config.ridge > 0 else np.ones(space.size)
    exponent = settings.weight_exponent if settings.unit == "user" else 0.0
    ridge_scale[space.index_of(counts["item_id"].to_numpy())] += counts["count"].to_numpy() ** (1 + exponent)
    ssp_config = ssp.SSPConfig(config.epochs, config.batch_size, config.learning_rate, config.ridge, psd_projection=config.psd_projection and not config.non_private, seed=config.model_seed)
    step_seconds = {}

    def with_spark(fn):
        if spark is not None:
            return fn(spark)
        from pipelines.spark import session

        with session("ssp-train") as own:
            return fn(own)

    def steps(active_spark):
        for s in range(1, config.outer_steps + 1):
            if s in manifest["steps_done"]:
                checkpoint.restore(storage.join(run_dir.step(s, "checkpoint"), "ckpt-1")).expect_partial()
                continue
            t0 = time.perf_counter()
            user_path = run_dir.private(f"step-{s}", "user_embeddings.parquet")
            user_update.run(active_spark, centred, _item_embeddings_path(run_dir, s - 1), user_path, config.lambda_u, config.dim, config.gravity)
            job = stats_job.StatsJob(centred, user_path, stats_items, storage.join(counts_out, COUNTS_TABLE), run_dir.step(s, "stats"), settings,
                                     privacy, step=s, ledger_path=ledger_path, seed_file=seeds.path, shards=config.shards)
            if config.engine == "beam":
                from pipelines import beam_stats

                summary = beam_stats.run(job)
            else:
                from pipelines import stats

                summary = stats.run(job, active_spark)
            expected = {"clip_u": settings.clip_u, "clip_y": settings.clip_y, "wbar": settings.wbar, "noise_multiplier": summary["noise_multiplier"]}
            tables = stats_job.stats_tables(run_dir.step(s, "stats"))
            gravity = None
            if config.gravity > 0:  # implicit feedback: penalise every item's scores through the users' DP Gram matrix
                gravity = config.gravity * dp_gram(user_path, Ledger.open(ledger_path), seeds, config.dim, settings.clip_u, s)
            if config.item_update == "als":
                from trainer import als

                model.set_item_vectors(als.solve_items(tables[-1], space, config.dim, config.ridge, ridge_scale, ssp_config.psd_projection, expected, gravity=gravity))
            else:
                ssp.train(model, tables, ssp_config, expected, progress, ridge_scale, gravity)
            storage.write_table(ssp.item_embeddings_table(model), _item_embeddings_path(run_dir, s))
            checkpoint.write(storage.join(run_dir.step(s, "checkpoint"), "ckpt-1"))
            step_seconds[s] = time.perf_counter() - t0
            manifest["steps_done"] = sorted(set(manifest["steps_done"]) | {s})
            storage.write_json(manifest, run_dir.path("manifest.json"))
            release.log(f"outer step {s}/{config.outer_steps} done in {step_seconds[s]:.1f} s (epsilon spent {summary['epsilon_spent']:.4g})")
        final_users = run_dir.private("user_embeddings.parquet")
        user_update.run(active_spark, centred, _item_embeddings_path(run_dir, config.outer_steps), final_users, config.lambda_u, config.dim, config.gravity)
        return final_users

    final_users = with_spark(steps)
    item_vectors = model.embed_all()
    storage.write_table(ssp.item_embeddings_table(model), run_dir.path("item_embeddings.parquet"))
    encoders.export(model, run_dir.path("encoder"))

    metrics = _evaluate(config, space, split_dir, train_rows, item_vectors, final_users, mean, unit)
    final_ledger = Ledger.open(ledger_path)
    metrics.update(
        epsilon_spent=final_ledger.epsilon_spent(), delta=config.delta, epsilon_budget=final_ledger.budget["epsilon"],
        releases=len(final_ledger.rows), seconds=time.perf_counter() - started, step_seconds=step_seconds,
        outputs={"run": run_dir.root, "ledger": ledger_path, "encoder": run_dir.path("encoder"), "item_embeddings": run_dir.path("item_embeddings.parquet")},
    )
    storage.write_json(metrics, run_dir.path("metrics.json"))
    manifest["status"] = "done"
    storage.write_json(manifest, run_dir.path("manifest.json"))
    return metrics


def _evaluate(config: TrainConfig, space, split_dir: str, train_rows: str, item_vectors: np.ndarray, final_users: str, mean: float, unit: str) -> dict:
    """Valid and test metrics of the protocol, overall and by popularity bucket (trusted side)."""
    from trainer import evaluate

    train = storage.read_table(train_rows, columns=["item_id"])
    buckets = evaluate.popularity_buckets(space.item_ids, train["item_id"].to_numpy())
    metrics = {"protocol": config.protocol, "non_private": config.non_private, "unit": unit}
    if config.protocol == "rmse":
        users = validate_user_embeddings(storage.read_table(final_users), dim=config.dim).sort_by("user_id")
        user_table = (users["user_id"].to_numpy(), np.array(users["embedding"].to_pylist(), dtype=np.float64).reshape(-1, config.dim))
        for part in ("valid", "test"):
            rows = storage.read_table(storage.join(split_dir, f"{part}.parquet"))
            positions = space.index_of(rows["item_id"].to_numpy())
            labels = rows["label"].to_numpy()
            predictions = evaluate.predict_ratings(rows["user_id"].to_numpy(), positions, user_table, item_vectors, mean, (config.rating_min, config.rating_max))
            report = evaluate.rmse_report(predictions, labels, buckets[positions])
            metrics[f"{part}_rmse"] = report["rmse"]
            metrics[f"{part}_rmse_sliced"] = report["sliced"]
            metrics[f"{part}_mean_predictor_rmse"] = evaluate.rmse_report(np.full(labels.size, mean), labels, buckets[positions])["rmse"]
        metrics["dp_mean"] = mean
        metrics["sliced"] = {"valid": metrics["valid_rmse_sliced"], "test": metrics["test_rmse_sliced"]}
    else:
        for part in ("valid", "test"):
            history = storage.read_table(storage.join(split_dir, f"{part}_history.parquet"))
            targets = storage.read_table(storage.join(split_dir, f"{part}_targets.parquet"))
            report = evaluate.recall_report(
                (history["user_id"].to_numpy(), space.index_of(history["item_id"].to_numpy()), np.ones(history.num_rows)),
                (targets["user_id"].to_numpy(), space.index_of(targets["item_id"].to_numpy())), item_vectors, config.lambda_u, buckets,
                gravity=config.gravity,
            )
            metrics[f"{part}_recall_at_20"] = report["recall_at_20"]
            metrics[f"{part}_recall_at_20_sliced"] = report["sliced"]
        metrics["sliced"] = {"valid": metrics["valid_recall_at_20_sliced"], "test": metrics["test_recall_at_20_sliced"]}
    return metrics


def describe(metrics: dict) -> str:
    """The human summary printed at the end of a run."""
    lines = []
    if metrics["protocol"] == "rmse":
        lines.append(f"test RMSE {metrics['test_rmse']:.4f} (valid {metrics['valid_rmse']:.4f}; predicting the DP mean {metrics['dp_mean']:.3f}: {metrics['test_mean_predictor_rmse']:.4f})")
        sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_rmse_sliced"])
        lines.append(f"test RMSE by item popularity (least to most popular fifth): {sliced}")
    else:
        lines.append(f"test Recall@20 {metrics['test_recall_at_20']:.4f} (valid {metrics['valid_recall_at_20']:.4f})")
        sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_recall_at_20_sliced"])
        lines.append(f"test Recall@20 by item popularity (least to most popular fifth): {sliced}")
    eps = metrics["epsilon_spent"]
    guarantee = "no privacy (non-private run)" if metrics["non_private"] else f"({eps:.4g}, {metrics['delta']:g})-DP at the {metrics['unit']} level"
    lines.append(f"privacy: {guarantee}; epsilon spent {eps:.4g} of {metrics['epsilon_budget']:g} over {metrics['releases']} releases (ledger: {metrics['outputs']['ledger']})")
    lines.append(f"outputs: encoder {metrics['outputs']['encoder']}, item embeddings {metrics['outputs']['item_embeddings']}, metrics {metrics['outputs']['run']}/metrics.json")
    lines.append(f"private (never publish): {metrics['outputs']['run']}/private/; done in {metrics['seconds']:.0f} s")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ssp train` flags: one per TrainConfig field."""
    helps = {
        "data": "MovieLens folder or data set folder (default: the bundled ml-latest-small)",
        "protocol": "rmse (80/10/10 ratings split, RMSE) or recall (held-out users, Recall@20)",
        "out": "run directory (local or gs://)",
        "epsilon": "target epsilon of the whole run",
        "delta": "target delta",
        "non_private": "no noise and no clipping: the non-private top line of the same pipeline",
        "seed_file": "reuse a run's secret noise seed (RUN/private/seed) to reproduce its releases",
        "engine": "stats job engine: spark or beam",
        "item_update": "item update: ssp (SSP2 trainer of the encoder) or als (DP-ALS closed-form solve, with --encoder id)",
        "encoder": "features (public feature families + item id) or id (one embedding per item)",
        "item_id_feature": "the features encoder also embeds the (public) item id (default: on for --non-private runs, off for private ones)",
        "dim": "embedding dimension d (default: 32 for --non-private runs, 8 for private ones)",
        "gravity": "implicit-feedback weight alpha on the users' DP Gram matrix (default: 0.1 for --protocol recall, 0 for rmse)",
        "unit": "unit of privacy: user or example",
    }
    for item in fields(TrainConfig):
        name = "--" + item.name.replace("_", "-")
        default = item.default  # the declared default: None means "chosen per mode"
        kind_name = item.type if isinstance(item.type, str) else item.type.__name__
        if kind_name.startswith("bool") or isinstance(default, bool):
            action = argparse.BooleanOptionalAction if default is not False else "store_true"
            parser.add_argument(name, action=action, default=default, help=helps.get(item.name, item.name.replace("_", " ")))
            continue
        kind = {"int": int, "float": float}.get(kind_name.split(" ")[0], str)
        choices = {"protocol": splits.PROTOCOLS, "engine": ("spark", "beam"), "item_update": ITEM_UPDATES, "encoder": ("features", "id"), "unit": ("user", "example")}.get(item.name)
        text = helps.get(item.name, item.name.replace("_", " "))
        parser.add_argument(name, type=kind, default=default, choices=choices, help=text if "default:" in text else f"{text} (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{item.name: getattr(args, item.name) for item in fields(TrainConfig)})


def main(args: argparse.Namespace) -> int:
    metrics = run(config_from_args(args))
    print(describe(metrics))
    return 0

