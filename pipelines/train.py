"""`ssp train`: the end-to-end private training run, alternating minimization with SSP, in stages.

    prepare       data -> split (protocol) -> DP item counts -> DP mean label -> centred, clipped
                  labels -> initial item embeddings from public features only (no privacy cost)
    step s=1..S   user update (Spark) -> stats release (Spark or Beam) -> item update (TensorFlow:
                  SSP trainer; or the DP-ALS / DP-CMF solves; or, with no stats release, AM-DPSGD's
                  TF-Privacy trainer); the last step exports the encoder and item embeddings
    final         user update against the final item embeddings (Spark)
    evaluate      RMSE or Recall@20, sliced by popularity -> metrics.json
    (publish      pipelines.publish, once the ledger is checked)

`run(TrainConfig)` runs the stages in one process with one Spark session (`ssp train`, `ssp demo`).
A scheduler runs the same stage functions as separate tasks against one run directory (see
infra/dags/retrain.py): `ssp train --stage prepare` is the only one given the configuration, which
it records in RUN/manifest.json; every later stage takes only `--run RUN` (and `--step s`) and reads
the rest from the manifest (pipelines.run_dir): `ssp user-update` (or `spark-submit
pipelines/user_update.py`), the stats job with the flags `stats_job_for` implies, `ssp item-update`,
`ssp evaluate`.

Everything lands in the run directory RUN: `ledger.parquet` (every release), `manifest.json`
(settings, what prepare produced, steps done), `counts/`, `step-<s>/stats/` (released statistics of
step s), `step-<s>/item_embeddings.parquet` and `step-<s>/checkpoint/` (the encoder after step s;
step 0: the initial one), `encoder/` (SavedModel), `item_embeddings.parquet`, `metrics.json`; and
`RUN/private/`, which must never leave the trusted zone: the noise seed, the ingested data, the
split, the centred training labels, the user embeddings. A run killed mid-way resumes after its last
completed step, and its releases are not spent twice (the ledger and seed binding recognise a
release made before).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import numpy as np
import pyarrow as pa

from pipelines import ingest, logs, release, splits, stats_job, user_update
from pipelines.counts import DEFAULT_MAX_ITEMS_PER_USER, dp_counts, dp_units
from pipelines.gram import dp_gram
from pipelines.lock import existing_run_lock, run_lock
from pipelines.mean import centred, dp_mean
from pipelines.run_dir import Run, require_steps
from pipelines.stats_core import LOSSES, StatsSettings
from privacy import accounting
from privacy.ledger import Ledger
from privacy.seeds import content_digest_table
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.tables import INTERACTIONS, item_features, validate_item_embeddings, validate_user_embeddings

# SSP2 trainer of the encoder; DP-ALS and DP-CMF closed-form solves (id-only encoder) from the same
# statistics; AM-DPSGD (TF-Privacy DP-SGD on the private rows, no statistics released); none: the starting point
# (the public-feature encoder as initialised, users fitted to it), the baseline an item update must beat
ITEM_UPDATES = ("ssp", "als", "cmf", "dpsgd", "none")
STATS_UPDATES = ("ssp", "als", "cmf")  # the item updates that train from released statistics
ENGINES = ("spark", "beam", "federated")
STAGES = ("all", "prepare")  # `ssp train --stage`: the later stages have their own commands
ENCODER_INITS = ("principal", "random")  # see trainer.encoder.ItemEncoder.init_principal


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
    federated_dropout: float = 0.0  # --engine federated: share of clients that drop out of each round (simulated)
    federated_max_dropout: float = 0.1  # --engine federated: the noise is planned for this share of clients missing
    federated_server: str = "honest"  # --engine federated: the simulated server (pipelines.federated.SERVERS; "partition" for drills)
    item_update: str = "ssp"
    loss: str = "square"  # "logistic": implicit feedback's logistic loss, by SSP-convex (privacy.quadratic); --protocol recall
    encoder: str = "features"
    encoder_init: str = "principal"  # the features encoder's start: the DP-count-weighted principal directions of the public features, or random
    item_id_feature: bool | None = None  # None: on (the per-item residual of the features encoder)
    popularity_column: bool = True  # --protocol recall: the fold-in also gets the DP counts as a column (trainer.evaluate.with_popularity)
    dim: int | None = None  # None: 32 for non-private runs, 8 for private ones
    outer_steps: int = release.DEFAULT_OUTER_STEPS
    resamples: int = 1
    clip_u: float = 0.3  # against item embeddings of unit RMS norm: most users are clipped, i.e. normalised
    clip_y: float = 1.0  # centred labels
    wbar: float = 1.0
    weight_exponent: float | None = None  # None: -0.25 (rmse), 0 (recall); see __post_init__
    max_items_per_user: int = DEFAULT_MAX_ITEMS_PER_USER
    count_share: float = release.DEFAULT_COUNT_SHARE
    mean_share: float = release.DEFAULT_MEAN_SHARE
    lambda_u: float = user_update.DEFAULT_LAMBDA_U
    epochs: int = 30
    batch_size: int = 512
    learning_rate: float = 0.01
    ridge: float = 0.1
    noise_ridge: float = 0.25
    gravity: float | None = None  # None: 0.1 for the ranking protocol (implicit feedback), 0 otherwise
    train_item_fraction: float | None = None  # ranking protocol: share of the catalog (top by DP count) the statistics cover; None: see __post_init__
    stats_threshold: float | None = None  # the statistics cover the items whose DP count is >= this times N/S; None: see stats_threshold_of
    gram_share: float = release.DEFAULT_GRAM_SHARE
    psd_projection: bool = True
    feature_weight: float = 1.0  # DP-CMF: weight mu of the public feature rows
    feature_ridge: float = 1.0  # DP-CMF: ridge of the feature embeddings
    cmf_iterations: int = 3  # DP-CMF: item/feature solves per outer step
    dpsgd_epochs: float = 5.0
    dpsgd_batch_size: int = 64  # expected users per DP-SGD step (rows in a non-private run)
    dpsgd_learning_rate: float = 0.01
    dpsgd_clip: float = 1.0  # per-user gradient clip norm C
    dpsgd_max_rows_per_user: int = 256
    rating_min: float | None = None  # None: the data set's declared rating scale (see rating_range)
    rating_max: float | None = None
    split_seed: int = splits.DEFAULT_SEED
    holdout: float = splits.DEFAULT_HOLDOUT  # 0: production mode, every row trains and nothing is held out
    model_seed: int = 0
    shards: int = 4
    anchor: float = 10.0  # the shared encoder held near where each item update began, in units of S + N (see _ssp_penalties)
    residual_penalty: float = 3.0  # the per-item residual's penalty, in units of S + N (see _ssp_penalties)
    budget_account: str | None = None  # None: the data source's account in the registry (privacy.account), found by content
    account_cap: float | None = None
    account_window_days: float | None = None

    def __post_init__(self):
        # The dimension, tuned per mode on the validation splits of ml-latest-small and `ssp synth --like
        # movielens`: under user-level noise a small d generalises best for ratings (8); ranking needs
        # more directions to order the popular items, as many as the noise allows (the ML-1M-like data,
        # valid Recall@20 at d 8 / 16 / 32: epsilon 5 0.133 / 0.137 / 0.128, epsilon 10 - / 0.141 /
        # 0.144, epsilon 20 - / 0.151 / 0.162; non-private, test: 0.139 at d 8, 0.205 at 32).
        if self.dim is None:
            ranking = 32 if self.epsilon >= 10 else 16
            object.__setattr__(self, "dim", 32 if self.non_private else ranking if self.protocol == "recall" else 8)
        if self.weight_exponent is None:
            # Ranking: every Recall@20 hit is on a popular item (the top fifth; the other fifths score 0
            # even without noise), so a user's weight is spread evenly over their positives instead of
            # towards rare items (the paper's n_j^-1/4 for ratings). Measured at epsilon 5 on the ML-1M-
            # like data: valid Recall@20 0.1326 against 0.1307 at d 8, 0.1283 against 0.1191 at d 32.
            object.__setattr__(self, "weight_exponent", 0.0 if self.protocol == "recall" else -0.25)
        if self.item_id_feature is None:  # the per-item residual, held at the features by its penalty until the data outweighs the noise
            object.__setattr__(self, "item_id_feature", True)
        if self.gravity is None:  # the logistic loss has its negatives in its statistics
            object.__setattr__(self, "gravity", 0.1 if self.protocol == "recall" and self.loss == "square" else 0.0)
        if self.train_item_fraction is None:
            # An id embedding of an item outside the top 10% would be fitted to noise alone (the paper's
            # protocol keeps those items out of training). A features encoder scores every catalog item:
            # trained on the top 10% only, it gives the rare items the embedding of a popular item of the
            # same genres, and they crowd the top 20 (measured on `ssp synth --like movielens`, non-private:
            # Recall@20 0.078 against 0.199 when it trains on the whole catalog, where rare items learn
            # to score low from their own statistics and the gravity term).
            object.__setattr__(self, "train_item_fraction", splits.TRAIN_ITEM_FRACTION if self.encoder == "id" else 1.0)
        if self.stats_threshold and self.encoder == "id":
            raise ValueError("--stats-threshold needs the features encoder: an id encoder has no embedding for an item outside the statistics")
        if self.protocol not in splits.PROTOCOLS:
            raise ValueError(f"--protocol must be one of {splits.PROTOCOLS}, got {self.protocol!r}")
        if self.encoder_init not in ENCODER_INITS:
            raise ValueError(f"--encoder-init must be one of {ENCODER_INITS}, got {self.encoder_init!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}, got {self.engine!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "logistic":
            problems = [flag for flag, wrong in (("--protocol recall", self.protocol != "recall"),
                                                 ("--item-update ssp, dpsgd or none", self.item_update not in ("ssp", "dpsgd", "none")),
                                                 ("--engine spark", self.engine != "spark"), ("--gravity 0", self.gravity != 0),
                                                 ("--weight-exponent 0", self.weight_exponent != 0)) if wrong]
            if problems:
                raise ValueError(f"--loss logistic (SSP-convex on implicit feedback) needs {', '.join(problems)}")
        if self.engine == "federated" and self.item_update not in STATS_UPDATES:
            raise ValueError(f"--engine federated releases statistics from the clients: it needs an --item-update that uses them {STATS_UPDATES}")
        for name in ("federated_dropout", "federated_max_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.federated_server != "honest":
            from pipelines.federated import SERVERS

            if self.federated_server not in SERVERS or self.engine != "federated":
                raise ValueError(f"--federated-server must be one of {SERVERS}, with --engine federated; got {self.federated_server!r}")
        if self.item_update not in ITEM_UPDATES:
            raise ValueError(f"--item-update must be one of {ITEM_UPDATES}, got {self.item_update!r}")
        if self.item_update in ("als", "cmf") and self.encoder != "id":
            raise ValueError(f"--item-update {self.item_update} solves one free vector per item: use it with --encoder id")
        if None not in (self.rating_min, self.rating_max) and not self.rating_min < self.rating_max:
            raise ValueError(f"rating range must have min < max, got [{self.rating_min}, {self.rating_max}]")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"--holdout must be a number in [0, 1) (the share held out for evaluation; 0 trains on every row), got {self.holdout!r}")
        _check_settings(self)
        self.privacy()  # validates the budget and plan
        release.check_bounds(self.settings(), not self.non_private, self.max_items_per_user, self.dpsgd_clip)  # before anything is written or spent

    def privacy(self, units: int | None = None) -> release.PrivacySettings:
        """The run's budget plan. An AM-DPSGD run plans its DP-SGD steps over `units`, the DP number
        of users the counts release publishes (pipelines.counts; never the exact number); None
        before that release: its DP-SGD schedule is then release.DPSGD_PENDING."""
        mean_share = self.mean_share if self.protocol == "rmse" else 0.0
        gram_share = self.gram_share if self.gravity > 0 and self.item_update not in ("dpsgd", "none") else 0.0
        dpsgd = None
        if self.item_update == "dpsgd":
            dpsgd = self.dpsgd_schedule(units) if units is not None else release.DPSGD_PENDING
        common = dict(delta=self.delta, outer_steps=self.outer_steps, resamples=self.resamples, count_share=self.count_share,
                      mean_share=mean_share, gram_share=gram_share, dpsgd=dpsgd)
        if self.engine == "federated":  # its Skellam noise is accounted on integer RDP orders (pipelines.federated)
            from pipelines import federated

            common["accountant"] = federated.ACCOUNTANT
        if self.non_private:  # no release leaves the trusted zone: nothing to charge to the data source
            return release.PrivacySettings(noise_multiplier=0.0, **common)
        return release.PrivacySettings(epsilon=self.epsilon, account=self.budget_account, account_cap=self.account_cap,
                                       account_window_days=self.account_window_days, **common)

    def settings(self) -> StatsSettings:
        if self.non_private:  # no noise, no clipping limits, plain sums (the logistic loss keeps its per-user weights)
            return StatsSettings(self.dim, math.inf, math.inf, "example", 1.0, self.weight_exponent, self.loss)
        return StatsSettings(self.dim, self.clip_u, self.clip_y, "user", self.wbar, self.weight_exponent, self.loss)

    def unit_of_privacy(self) -> str:
        """Always the user in a private run. There is no example-level training: a user's embedding is
        solved from all of that user's ratings, so removing one rating moves that user's row in every
        item's statistics (and the Gram release, and the user's DP-SGD gradient), not one row; and
        user-level DP already implies example-level DP with the same epsilon and delta. A
        non-private run has no unit; it runs the plain, unweighted, unclipped ("example") sums."""
        return "example" if self.non_private else "user"

    def dpsgd_config(self, units: int, seed: int | None = None):
        """The DP-SGD trainer's settings over `units` privacy units (AM-DPSGD); no clipping in a
        non-private run."""
        from trainer.dpsgd import DPSGDConfig

        return DPSGDConfig(epochs=self.dpsgd_epochs, batch_size=min(self.dpsgd_batch_size, units), learning_rate=self.dpsgd_learning_rate,
                           l2_norm_clip=math.inf if self.non_private else self.dpsgd_clip, max_rows_per_user=self.dpsgd_max_rows_per_user,
                           unit=self.unit_of_privacy(), seed=seed, loss=self.loss)

    def dpsgd_schedule(self, units: int) -> tuple[float, int]:
        """(sampling probability, steps) of one outer step's DP-SGD training over `units` units."""
        from trainer import dpsgd

        return dpsgd.schedule(units, self.dpsgd_config(units))


# Every numeric setting's valid range, checked before anything is written or spent: a setting found
# wrong after the first release would strand a run whose budget is partly spent.
_POSITIVE_INTS = ("dim", "outer_steps", "resamples", "max_items_per_user", "epochs", "batch_size", "cmf_iterations", "dpsgd_batch_size",
                  "dpsgd_max_rows_per_user", "shards")
_NON_NEGATIVE_INTS = ("split_seed", "model_seed")
_POSITIVE_FLOATS = ("learning_rate", "lambda_u", "feature_ridge", "dpsgd_epochs", "dpsgd_learning_rate", "train_item_fraction")
_NON_NEGATIVE_FLOATS = ("ridge", "noise_ridge", "residual_penalty", "anchor", "gravity", "feature_weight", "gram_share", "mean_share",
                        "stats_threshold")
_CHOSEN_AT_PREPARE = ("stats_threshold", "rating_min", "rating_max")  # None: the default rule, applied to the DP counts once they are released
_FINITE_FLOATS = ("weight_exponent", "rating_min", "rating_max")


def _check_settings(config: TrainConfig) -> None:
    """Refuse any setting outside its range (NaN included), naming the flag."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name in _POSITIVE_INTS else 0):
            raise ValueError(f"{flag(name)} must be {'a positive' if name in _POSITIVE_INTS else 'a non-negative'} integer, got {value!r}")
    for name in _POSITIVE_FLOATS + _NON_NEGATIVE_FLOATS + _FINITE_FLOATS:
        value = getattr(config, name)
        if value is None and name in _CHOSEN_AT_PREPARE:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{flag(name)} must be a finite number, got {value!r}")
        if name in _POSITIVE_FLOATS and value <= 0 or name in _NON_NEGATIVE_FLOATS and value < 0:
            raise ValueError(f"{flag(name)} must be {'> 0' if name in _POSITIVE_FLOATS else '>= 0'}, got {value!r}")
    if config.train_item_fraction > 1:
        raise ValueError(f"--train-item-fraction is a share of the catalog: it must be <= 1, got {config.train_item_fraction!r}")


def config_of(run: Run, manifest: dict) -> TrainConfig:
    """The configuration a prepared run was started with (recorded once, by prepare)."""
    recorded = dict(manifest["config"])
    if recorded.pop("unit", "user") != "user":  # recorded by versions that had --unit
        raise ValueError(f"{run.root} is an example-level run: training has no example-level mode (it was unsound); start a new run")
    return TrainConfig(**recorded, out=run.root)


def _check_manifest(run: Run, config: TrainConfig) -> dict:
    """The run's manifest: new (not written yet), or the one of an interrupted run with the same
    settings. A folder that holds something else (a data set, a file) is refused."""
    wanted = {key: value for key, value in asdict(config).items() if key != "out"}
    storage.require_folder_target(run.root, "--out")
    if storage.exists(run.manifest_path):
        manifest = run.read_manifest()
        if not isinstance(manifest.get("config"), dict):
            raise ValueError(f"--out {run.root} holds something other than a training run ({run.manifest_path} has no settings); use a new --out")
        differing = sorted(key for key, value in wanted.items() if manifest["config"].get(key) != value)
        if differing:
            raise ValueError(f"{run.root} holds a run with other settings ({', '.join(differing)}); resume it with the same flags or use a new --out")
        return manifest
    for name in ("counts", "step-1", "ledger.parquet", "private"):  # a run's outputs without its manifest: not a fresh directory
        if _present(run.path(name)):
            raise ValueError(f"--out {run.root} holds {name} but no run manifest; its releases may count: use a new --out")
    return {"config": wanted, "steps_done": [], "status": "running"}


def _data_fingerprint(path: str) -> dict:
    """What identifies the training data, read-only and wherever it is stored: the digests of a
    data set's tables, or of the files a MovieLens folder is ingested from (the ratings, the
    catalog and its tags: the ml-100k genre list is fixed)."""
    from pipelines.movielens import detect_layout

    if ingest.is_dataset(path):
        data = ingest.open_dataset(path)
        return {"interactions": content_digest_table(data.interactions), "items": content_digest_table(data.items)}
    layout = detect_layout(path)
    fs, inner = storage.filesystem(path)
    files = {}
    for name in (layout.ratings, layout.movies, layout.tags):
        if name is None or not fs.isfile(storage.join(inner, name)):
            continue
        digest = hashlib.sha256()
        with fs.open(storage.join(inner, name), "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        files[name] = digest.hexdigest()
    return {"layout": layout.name, "files": files}


def _run_identity(config: TrainConfig) -> dict:
    """The settings and data a run's seed is bound to (everything but where things are stored)."""
    where = ("out", "seed_file", "data", "budget_account", "engine")  # where things are stored or run: the data are identified by content, and every engine makes the same releases
    return {"config": {key: value for key, value in asdict(config).items() if key not in where}, "data": _data_fingerprint(config.data)}


def _write_centred(train: str, out: str, mean: float, protocol: str, keep_items: np.ndarray | None, engine=None) -> None:
    """The training rows centred by `mean.centred` (on the engine when given), written to `out`."""
    if engine is not None:
        engine.write_centred(train, out, mean, protocol, keep_items)
        return
    with storage.TableWriter(out, INTERACTIONS) as writer:
        for batch in storage.iter_batches(train):
            writer.write(centred(pa.Table.from_batches([batch]), mean, protocol, keep_items))


LOCAL_PREPARE_ROWS = 2_000_000  # a log smaller than this is prepared in this process (a few hundred MB at most)


def prepare_engine(config: TrainConfig, spark=None, rows: int = 0, local_rows: int = LOCAL_PREPARE_ROWS):
    """Where the prepare stage's row work runs for a log of `rows` rows: in this process (None)
    below `local_rows`, where a handful of Spark or Beam jobs would cost more than the work and
    memory is bounded by the threshold; else on Beam when the run's stats job runs there, on Spark
    when a session is given, in this process when none is."""
    if rows < local_rows:
        return None
    if config.engine in ("beam", "federated"):
        from pipelines.prepare_beam import BeamEngine, options_from_environment

        return BeamEngine(options_from_environment(), scratch=Run(config.out).private("beam"))
    if spark is not None:
        from pipelines.prepare_spark import SparkEngine

        return SparkEngine(spark)
    return None


def ledger_multiplier(ledger_path: str) -> float:
    """The stats noise multiplier the run's budget planned."""
    return float(Ledger.open(ledger_path).budget["multipliers"]["stats"])


def stats_threshold_of(config: TrainConfig, counts: np.ndarray, dp_users: int, noise_per_unit: float) -> float:
    """--stats-threshold, or its default rule: 6 for AM-SSP's features encoder when the release's
    noise-to-signal ratio R = sqrt(m) (N/S) / sqrt(C n) exceeds 0.03, 0 (every item) otherwise.

    m: catalog items; C: the DP counts' total; n: the DP number of users; N/S: `noise_per_unit`.
    The noise that per-item statistics put into the shared feature embeddings grows like sqrt(m) N
    (the paper's sqrt(m d) bound); the signal, with each user's weights normalised, like
    sqrt(C n) S. When R is large, the items below the noise add more noise than signal and thin
    every user's weight. Measured (test RMSE, one seed unless said):
    ml-latest-small (R 0.05-0.27 at epsilon 20-1): 1.062 / 1.046 / 1.008 / 0.978 at epsilon
    1 / 5 / 10 / 20 with every item (worse than its starting point, 1.009-1.013), 0.997 / 0.969 /
    0.962 / 0.947 at 6 N/S; `ssp synth --like movielens`: epsilon 1 (R 0.05) 1.007 with every item,
    0.984 at 3 N/S; epsilon 5 (R 0.013) 0.942 with every item against 0.946 at 3 N/S (3 seeds);
    epsilon 20 (R 0.004) 0.921 against 0.927 at 4 N/S (these with a random initial encoder); with the
    principal initial encoder and the anchor, ml-latest-small at epsilon 5 gives 0.959 with every
    item against 0.944 at 6 N/S. An id encoder has no other embedding for an item outside the
    statistics."""
    if config.stats_threshold is not None:
        return config.stats_threshold
    if config.item_update != "ssp" or config.encoder != "features" or noise_per_unit == 0:
        return 0.0
    ratio = math.sqrt(counts.size) * noise_per_unit / math.sqrt(max(float(np.sum(counts)), 1.0) * max(dp_users, 1))
    return 6.0 if ratio > 0.03 else 0.0


def stats_catalog(config: TrainConfig, counts: pa.Table, keep_items: np.ndarray | None, multiplier: float, dp_users: int) -> np.ndarray:
    """The item ids the statistics cover, from the DP counts only: those of `keep_items` (the
    ranking protocol's top share; None: every item) whose DP count is at least k * N / S (k:
    `stats_threshold_of`; N/S of `_release_units`: the count at which an item's data would match
    the noise in its A_j). Which rows the stats job reads then depends on released data alone."""
    ids, dp_counts = counts["item_id"].to_numpy(), counts["count"].to_numpy()
    chosen = np.ones(ids.size, bool) if keep_items is None else np.isin(ids, keep_items)
    unit, noise = _release_units(config, multiplier)
    threshold = stats_threshold_of(config, dp_counts, dp_users, noise / unit)
    if threshold > 0:
        chosen &= dp_counts >= threshold * noise / unit
        if not chosen.any():
            raise ValueError(f"no catalog item has a DP count of at least {threshold * noise / unit:.4g} (--stats-threshold "
                             f"{threshold:g} times N/S at this epsilon), so the statistics would cover nothing; lower "
                             "--stats-threshold (0: every item) or raise --epsilon")
    logs.log(f"the statistics cover {int(chosen.sum())} of {ids.size} catalog items (DP count >= {threshold:g} N/S)")
    return ids[chosen]


def _encoder(config: TrainConfig, items: pa.Table):
    """(feature space, item encoder) of the run, freshly initialised (deterministic in model_seed)."""
    import tensorflow as tf

    from trainer import encoder as encoders
    from trainer.features import FeatureSpace

    tf.keras.utils.set_random_seed(config.model_seed)
    space = FeatureSpace.from_items(items, use_item_id=config.item_id_feature or config.encoder == "id")
    return space, encoders.ItemEncoder(space, config.dim, config.encoder, seed=config.model_seed)


def _present(path: str) -> bool:
    """Whether anything (a file or a folder, complete or not) is at `path`."""
    fs, inner = storage.filesystem(path)
    fs.invalidate_cache()
    return fs.exists(inner)


def _is_empty_folder(path: str) -> bool:
    fs, inner = storage.filesystem(path)
    return fs.isdir(inner) and not fs.ls(inner, detail=False)


def _released_anything(run: Run) -> bool:
    """Whether the run directory records a release (or cannot be read to tell)."""
    try:
        return storage.exists(run.ledger) and bool(Ledger.open(run.ledger).rows)
    except Exception:
        return True


@contextmanager
def run_directory(config: TrainConfig):
    """The run directory held for a command: its folder checked first, read-only (a folder holding
    something other than this run is refused before the lock would write in it), then the lock,
    and the directory removed whole if the command is refused before its first release."""
    _check_manifest(Run(config.out), config)
    with removed_if_refused(config.out), run_lock(config.out):
        yield


@contextmanager
def removed_if_refused(root: str):
    """A run directory this command creates is removed whole if the command fails before the run's
    first release: a refused command leaves nothing behind, and the corrected command can use the
    same --out. After a release the directory stays: its ledger is the record of what was spent."""
    created = not _present(root)
    was_empty = not created and _is_empty_folder(root)  # made by hand (or a scheduler) for this run
    try:
        yield
    except Exception:
        if (created or was_empty) and _present(root) and not _released_anything(Run(root)):
            storage.remove(root)
            if was_empty:
                fs, inner = storage.filesystem(root)
                fs.makedirs(inner, exist_ok=True)
        raise


def rating_range(config: TrainConfig, data: ingest.Dataset) -> tuple[float, float]:
    """The run's rating range (the DP mean's clipping bounds, the predictions' limits): the data
    set's declared scale, or --rating-min/--rating-max for data that declares none (0.5..5 if not
    given either). Flags that contradict the declared scale are refused, and so is a regression run
    on ratings outside its range: they would be clipped silently and the RMSE would mean nothing.
    (A check on the trusted side before any release, like a malformed row: it releases nothing.)"""
    declared = data.manifest.get("rating_scale")
    given = (config.rating_min, config.rating_max)
    if declared is not None:
        wanted = tuple(d if g is None else g for g, d in zip(given, declared))
        if wanted != tuple(declared):
            raise ValueError(f"--rating-min/--rating-max {wanted[0]:g}..{wanted[1]:g} contradict the rating scale {declared[0]:g}..{declared[1]:g} "
                             f"that {data.path} declares; leave them out to use the data's scale")
        low, high = declared
    else:
        low, high = given[0] if given[0] is not None else 0.5, given[1] if given[1] is not None else 5.0
    if not low < high:
        raise ValueError(f"rating range must have min < max, got [{low:g}, {high:g}]")
    observed = data.manifest.get("label_range")
    if config.protocol == "rmse" and observed and not low <= observed[0] <= observed[1] <= high:
        raise ValueError(f"{data.path}: its ratings range over {observed[0]:g}..{observed[1]:g}, outside the run's rating range {low:g}..{high:g}; "
                         + ("the data set declares that scale: fix the data" if declared is not None else "give the data's scale with --rating-min/--rating-max"))
    return float(low), float(high)


def prepared_rating_range(prepared: dict) -> tuple[float, float]:
    """The rating range a prepared run chose (runs prepared before it was recorded used 0.5..5)."""
    return tuple(prepared.get("rating_range", (0.5, 5.0)))


def prepare(config: TrainConfig, progress: bool = True, spark=None, local_rows: int = LOCAL_PREPARE_ROWS) -> dict:
    """Stage 1: record the run's settings, then split, DP counts, DP mean, centred labels and the
    initial item embeddings (public features only); returns the manifest. Done once: a prepared run
    is left as it is (a different configuration is refused). The rows are split, counted, summed
    and centred on the run's engine (`prepare_engine`): the same tables and releases as in this
    process, without holding the log here (a log under `local_rows` rows is prepared here)."""
    from trainer import encoder as encoders
    from trainer import ssp

    from privacy.seeds import SeedFile

    run = Run(config.out)
    manifest = _check_manifest(run, config)
    if "prepared" in manifest:
        run.require_ledger(config.seed_file)
        return manifest
    # every check before the first write: the data, a given seed's binding, the catalog's features
    identity = _run_identity(config)
    if config.seed_file is not None:
        given = SeedFile.load(config.seed_file)
        given.check_run(given.run_fingerprint(identity))
        given.check_ledger(Ledger.open(run.ledger).identity if storage.exists(run.ledger) else "this run's new ledger")  # a seed serves one ledger
    if storage.exists(run.manifest_path) and storage.exists(run.counts):  # an interrupted prepare that released the counts
        run.require_ledger(config.seed_file)
    run.write_manifest(manifest)
    started = time.time()
    unit = config.unit_of_privacy()
    data = ingest.load_or_ingest(config.data, run.private("data"), progress=progress)
    if config.protocol == "rmse" and data.manifest.get("feedback") == "implicit":  # before any release: it spends nothing
        raise ValueError(f"{data.path} holds implicit feedback (interactions without ratings, every label 1): a regression run "
                         "(--protocol rmse) has no ratings to predict; use --protocol recall")
    ratings = rating_range(config, data)
    engine = prepare_engine(config, spark, sum(rows for _, _, rows in storage.row_groups(data.interactions)), local_rows)
    if not storage.exists(storage.join(run.split, splits.SPLIT_MANIFEST)):
        splits.make_split(data, config.protocol, run.split, config.split_seed, config.holdout, engine)
    train_rows = storage.join(run.split, "train.parquet")
    items = storage.read_table(data.items)
    if config.encoder == "features" and not item_features(items.schema):
        raise ValueError(f"{data.items}: the catalog declares no public feature family, so the features encoder has nothing to embed; "
                         "declare features when ingesting (--public-features), or use --item-id-feature or --encoder id")
    space, model = _encoder(config, items)  # built before any release: an encoder that cannot be built spends nothing
    privacy = config.privacy()  # AM-DPSGD: its DP-SGD schedule waits for the DP number of users of the counts release

    privacy.open_ledger(run.ledger, unit, data.interactions)  # creates the run's budget (charging its data source's account), or checks it on resume
    seeds = release.open_seed_file(config.seed_file, run.ledger)
    seeds.bind_run(seeds.run_fingerprint(identity))  # before the first release is noised
    dp_counts(train_rows, data.items, run.counts_dir, privacy, unit, config.max_items_per_user, run.ledger, seeds.path, engine=engine)
    counts = storage.read_table(run.counts)
    units = dpsgd_multiplier = None
    if config.item_update == "dpsgd":  # plan the DP-SGD sampling over the DP number of users (released with the counts)
        units = dp_units(run.counts)
        dpsgd_multiplier = config.privacy(units).multipliers()["dpsgd"]
    mean = 0.0
    if config.protocol == "rmse":
        mean = dp_mean(train_rows, Ledger.open(run.ledger), seeds, ratings, unit, engine=engine)["mean"]
    keep_items = None
    if config.protocol == "recall":  # train on the top items by DP count (not exact counts)
        keep_items = splits.top_items(counts["item_id"].to_numpy(), counts["count"].to_numpy(), config.train_item_fraction)
    _write_centred(train_rows, run.centred, mean, config.protocol, keep_items, engine)  # the user update's rows
    if config.item_update in STATS_UPDATES:
        covered = stats_catalog(config, counts, keep_items, ledger_multiplier(run.ledger), dp_units(run.counts))
        storage.write_table(items.filter(pa.array(np.isin(items["item_id"].to_numpy(), covered))), run.stats_items)
        _write_centred(train_rows, run.stats_rows, mean, config.protocol, covered, engine)  # the stats job's rows

    if config.encoder == "features" and config.encoder_init == "principal":  # from public features and the DP counts only
        weights = np.ones(space.size)
        weights[space.index_of(counts["item_id"].to_numpy())] = counts["count"].to_numpy()
        rank = model.init_principal(weights)
        logs.log(f"initial encoder: the {rank} principal directions of the public features (weighted by DP counts)"
                    + (f", {config.dim - rank} random ones beyond their rank" if rank < config.dim else ""))
    normalise_embeddings(model)
    storage.write_table(ssp.item_embeddings_table(model), run.item_embeddings(0))
    encoders.write_checkpoint(model, run.checkpoint(0))
    manifest["prepared"] = {"data": data.path, "items": data.items, "stats_items": run.stats_items, "mean": mean, "rating_range": list(ratings), "units": units,
                           "dpsgd_multiplier": dpsgd_multiplier, "started_at": started, "at": time.time()}
    run.write_manifest(manifest)
    logs.detail(f"settings of {run.root}: {json.dumps(manifest['config'], sort_keys=True)}")
    logs.log(f"prepared {run.root}: split, DP counts{', DP mean' if config.protocol == 'rmse' else ''}, initial item embeddings")
    return manifest


def stats_job_of_run(root: str, step: int) -> stats_job.StatsJob:
    """`ssp stats --run RUN --step S`: the prepared run's stats job of step S, from its manifest."""
    run = Run(root)
    manifest = run.prepared()
    config = config_of(run, manifest)
    if config.item_update not in STATS_UPDATES:
        raise ValueError(f"{root} runs --item-update {config.item_update}, which releases no statistics")
    if not 1 <= step <= config.outer_steps:
        raise ValueError(f"--step must be one of the run's outer steps 1..{config.outer_steps}, got {step}")
    return stats_job_for(run, config, step, manifest["prepared"]["stats_items"])


def stats_job_for(run: Run, config: TrainConfig, step: int, stats_items: str) -> stats_job.StatsJob:
    """The stats release of outer step `step` (the job `pipelines/stats.py` or the Beam pipeline runs)."""
    return stats_job.StatsJob(run.stats_rows, run.user_embeddings(step), stats_items, run.counts, run.stats(step), config.settings(), config.privacy(),
                              step=step, ledger_path=run.ledger, seed_file=config.seed_file, shards=config.shards,
                              expansion=run.item_embeddings(step - 1) if config.loss == "logistic" else None)


def release_stats(run: Run, step: int, spark=None) -> dict:
    """Stage 2b of step s: release the noised statistics with the run's engine; returns the step summary."""
    manifest = run.prepared()
    config = config_of(run, manifest)
    job = stats_job_for(run, config, step, manifest["prepared"]["stats_items"])
    if config.engine == "federated":  # the clients solve their own embeddings: no user update before it
        from pipelines import federated
        from pipelines.prepare_beam import options_from_environment

        return federated.run(federated.FederatedJob(job, run.centred, run.item_embeddings(step - 1), config.lambda_u, config.gravity,
                                                    config.federated_dropout, config.federated_max_dropout, scratch=run.private("federated"),
                                                    server=config.federated_server),
                             options_from_environment())
    if config.engine == "beam":
        from pipelines import beam_stats

        return beam_stats.run(job)
    from pipelines import stats

    return stats.run(job, spark)


def _release_units(config: TrainConfig, multiplier: float, averaged: int = 1) -> tuple[float, float]:
    """(S, N) of a stats release: S = wbar Gamma_u^2, the most one user adds to an A_j (wbar when
    nothing is clipped), and N = 2 sqrt(d) z S / sqrt(R), about the spectral norm of the noise in
    A_j (z: the stats noise multiplier; R = `averaged` resamples averaged); 0 without noise."""
    settings = config.settings()
    if config.non_private:
        return settings.wbar, 0.0
    unit = settings.wbar * settings.noise_clips()[0] ** 2
    return unit, multiplier * unit * 2 * math.sqrt(config.dim) / math.sqrt(averaged)


def _ridge_scale(config: TrainConfig, space, multiplier: float, counts: pa.Table, averaged: int = 1) -> np.ndarray:
    """Each item's ridge: weighted-lambda, growing like the item's weighted row count (DP count
    n^(1+e) under user-level weights w ~ n^e), plus a floor at the scale of the noise in A_j (N of
    `_release_units`), so that pure noise shrinks to 0."""
    settings = config.settings()
    _, noise_scale = _release_units(config, multiplier, averaged)
    ridge_scale = np.full(space.size, config.noise_ridge * noise_scale / config.ridge) if config.ridge > 0 else np.ones(space.size)
    exponent = settings.weight_exponent if settings.unit == "user" else 0.0
    ridge_scale[space.index_of(counts["item_id"].to_numpy())] += counts["count"].to_numpy() ** (1 + exponent)
    return ridge_scale


def _ssp_penalties(config: TrainConfig, space, multiplier: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The SSP item update's per-item ridge scale and residual penalty, in the units the release
    defines (never bare numbers: S and N of `_release_units`). The ridge is ridge * S + noise_ridge * N, the same for every
    item: its share of an item's problem fades as the item's data grows, so popular items are not
    shrunk like rare ones. The residual penalty mu = residual_penalty * (S + N) keeps an item's
    free residual at zero until its statistics outweigh the noise: such an item stays what its
    public features say (the starting point), not what the noise says. The anchor kappa =
    anchor * (S + N) holds the shared encoder's output near where the update began, in the same
    units."""
    unit, noise = _release_units(config, multiplier)
    ridge_scale = np.full(space.size, unit + (config.noise_ridge * noise / config.ridge if config.ridge > 0 else 0.0))
    return ridge_scale, np.full(space.size, config.residual_penalty * (unit + noise)), config.anchor * (unit + noise)


def normalise_embeddings(model) -> float:
    """Rescale the encoder so that its item embeddings have root-mean-square norm 1 over the
    catalog (public post-processing: predictions u^T v are unchanged once the users are solved
    again). The user ridge and the user clip are then stated against a fixed item scale. Returns
    the factor applied."""
    vectors = model.embed_all()
    rms = float(np.sqrt(np.mean(np.sum(vectors**2, axis=1)))) if vectors.size else 0.0
    if not rms > 0:
        return 1.0
    model.rescale(1.0 / rms)
    return 1.0 / rms


def _check_step(config: TrainConfig, step: int) -> None:
    if not isinstance(step, int) or not 1 <= step <= config.outer_steps:
        raise ValueError(f"--step must be an outer step of the run, 1..{config.outer_steps}, got {step}")


def item_update(run: Run, step: int, progress: bool = True) -> dict:
    """Stage 2c of step s (TensorFlow): fit the encoder from step s's released statistics and the
    public features, starting from step s-1's checkpoint; the last step also exports the encoder
    and the final item embeddings. Marks the step done and returns the manifest (a done step is
    left as it is)."""
    from trainer import curves
    from trainer import encoder as encoders
    from trainer import ssp

    manifest = run.prepared()
    config = config_of(run, manifest)
    _check_step(config, step)
    if step in manifest["steps_done"]:
        logs.log(f"outer step {step} of {run.root} is already done")
        return manifest
    require_steps(run, manifest, step)
    started = time.time()
    space, model = _encoder(config, storage.read_table(manifest["prepared"]["items"]))
    encoders.restore_checkpoint(model, run.checkpoint(step - 1))
    losses = []  # the SSP loss by epoch (from released statistics); the other updates have no public loss
    if config.item_update == "dpsgd":
        _dpsgd_update(run, config, manifest, step, space, model, progress)
    elif config.item_update != "none":  # none: the encoder stays as it started
        losses = _stats_update(run, config, step, space, model, progress)
    normalise_embeddings(model)
    embeddings = ssp.item_embeddings_table(model)
    storage.write_table(embeddings, run.item_embeddings(step))
    encoders.write_checkpoint(model, run.checkpoint(step))
    if step == config.outer_steps:
        storage.write_table(embeddings, run.path("item_embeddings.parquet"))
        encoders.export(model, run.path("encoder"))
    spent = Ledger.open(run.ledger).epsilon_spent()
    curves.write_step(run.step(step), run.path("tensorboard", f"step-{step}"), losses, spent, time.time() - started)
    manifest = run.mark_step_done(step)
    logs.log(f"outer step {step}/{config.outer_steps} done (epsilon spent {spent:.4g})")
    return manifest


def _stats_update(run: Run, config: TrainConfig, step: int, space, model, progress: bool) -> list[float]:
    """The item update from step s's released statistics: the SSP trainer (each of the R resamples
    in turn), or the DP-ALS / DP-CMF closed-form solves from the mean of the R resamples
    (post-processing of the release: R independent noisy copies, all paid for, average to 1/R of
    the noise variance). Returns the SSP trainer's loss by epoch (none for a closed-form solve)."""
    from trainer import ssp

    if not storage.exists(storage.join(run.stats(step), stats_job.RELEASE_SUMMARY)):
        raise ValueError(f"{run.root}: the statistics of step {step} are not released ({run.stats(step)} is incomplete); run step {step}'s stats job first")
    summary = storage.read_json(storage.join(run.stats(step), stats_job.RELEASE_SUMMARY))
    settings = config.settings()
    tables = stats_job.stats_tables(run.stats(step))
    multiplier = ledger_multiplier(run.ledger)
    ssp_config = ssp.SSPConfig(config.epochs, config.batch_size, config.learning_rate, config.ridge, psd_projection=config.psd_projection and not config.non_private, seed=config.model_seed)
    # the release parameters the run's own ledger planned (not the folder's word for them)
    expected = {"clip_u": settings.clip_u, "clip_y": settings.clip_y, "wbar": settings.wbar, "noise_multiplier": multiplier}
    if summary["noise_multiplier"] != expected["noise_multiplier"]:
        raise ValueError(f"{run.stats(step)}: released with noise multiplier {summary['noise_multiplier']:g}, but this run planned {expected['noise_multiplier']:g}")
    if config.loss == "logistic":  # SSP2's A_j, b_j around the step's starting item embeddings (post-processing)
        for table in tables:
            ssp.check_stats(table, {"d": config.dim, **expected})
        start = validate_item_embeddings(storage.read_table(run.item_embeddings(step - 1)), dim=config.dim).sort_by("item_id")
        points = (start["item_id"].to_numpy(), list_column_to_matrix(start["embedding"], config.dim, "item embedding"))
        tables = [ssp.expand_table(table, storage.join(run.stats(step), "expanded-" + table.rsplit("/", 1)[-1]), points, ssp_config.psd_projection)
                  for table in tables]
        ssp_config = dataclasses.replace(ssp_config, psd_projection=False)  # done before the expansion
    gravity = None
    if config.gravity > 0:  # implicit feedback: penalise every item's scores through the users' DP Gram matrix
        seeds = release.open_seed_file(config.seed_file, run.ledger)
        gravity = config.gravity * dp_gram(run.user_embeddings(step), Ledger.open(run.ledger), seeds, config.dim, settings.clip_u, step)
    if config.item_update in ("als", "cmf"):  # weighted-lambda ridges, from the mean of the resamples
        ridge_scale = _ridge_scale(config, space, multiplier, storage.read_table(run.counts), len(tables))
    if config.item_update in ("als", "cmf") and len(tables) > 1:
        from trainer import als

        for table in tables:  # each resample as released (what the ledger planned), before they are mixed
            ssp.check_stats(table, {"d": config.dim, **expected})
        tables = [als.mean_table(tables, storage.join(run.stats(step), "mean-of-resamples.parquet"))]
    if config.item_update == "als":
        from trainer import als

        model.set_item_vectors(als.solve_items(tables[0], space, config.dim, config.ridge, ridge_scale, ssp_config.psd_projection, expected, gravity=gravity))
        return []
    elif config.item_update == "cmf":
        from trainer import cmf

        # The feature vectors are a function of the previous item vectors (the feature solve), so
        # nothing but the encoder carries over between steps; step 1 starts from DP-ALS (P = 0).
        features = cmf.solve_features(cmf.feature_matrix(space), model.embed_all(), config.feature_weight, config.feature_ridge) if step > 1 else None
        table = tables[0]
        if ssp_config.psd_projection:  # once, not once per inner iteration
            table = ssp.project_table(table, storage.join(run.stats(step), "psd-" + table.rsplit("/", 1)[-1]))
        vectors, _ = cmf.solve_items(table, space, config.dim, config.ridge, ridge_scale, False, expected, config.feature_weight, config.feature_ridge,
                                     config.cmf_iterations, features, gravity)
        model.set_item_vectors(vectors)
        return []
    ssp_ridge, residual_penalty, anchor = _ssp_penalties(config, space, multiplier)
    with _kernel(run, step):
        return ssp.train(model, tables, ssp_config, expected, logs.bars(progress), ssp_ridge, gravity, residual_penalty, anchor)


@contextmanager
def _kernel(run: Run, step: int):
    """Time the item update's trainer steps into the manifest's `kernel_seconds` (Run.record_seconds)."""
    started = time.perf_counter()
    yield
    run.record_seconds(f"step-{step}/item_update", time.perf_counter() - started, "kernel_seconds")


def _dpsgd_update(run: Run, config: TrainConfig, manifest: dict, step: int, space, model, progress: bool) -> None:
    """AM-DPSGD's item update: TF-Privacy DP-SGD on the private training rows (weighted, clipped
    per user) against step s's user embeddings, released through the ledger as one DP-SGD event.
    Its sampling rate is planned over the DP number of users (so the event's q reveals no exact
    count); every user is still sampled with that rate when the true number is larger.
    Its sampling and noise are seeded from the run's secret seed and the release index, so a rerun
    of the step (after a crash) reproduces the same release rather than spending budget twice."""
    import hashlib

    from privacy.weights import user_level_weights
    from trainer import dpsgd

    units = manifest["prepared"]["units"]  # the DP number of users (released with the counts), never the exact one
    settings = config.settings()
    rows = storage.read_table(run.centred)
    users, positions, labels = rows["user_id"].to_numpy(), space.index_of(rows["item_id"].to_numpy()), rows["label"].to_numpy()
    seeds = release.open_seed_file(config.seed_file, run.ledger)
    if config.loss == "logistic":  # positives and sampled negatives (secret randomness), weighted as SSP-convex weighs its every-item negatives
        negatives = np.random.default_rng(int.from_bytes(hashlib.sha256(seeds.seed + b"negatives" + step.to_bytes(8, "big")).digest()[:8], "big"))
        users, positions, labels, weights = dpsgd.logistic_rows(users, positions, space.size, negatives)
    elif settings.unit == "user":
        counts = storage.read_table(run.counts).sort_by("item_id")
        row_counts = counts["count"].to_numpy()[np.searchsorted(counts["item_id"].to_numpy(), rows["item_id"].to_numpy())]
        weights = user_level_weights(users, row_counts, settings.wbar, settings.weight_exponent)
    else:
        weights = np.ones(rows.num_rows)
    embeddings = validate_user_embeddings(storage.read_table(run.user_embeddings(step)), dim=config.dim).sort_by("user_id")
    user_vectors = (embeddings["user_id"].to_numpy(), list_column_to_matrix(embeddings["embedding"], config.dim, "user embedding"))
    ledger = Ledger.open(run.ledger)
    multiplier = float(manifest["prepared"]["dpsgd_multiplier"])  # planned by prepare over `units`; the ledger caps what it spends
    q, steps = config.dpsgd_schedule(units)
    event = accounting.dpsgd_event(multiplier, q, steps)
    inputs = {"rows": seeds.digest_table(run.centred), "user_embeddings": seeds.digest_table(run.user_embeddings(step)), "counts": seeds.digest_table(run.counts)}
    release.check_counts_release(ledger, seeds, run.counts, inputs["counts"])
    index = release.make_release(ledger, seeds, f"step-{step}/dpsgd", event, {"settings": asdict(config.dpsgd_config(units)), "units": units, "inputs": inputs})
    seed = int.from_bytes(hashlib.sha256(seeds.release_seed(index) + b"dpsgd").digest()[:8], "big")  # keyed by the release, as every noise draw
    with _kernel(run, step):
        result = dpsgd.train(model, (users, positions, labels, weights), user_vectors, config.dpsgd_config(units, seed), multiplier,
                             settings.clip_u, settings.clip_y, logs.bars(progress), units=units)
    if accounting.event_to_json(result["event"]) != accounting.event_to_json(event):
        raise RuntimeError(f"DP-SGD ran {result['event']}, not the recorded release {event}")


def run(config: TrainConfig, spark=None, progress: bool = True) -> dict:
    """Run (or resume) the whole training in this process; returns the metrics written to RUN/metrics.json.

    The same stages a scheduler runs as separate tasks, with one Spark session for the Spark ones;
    each stage's wall time goes into the manifest's `seconds` (Run.record_seconds).
    Holds the run directory's lock throughout: a second run on the same directory is refused.
    """
    with run_directory(config):
        layout = Run(config.out)

        @contextmanager
        def timed(phase: str):
            started = time.perf_counter()
            yield
            layout.record_seconds(phase, time.perf_counter() - started)

        def stages(active_spark):
            with timed("prepare"):  # on a resumed run: the check of its recorded settings
                prepare(config, progress, active_spark)
            for s in range(1, config.outer_steps + 1):
                if s in layout.read_manifest()["steps_done"]:
                    continue
                if config.engine != "federated":  # federated clients solve their embeddings in the stats round
                    with timed(f"step-{s}/user_update"):
                        user_update.run_step(active_spark, layout.root, s)
                if config.item_update not in ("dpsgd", "none"):  # AM-DPSGD releases no statistics, the starting point none
                    with timed(f"step-{s}/stats"):
                        summary = release_stats(layout, s, active_spark)
                    if "kernel_task_seconds" in summary:  # the Spark job's (Beam's runners time their own)
                        layout.record_seconds(f"step-{s}/stats", summary["kernel_task_seconds"], "kernel_seconds")
                with timed(f"step-{s}/item_update"):
                    item_update(layout, s, progress)
            with timed("final_user_update"):
                user_update.run_step(active_spark, layout.root, None)

        if spark is not None:
            stages(spark)
        else:
            from pipelines.spark import session

            with session("ssp-train") as own:
                stages(own)
        with timed("evaluation"):
            metrics = evaluate(layout)
        return metrics


def evaluate(run: Run) -> dict:
    """Last stage: valid and test metrics of the finished run (trusted side: held-out private
    ratings and the final user embeddings), with the ledger's epsilon and the steps' curves
    (trainer.curves); writes RUN/metrics.json."""
    from trainer import curves
    from trainer.features import FeatureSpace

    manifest = run.prepared()
    config = config_of(run, manifest)
    require_steps(run, manifest, config.outer_steps + 1)
    prepared = manifest["prepared"]
    if config.protocol == "rmse" and config.holdout > 0 and not storage.exists(run.user_embeddings(None)):
        raise ValueError(f"{run.root}: no final user embeddings; run `ssp user-update --run {run.root} --final` first")
    space = FeatureSpace(storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy(), [])  # the catalog only
    final_items = validate_item_embeddings(storage.read_table(run.path("item_embeddings.parquet")), dim=config.dim)
    if final_items.num_rows != space.size:
        raise ValueError(f"{run.path('item_embeddings.parquet')}: {final_items.num_rows} item embeddings for a catalog of {space.size} items")
    item_vectors = np.zeros((space.size, config.dim))
    item_vectors[space.index_of(final_items["item_id"].to_numpy())] = list_column_to_matrix(final_items["embedding"], config.dim, "item embedding")
    metrics = _evaluate(config, space, run.split, storage.join(run.split, "train.parquet"), item_vectors, run.user_embeddings(None), prepared["mean"], config.unit_of_privacy(),
                        prepared_rating_range(prepared), fold_in_counts(run, config, space))
    ledger = Ledger.open(run.ledger)
    done_at = manifest.get("step_done_at", {})
    marks = [prepared["at"]] + [done_at.get(str(s)) for s in range(1, config.outer_steps + 1)]
    metrics.update(
        epsilon_spent=ledger.epsilon_spent(), delta=config.delta, epsilon_budget=ledger.budget["epsilon"],
        releases=len(ledger.rows), seconds=time.time() - prepared["started_at"],
        step_seconds={s: marks[s] - marks[s - 1] for s in range(1, len(marks)) if marks[s] is not None and marks[s - 1] is not None},
        outputs={"run": run.root, "ledger": run.ledger, "encoder": run.path("encoder"), "item_embeddings": run.path("item_embeddings.parquet")},
    )
    final = {name: value for name, value in metrics.items() if name.startswith(("test_", "valid_")) and isinstance(value, float)}
    metrics["curves"] = curves.gather([run.step(s) for s in range(1, config.outer_steps + 1)], run.path("tensorboard", "run"), final)
    storage.write_json(metrics, run.path("metrics.json"))
    if not config.non_private:  # the report of what the run released (a non-private run has no guarantee to report)
        from pipelines.publish import privacy_report

        storage.StagedFile(privacy_report(run).encode(), run.path("privacy.md")).publish()
    manifest["status"] = "done"
    run.write_manifest(manifest)
    return metrics


def fold_in_counts(run: Run, config: TrainConfig, space) -> np.ndarray | None:
    """The DP counts in catalog order when the ranking fold-in uses them (--popularity-column), else None."""
    if config.protocol != "recall" or not config.popularity_column:
        return None
    table = storage.read_table(run.counts, columns=["item_id", "count"])
    counts = np.ones(space.size)
    counts[space.index_of(table["item_id"].to_numpy())] = table["count"].to_numpy()
    return counts


def _evaluate(config: TrainConfig, space, split_dir: str, train_rows: str, item_vectors: np.ndarray, final_users: str, mean: float, unit: str,
              ratings: tuple[float, float], counts: np.ndarray | None = None) -> dict:
    """Valid and test metrics of the protocol, overall and by popularity bucket (trusted side);
    predicted ratings are limited to `ratings`, the run's rating range; a ranking fold-in gets
    `counts` (catalog order) as a popularity column when given."""
    from trainer import evaluate

    train = storage.read_table(train_rows, columns=["item_id"])
    buckets = evaluate.popularity_buckets(space.item_ids, train["item_id"].to_numpy())
    metrics = {"protocol": config.protocol, "non_private": config.non_private, "unit": unit, "holdout": config.holdout}
    if config.holdout == 0:  # production mode: every row trained, so there is nothing to evaluate on
        metrics["no_heldout_data"] = "--holdout 0 (production mode): every row is a training row, so there is no held-out data and no test metrics"
        return metrics
    if config.protocol == "rmse":
        users = validate_user_embeddings(storage.read_table(final_users), dim=config.dim).sort_by("user_id")
        user_table = (users["user_id"].to_numpy(), np.array(users["embedding"].to_pylist(), dtype=np.float64).reshape(-1, config.dim))
        for part in ("valid", "test"):
            rows = storage.read_table(storage.join(split_dir, f"{part}.parquet"))
            positions = space.index_of(rows["item_id"].to_numpy())
            labels = rows["label"].to_numpy()
            predictions = evaluate.predict_ratings(rows["user_id"].to_numpy(), positions, user_table, item_vectors, mean, ratings)
            report = evaluate.rmse_report(predictions, labels, buckets[positions])
            metrics[f"{part}_rmse"] = report["rmse"]
            metrics[f"{part}_rmse_sliced"] = report["sliced"]
            baseline = evaluate.rmse_report(np.full(labels.size, mean), labels, buckets[positions])  # the DP mean, on the same slices
            metrics[f"{part}_mean_predictor_rmse"] = baseline["rmse"]
            metrics[f"{part}_mean_predictor_rmse_sliced"] = baseline["sliced"]
        metrics["dp_mean"] = mean
        metrics["sliced"] = {"valid": metrics["valid_rmse_sliced"], "test": metrics["test_rmse_sliced"]}
    else:
        vectors = item_vectors if counts is None else evaluate.with_popularity(item_vectors, counts)
        for part in ("valid", "test"):
            history = storage.read_table(storage.join(split_dir, f"{part}_history.parquet"))
            targets = storage.read_table(storage.join(split_dir, f"{part}_targets.parquet"))
            report = evaluate.recall_report(
                (history["user_id"].to_numpy(), space.index_of(history["item_id"].to_numpy()), np.ones(history.num_rows)),
                (targets["user_id"].to_numpy(), space.index_of(targets["item_id"].to_numpy())), vectors, config.lambda_u, buckets,
                gravity=config.gravity, loss=config.loss,
            )
            metrics[f"{part}_recall_at_20"] = report["recall_at_20"]
            metrics[f"{part}_recall_at_20_sliced"] = report["sliced"]
        metrics["sliced"] = {"valid": metrics["valid_recall_at_20_sliced"], "test": metrics["test_recall_at_20_sliced"]}
    return metrics


def describe(metrics: dict) -> str:
    """The human summary printed at the end of a run."""
    lines = []
    if "no_heldout_data" in metrics:
        lines.append(f"no test metrics: {metrics['no_heldout_data']}")
    elif metrics["protocol"] == "rmse":
        lines.append(f"test RMSE {metrics['test_rmse']:.4f} (valid {metrics['valid_rmse']:.4f}; predicting the DP mean {metrics['dp_mean']:.3f}: {metrics['test_mean_predictor_rmse']:.4f})")
        sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_rmse_sliced"])
        lines.append(f"test RMSE by item popularity (least to most popular fifth): {sliced}")
        if "test_mean_predictor_rmse_sliced" in metrics:
            sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_mean_predictor_rmse_sliced"])
            lines.append(f"  predicting the DP mean, same fifths: {sliced}")
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
        "rating_min": "lowest rating: the DP mean's clipping bound and the predictions' floor (default: the data set's declared "
                      "rating scale, see `ssp ingest --rating-scale`; 0.5 for data that declares none)",
        "rating_max": "highest rating: the DP mean's other clipping bound and the predictions' ceiling (default: the data set's declared "
                      "rating scale; 5 for data that declares none)",
        "out": "run directory (local or gs://)",
        "epsilon": "target epsilon of the whole run, every release included (user level: what one user's whole history can change); "
                   "the noise is calibrated to spend exactly this",
        "delta": "target delta of the whole run: the chance, beyond epsilon, that the guarantee fails; keep it below 1/(number of users)",
        "outer_steps": "outer steps S of alternating minimization (user update, then item update from newly released statistics); "
                       "each step is one more release, so more steps mean more noise per release at the same epsilon",
        "resamples": "independently noised copies R of each statistics release (the paper's SSP1); the budget is split among them",
        "clip_u": "Gamma_u: each user embedding is clipped to this L2 norm before it enters the statistics (item embeddings have unit "
                  "RMS norm); with --wbar it bounds what one user adds to A_j, and so the noise",
        "clip_y": "Gamma_y: each centred label is clipped to [-Gamma_y, Gamma_y] before it enters b_j; with --clip-u and --wbar it bounds "
                  "what one user adds to b_j",
        "wbar": "bound on each user's weights: their squares sum to wbar^2 over the user's items, so one user moves A by at most wbar "
                "Gamma_u^2 and b by wbar Gamma_y Gamma_u whatever the length of their history",
        "max_items_per_user": "at most this many of a user's items count in the DP item counts (the first release): bounds the counts' "
                              "sensitivity to sqrt of this",
        "count_share": "share of the run's privacy budget spent on the DP item counts (the weights, the stats threshold and the "
                       "encoder's start come from them)",
        "mean_share": "share of the budget spent on the DP mean rating (--protocol rmse: labels are centred by it)",
        "gram_share": "share of the budget spent on the users' DP Gram matrix (--gravity > 0, implicit feedback)",
        "lambda_u": "ridge of the user update: u = (sum v v^T + lambda_u n I)^-1 sum y v over the user's n ratings (weighted lambda); "
                    "users are solved privately on the trusted side, so it has no privacy effect",
        "epochs": "AM-SSP: passes of the item trainer over the released statistics in each item update (post-processing: no privacy effect)",
        "batch_size": "AM-SSP: items per minibatch of the item trainer",
        "learning_rate": "AM-SSP: Adam learning rate of the item trainer",
        "ridge": "ridge lambda of the item update in units of the most one user adds to an item's statistics (S): lambda S I is added to "
                 "every A_j",
        "noise_ridge": "extra ridge of the item update in units of the noise's spectral norm (N): noise_ridge N I is added to every A_j, "
                       "which keeps the noised A_j positive definite and items with little signal near their start",
        "psd_projection": "project each noised A_j onto the positive semi-definite cone before training on it (free post-processing)",
        "feature_ridge": "DP-CMF: ridge of the feature embeddings",
        "cmf_iterations": "DP-CMF: alternating item / feature solves in each outer step",
        "dpsgd_epochs": "AM-DPSGD: expected passes over the users in each item update (more epochs: more DP-SGD steps, more noise per step)",
        "dpsgd_learning_rate": "AM-DPSGD: learning rate of DP-SGD",
        "dpsgd_max_rows_per_user": "AM-DPSGD: at most this many of a user's rows form the user's example, whose gradient is clipped",
        "split_seed": "seed of the train/valid/test split (the split is per user or per rating by a keyed hash: one user's rows never "
                      "move another's)",
        "model_seed": "seed of the encoder's initialisation and the item trainer's shuffling (not of the noise: that comes from the "
                      "secret seed file)",
        "shards": "part files per statistics table, the parallelism of the stats job's write",
        "non_private": "no noise and no clipping: the non-private top line of the same pipeline",
        "seed_file": "a secret noise seed file for a new run (default: RUN/private/seed, from the OS CSPRNG); a seed file serves one "
                     "run's ledger: another run's is refused (to reproduce a run, copy its folder)",
        "engine": "engine of the prepare stage (split, DP counts, DP mean, centred rows) and of the stats job: spark or beam "
                  "(the user update runs on Spark), or federated: the prepare stage on Beam, and each step's statistics released by "
                  "simulated devices (solving their own embeddings) through secure aggregation with distributed Skellam noise "
                  "(pipelines.federated; accountant: RDP on integer orders)",
        "federated_dropout": "--engine federated: share of clients that drop out of each round after its setup (simulated; their masks are "
                             "recovered from their neighbours' Shamir shares)",
        "federated_server": "--engine federated: the simulated server, honest, or partition: a malicious server showing holders different "
                            "survivor sets to unmask one client (a drill: the consistency check refuses the round, nothing is published)",
        "federated_max_dropout": "--engine federated: the noise shares are planned for this share of clients missing, and never fewer "
                                 "than a majority of the clients answering (the consistency check's quorum); a round with more dropouts is "
                                 "refused",
        "loss": "square (the paper's AM-SSP) or logistic: SSP-convex for implicit feedback (--protocol recall): each step releases the "
                "logistic loss's H_j, g_j around the step's starting item embeddings, every user's positives against every item as a "
                "negative, and the SSP2 trainer descends that quadratic approximation; users are solved with the same loss (Spark engine)",
        "item_update": "item update: ssp (AM-SSP: SSP2 trainer of the encoder), als (DP-ALS) or cmf (DP-CMF: public features as un-noised rows), "
                       "closed-form solves from the same statistics with --encoder id, or dpsgd (AM-DPSGD: TF-Privacy DP-SGD on the rows, no statistics; "
                       "its budget share is the statistics', and it ignores --gravity in the item update), or none (the starting point: "
                       "the public-feature encoder as initialised, users fitted to it; no statistics released)",
        "feature_weight": "DP-CMF: weight mu of the public feature rows (0: DP-ALS)",
        "dpsgd_batch_size": "AM-DPSGD: expected users per DP-SGD step",
        "dpsgd_clip": "AM-DPSGD: per-user gradient clip norm",
        "encoder": "features (public feature families + item id) or id (one embedding per item)",
        "encoder_init": "the features encoder's start (and the starting point every item update is held near): principal (the top-d principal "
                        "directions of the public feature vectors, items weighted by their DP counts: free post-processing) or random",
        "popularity_column": "--protocol recall: a user folded in from their history also gets a coefficient on the items' DP counts "
                             "(a public release: no privacy cost), so where the noise leaves the trained directions little signal the "
                             "ranking falls back on popularity; ssp recommend does the same (default: on)",
        "item_id_feature": "the features encoder adds a free per-item residual to what the public features say, held at zero by "
                           "--residual-penalty until the item's statistics outweigh the noise (default: on)",
        "anchor": "how strongly each item update holds the shared features encoder near where it began (its starting point), in the same "
                  "units as --residual-penalty: larger keeps the model at its public-feature start when the statistics are mostly noise",
        "residual_penalty": "penalty on each item's residual, in units of the most one user adds to an item's statistics plus the "
                            "noise's spectral norm: larger keeps rare items at their public features",
        "dim": "embedding dimension d (default: 32 for --non-private runs; private: 8 for --protocol rmse; for recall 16 below "
               "--epsilon 10, 32 from 10)",
        "weight_exponent": "exponent e of the user-level weights w = wbar n_j^e / sqrt(sum over the user's items of n^2e), n_j the item's "
                           "DP count (default: -0.25, towards rare items, for --protocol rmse; 0, even, for recall)",
        "holdout": splits.HOLDOUT_HELP,
        "budget_account": "where a new budget account of the data source is kept (a JSON file): every release of every run on these users is "
                          "charged there, so their lifetime epsilon is composed and capped. A data source (identified by the content of its "
                          "interactions, wherever they are stored) has one account, found through the registry $SSP_BUDGET_ACCOUNTS (default "
                          "~/.ssp/budget-accounts); a second one is refused (default: the registry's own)",
        "account_cap": "lifetime epsilon cap of a new budget account: a release that would take the users past it is refused (default: no cap, "
                       "the lifetime epsilon is only reported)",
        "account_window_days": "renewal window of a new budget account: releases older than this many days stop counting against its cap "
                               "(default: none, every release counts forever)",
        "gravity": "implicit-feedback weight alpha on the users' DP Gram matrix (default: 0.1 for --protocol recall, 0 for rmse)",
        "train_item_fraction": "--protocol recall: the statistics cover this share of the catalog, the items with the largest DP counts "
                               "(default: 0.1 for --encoder id, whose rare items would be fitted to noise alone; 1 for features, "
                               "whose rare items fall back on their features)",
        "stats_threshold": "the statistics cover the items whose DP count is at least this many times N/S (the count at which an item's "
                           "data would match the noise in its A_j); the others keep what their public features say, and no user's weight "
                           "is spent on them; 0: every item (default: 6 for --item-update ssp with the features encoder when the release's noise-to-"
                           "signal ratio sqrt(m) (N/S) / sqrt(total DP count x DP users) exceeds 0.03, 0 otherwise)",
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
        choices = {"protocol": splits.PROTOCOLS, "engine": ENGINES, "loss": LOSSES, "item_update": ITEM_UPDATES, "encoder": ("features", "id"),
                   "encoder_init": ENCODER_INITS}.get(item.name)
        text = helps.get(item.name, item.name.replace("_", " "))
        parser.add_argument(name, type=kind, default=default, choices=choices, help=text if "default:" in text else f"{text} (default: %(default)s)")
    parser.add_argument("--config", help="a file of settings, one per flag (TOML: `epsilon = 5`, `item-update = \"ssp\"`; or JSON, such as "
                        "a run's manifest.json, whose settings are fed back): flags given on the command line override it")
    parser.add_argument("--stage", choices=STAGES, default="all",
                        help="all: the whole run in this process (default); prepare: only the first stage, recording these settings in "
                        "OUT/manifest.json for the stage commands (user-update, stats, item-update, evaluate) that a scheduler runs")


def add_stage_arguments(parser: argparse.ArgumentParser, step: bool) -> None:
    """The flags of a stage command: the run directory (everything else comes from its manifest)."""
    parser.add_argument("--run", required=True, help="run directory prepared by `ssp train --stage prepare` (local or gs://)")
    if step:
        parser.add_argument("--step", type=int, required=True, help="outer step s (1..S)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's settings: the flags, over the --config file's settings (args.explicit: the flags
    given on the command line), over the defaults."""
    values = {item.name: getattr(args, item.name) for item in fields(TrainConfig)}
    if getattr(args, "config", None):
        given = getattr(args, "explicit", set())
        values.update({name: value for name, value in read_config(args.config).items() if name not in given})
    return TrainConfig(**values)


def read_config(path: str) -> dict:
    """The settings in a --config file (TOML, or JSON such as a run's manifest.json, whose "config"
    section holds them), by TrainConfig field; an unknown setting or a value of the wrong type is
    refused naming the file and the setting."""
    import tomllib

    fs, inner = storage.filesystem(path)
    if not fs.isfile(inner):
        raise storage.MissingTableError(f"--config {path}: file not found")
    text = fs.cat_file(inner).decode("utf-8", errors="replace")
    try:
        document = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--config {path} is not {'TOML' if path.endswith('.toml') else 'JSON'} ({exc})") from None
    if isinstance(document, dict) and isinstance(document.get("config"), dict):
        document = document["config"]  # a run's manifest.json
    if not isinstance(document, dict):
        raise ValueError(f"--config {path}: expected a table of settings")
    return _typed_settings(f"--config {path}", document)


def _typed_settings(where: str, document: dict) -> dict:
    """`document`'s settings by TrainConfig field, each of its field's type (`where` names the source
    in errors)."""
    kinds = {item.name: item.type for item in fields(TrainConfig)}
    settings = {}
    for key, value in document.items():
        name = key.replace("-", "_")
        if name not in kinds:
            raise ValueError(f"{where}: unknown setting {key!r} (the settings are `ssp train`'s flags)")
        kind = kinds[name] if isinstance(kinds[name], str) else kinds[name].__name__
        wanted = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[kind.split(" ")[0]]
        if value is None and "None" in kind or isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted):
            settings[name] = float(value) if wanted == (int, float) and value is not None else value
        else:
            raise ValueError(f"{where}: {key} must be {kind.replace(' | None', '')}, got {value!r}")
    return settings


def check_recorded(path: str, recorded: dict) -> None:
    """A run manifest's recorded settings: known, of their types and in their ranges, as flags are."""
    settings = _typed_settings(path, {key: value for key, value in recorded.items() if key != "unit"})  # unit: recorded by older versions
    try:
        TrainConfig(**{**settings, "out": "-"})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.stage == "prepare":
        with run_directory(config):
            if config.engine in ("beam", "federated"):
                prepare(config)
            else:
                from pipelines.spark import session

                with session("ssp-prepare") as spark:
                    prepare(config, spark=spark)
        print(f"prepared {config.out}; next: `ssp user-update --run {config.out} --step 1`")
        return 0
    print(describe(run(config)))
    return 0


def item_update_main(args: argparse.Namespace) -> int:
    """`ssp item-update --run RUN --step s`."""
    with existing_run_lock(args.run):
        manifest = item_update(Run(args.run), args.step)
    print(f"outer step {args.step} of {args.run} done (steps done: {manifest['steps_done']})")
    return 0


def evaluate_main(args: argparse.Namespace) -> int:
    """`ssp evaluate --run RUN`."""
    with existing_run_lock(args.run):
        metrics = evaluate(Run(args.run))
    print(describe(metrics))
    return 0

