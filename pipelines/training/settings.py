"""The settings of a training run (`TrainConfig`) and their checks.

Every numeric setting's type and range is checked before anything is written or spent, and a run's
recorded settings are checked the same way when a later stage reads them (`check_recorded`): a
setting found wrong after the first release would strand a run whose budget is partly spent. The
privacy plan of a run (its budget split between the counts, mean, Gram and stats releases) and the
release units S and N (`release_units`) follow from the settings alone.

Privacy: settings only; none of them is read from the private data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from pipelines.data import ingest, splits
from pipelines.engines import engine as engines
from pipelines.engines import user_solves
from pipelines.releases import release
from pipelines.releases.counts import DEFAULT_MAX_ITEMS_PER_USER
from pipelines.releases.stats_core import LOSSES, StatsSettings
from schemas import storage
from schemas.errors import UserError

# SSP2 trainer of the encoder; DP-ALS and DP-CMF closed-form solves (id-only encoder) from the same
# statistics; AM-DPSGD (TF-Privacy DP-SGD on the private rows, no statistics released); item-mean: the DP
# per-item mean (the statistics of item biases alone); none: the starting point (the public-feature encoder
# as initialised, users fitted to it); the last two are baselines an item update must beat
ITEM_UPDATES = ("ssp", "als", "cmf", "dpsgd", "item-mean", "none")


STATS_UPDATES = ("ssp", "als", "cmf", "item-mean")  # the item updates that train from released statistics
BIASED_UPDATES = ("ssp", "als", "cmf", "dpsgd", "item-mean", "none")
# A non-private run has no budget to split over its steps: enough steps for alternating minimization
# to converge. On `ssp synth --like movielens` (6,040 users, biases): 2 / 6 / 10 steps give test RMSE
# 0.8723 / 0.8593 / 0.8576, against 0.8542 for the ladder's biased ALS MF (bench.ladder).
NON_PRIVATE_OUTER_STEPS = 10  # the item updates that fit biases (the others: --no-biases for now)
FOLD_IN_GRAVITY = 1.0  # implicit feedback: the gravity of a ranked user's fold-in (TrainConfig.__post_init__)


ENGINES = tuple(engines.ENGINES)


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
    federated_server: str = "honest"  # --engine federated: the simulated server (pipelines.engines.federated.SERVERS; "partition" for drills)
    item_update: str = "ssp"
    loss: str = (
        "square"  # "logistic": implicit feedback's logistic loss, by SSP-convex (privacy.quadratic); --protocol recall
    )
    encoder: str = "features"
    encoder_init: str = "principal"  # the features encoder's start: the DP-count-weighted principal directions of the public features, or random
    item_id_feature: bool | None = None  # None: on (the per-item residual of the features encoder)
    popularity_column: bool = (
        True  # --protocol recall: the fold-in also gets the DP counts as a column (trainer.evaluate.with_popularity)
    )
    dim: int | None = None  # None: 32 for non-private runs, 8 for private ones
    outer_steps: int | None = (
        None  # None: `_default_outer_steps` (1 for AM-SSP with biases and the per-item mean, NON_PRIVATE_OUTER_STEPS without noise, else 2)
    )
    resamples: int = 1
    clip_u: float = 0.3  # against item embeddings of unit RMS norm: most users are clipped, i.e. normalised
    clip_y: float | None = None  # centred labels; None: 1.5 for ratings, 1 for ranking (its labels are 1)
    wbar: float = 1.0
    weight_exponent: float | None = None  # None: -0.25 (rmse), 0 (recall); see __post_init__
    max_items_per_user: int = DEFAULT_MAX_ITEMS_PER_USER
    count_share: float = release.DEFAULT_COUNT_SHARE
    mean_share: float = release.DEFAULT_MEAN_SHARE
    lambda_u: float | None = (
        None  # the user ridge per rating: lambda_u n for a user with n ratings; None: 0.01 with biases, else 0.1
    )
    user_prior: float | None = (
        None  # the user ridge's fixed part (a prior precision, in the unit-RMS item vectors' units); None: 20 with biases, else 0
    )
    biases: bool | None = None  # None: on where the model supports them (see __post_init__)
    lambda_bias: float = 5.0  # the user bias's ridge: a pseudo-count of zero residuals (trainer.solve.ridge_solve)
    bias_coordinate: float | None = (
        None  # c / clip_u, the constant appended to each clipped user vector (pipelines.releases.stats_core); None: by epsilon
    )
    epochs: int = 30
    batch_size: int | None = None  # None: trainer.ssp.auto_batch_size of the covered catalog
    learning_rate: float = 0.01
    ridge: float = 0.1
    noise_ridge: float = 0.25
    gravity: float | None = None  # None: 0.1 for the ranking protocol (implicit feedback), 0 otherwise
    fold_in_gravity: float | None = None  # the gravity of a held-out or served user's fold-in; None: see __post_init__
    train_item_fraction: float | None = (
        None  # ranking protocol: share of the catalog (top by DP count) the statistics cover; None: see __post_init__
    )
    stats_threshold: float | None = (
        None  # the statistics cover the items whose DP count is >= this times N/S; None: see stats_threshold_of
    )
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
    positive_threshold: float | None = (
        None  # --protocol recall: labels above it are positives; None: the top 30% of the rating scale (splits.positive_threshold_for)
    )
    confidence_alpha: float = 1.0  # implicit feedback: a (user, item) that came n times weighs trainer.solve.confidence(n, alpha); 0: once is once
    rating_min: float | None = None  # None: the data set's declared rating scale (see rating_range)
    rating_max: float | None = None
    split_seed: int = splits.DEFAULT_SEED
    holdout: float = splits.DEFAULT_HOLDOUT  # 0: production mode, every row trains and nothing is held out
    model_seed: int = 0
    shards: int = 4
    anchor: float = (
        10.0  # the shared encoder held near where each item update began, in units of S + N (see _ssp_penalties)
    )
    residual_penalty: float = 3.0  # the per-item residual's penalty, in units of S + N (see _ssp_penalties)
    budget_account: str | None = (
        None  # None: the data source's account in the registry (privacy.lifetime_budget), found by content
    )
    account_cap: float | None = None
    account_window_days: float | None = None

    def __post_init__(self):
        # The dimension, tuned per mode on the validation splits of ml-latest-small and `ssp synth --like
        # movielens`: under user-level noise a small d generalises best for ratings (8); ranking needs
        # more directions to order the popular items, as many as the noise allows (the ML-1M-like data,
        # valid Recall@20 at d 8 / 16 / 32: epsilon 5 0.133 / 0.137 / 0.128, epsilon 10 - / 0.141 /
        # 0.144, epsilon 20 - / 0.151 / 0.162; non-private, test: 0.139 at d 8, 0.205 at 32). Ratings with
        # biases, test RMSE at d 8 / 16 (6,040 users, one seed): epsilon 1 0.9680 / 0.9714, epsilon 5
        # 0.9090 / 0.9072, epsilon 10 (k 1) 0.8991 / 0.8970, epsilon 20 (k 1) 0.8905 / 0.8872 (d 32:
        # 0.8879); 100,000 users x 20 ratings, epsilon 5: 0.9229 / 0.9233.
        if self.dim is None:
            ranking = 32 if self.epsilon >= 10 else 16
            ratings = 16 if self.epsilon >= 5 else 8
            object.__setattr__(
                self, "dim", 32 if self.non_private else ranking if self.protocol == "recall" else ratings
            )
        if self.clip_y is None:
            # A ratings label clip is a bias as well as a bound: centred 1..5 stars reach -2.6, and at
            # clip 1 every item's mean (and bias) was pulled a third of the way to 0. `ssp synth --like
            # movielens`, epsilon 5, valid RMSE at clip 1 / 1.5 / 2: 6,040 users 0.9215 / 0.9125 / 0.9135,
            # 100,000 users x 20 ratings 0.9657 / 0.9575 / 0.9611 (one seed each). Ranking labels are 1.
            object.__setattr__(self, "clip_y", 1.5 if self.protocol == "rmse" else 1.0)
        if self.bias_coordinate is None:
            # The bias coordinate's share of the statistics' budget is k^2 / (1 + k^2): under heavy noise an
            # item's bias is worth more than its embedding, under light noise less. `ssp synth --like
            # movielens`, 6,040 users, one seed, test RMSE at k 0.25 / 1 / 1.5 / 2 / 3: epsilon 1 - / - / - /
            # 0.9680 / 0.9696 (k 4.5: 0.9760), epsilon 5 - / 0.9116 / - / 0.9090 / 0.9105, epsilon 10
            # 0.9078 / 0.8991 / 0.8982 / 0.8991 / -, epsilon 20 0.8948 / 0.8905 / 0.8923 / 0.8933 / -
            # (d 8); at 100,000 users x 20 ratings, epsilon 5, k 4 beat 2 under label clip 1 (0.9613 /
            # 0.9657). So the bias's share, 80% up to epsilon 5, falls to 67% at 10 and 50% at 20 (k =
            # sqrt(20 / epsilon)); without noise k changes nothing (non-private: 0.8588 at k 0.25 and 1).
            rule = (
                min(2.0, math.sqrt(20.0 / self.epsilon)) if 0 < self.epsilon < math.inf else 2.0
            )  # a bad epsilon is refused below, by name
            object.__setattr__(self, "bias_coordinate", rule)
        if self.weight_exponent is None:
            # Ranking: every Recall@20 hit is on a popular item (the top fifth; the other fifths score 0
            # even without noise), so a user's weight is spread evenly over their positives instead of
            # towards rare items (the paper's n_j^-1/4 for ratings). Measured at epsilon 5 on the ML-1M-
            # like data: valid Recall@20 0.1326 against 0.1307 at d 8, 0.1283 against 0.1191 at d 32.
            object.__setattr__(self, "weight_exponent", 0.0 if self.protocol == "recall" else -0.25)
        if self.biases is None:
            # User and item biases for ratings (trainer.solve, stats_core). Ranking can learn item biases
            # (--biases) but gains nothing over its popularity column: `ssp synth --like movielens`,
            # 6,040 users, test (valid) Recall@20 without / with, k 2 or 1 by default / k 0.5: epsilon 5
            # 0.1285 (0.1385) / 0.1248 (0.1377) / 0.1274 (0.1389); epsilon 20 0.1534 (0.1590) / 0.1369
            # (0.1481) / 0.1522 (0.1627), one seed.
            object.__setattr__(
                self,
                "biases",
                self.protocol == "rmse"
                and self.loss == "square"
                and self.item_update in BIASED_UPDATES
                and self.engine in ENGINES
                and engines.supports(self.engine, "biases"),
            )
        if self.biases:
            problems = [
                flag
                for flag, wrong in (
                    ("--loss square", self.loss != "square"),
                    (f"--item-update {' or '.join(BIASED_UPDATES)}", self.item_update not in BIASED_UPDATES),
                )
                if wrong
            ]
            if problems:
                raise UserError(f"--biases needs {', '.join(problems)} (use --no-biases otherwise)")
        if self.outer_steps is None:  # a private run splits its budget over the steps; a non-private one converges
            object.__setattr__(self, "outer_steps", self._default_outer_steps())
        if self.item_update == "item-mean" and self.outer_steps != 1:
            raise UserError(
                "--item-update item-mean releases the same statistics at every step (its users never change): one outer step "
                "(--resamples R averages R copies)"
            )
        if self.lambda_u is None or self.user_prior is None:
            # A user ridge proportional to the user's ratings (weighted-lambda ALS) shrinks a light user's
            # embedding as little as a heavy one's: at 100,000 users x 20 ratings the embedding then hurt
            # (AM-SSP at epsilon 5: 0.9514, biases alone 0.9495). Test RMSE with those runs' item vectors
            # held, for the user ridge 0.1 n (the old default) / 20 / 0.03 n + 20 (n: the user's ratings):
            # 100,000 users, epsilon 5 0.9514 / 0.9241, non-private 0.9628 / 0.9190 (0.1 n + 20: 0.9183);
            # 6,040 users, epsilon 5 0.9106 / 0.9092 / 0.9099, non-private 0.8596 / 0.8565 / 0.8570.
            rated = self.biases and self.protocol == "rmse"  # measured on ratings; ranking keeps its user ridge
            if self.lambda_u is None:
                object.__setattr__(self, "lambda_u", 0.01 if rated else user_solves.DEFAULT_LAMBDA_U)
            if self.user_prior is None:
                object.__setattr__(self, "user_prior", 20.0 if rated else 0.0)
        if (
            self.item_id_feature is None
        ):  # the per-item residual, held at the features by its penalty until the data outweighs the noise
            object.__setattr__(self, "item_id_feature", True)
        if self.gravity is None:  # the logistic loss has its negatives in its statistics
            object.__setattr__(self, "gravity", 0.1 if self.protocol == "recall" and self.loss == "square" else 0.0)
        if self.fold_in_gravity is None:
            # A user folded in to be ranked for (evaluation, `ssp recommend`, the served model) is scored
            # against every catalog item, so the penalty on unobserved items' scores weighs more there than
            # in the training users' solves, which only feed the statistics. `ssp synth --like movielens`,
            # 6,040 users, the same trained items refolded, valid (test) Recall@20 at fold-in gravity 0.1 / 1:
            # epsilon 1 0.1349 (0.1233) / 0.1381 (0.1223) and 0.1320 (0.1225) / 0.1346 (0.1239); epsilon 5
            # 0.1381 (0.1284) / 0.1397 (0.1291) and 0.1395 (0.1269) / 0.1408 (0.1299); epsilon 20 0.1540
            # (0.1498) / 0.1639 (0.1565). Training's users at gravity 1 as well: epsilon 1 0.1284 (0.1159),
            # epsilon 5 0.1327 (0.1230), worse.
            object.__setattr__(self, "fold_in_gravity", FOLD_IN_GRAVITY if self.gravity > 0 else self.gravity)
        if self.train_item_fraction is None:
            # An id embedding of an item outside the top 10% would be fitted to noise alone (the paper's
            # protocol keeps those items out of training). A features encoder scores every catalog item:
            # trained on the top 10% only, it gives the rare items the embedding of a popular item of the
            # same genres, and they crowd the top 20 (measured on `ssp synth --like movielens`, non-private:
            # Recall@20 0.078 against 0.199 when it trains on the whole catalog, where rare items learn
            # to score low from their own statistics and the gravity term).
            object.__setattr__(self, "train_item_fraction", splits.TRAIN_ITEM_FRACTION if self.encoder == "id" else 1.0)
        if self.stats_threshold and self.encoder == "id":
            raise UserError(
                "--stats-threshold needs the features encoder: an id encoder has no embedding for an item outside the statistics"
            )
        if self.protocol not in splits.PROTOCOLS:
            raise UserError(f"--protocol must be one of {splits.PROTOCOLS}, got {self.protocol!r}")
        if self.encoder_init not in ENCODER_INITS:
            raise UserError(f"--encoder-init must be one of {ENCODER_INITS}, got {self.encoder_init!r}")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "logistic":
            problems = [
                flag
                for flag, wrong in (
                    ("--protocol recall", self.protocol != "recall"),
                    ("--item-update ssp, dpsgd or none", self.item_update not in ("ssp", "dpsgd", "none")),
                    ("--gravity 0", self.gravity != 0),
                    ("--weight-exponent 0", self.weight_exponent != 0),
                )
                if wrong
            ]
            if problems:
                raise UserError(f"--loss logistic (SSP-convex on implicit feedback) needs {', '.join(problems)}")
        engines.check_supported(
            self.engine,
            {
                "biases": self.biases,
                "logistic": self.loss == "logistic",
                "no-statistics": self.item_update not in STATS_UPDATES,
                "rounds": self.federated_server != "honest",
            },
        )
        for name in ("federated_dropout", "federated_max_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.federated_server != "honest":
            from pipelines.engines.federated import SERVERS

            if self.federated_server not in SERVERS:
                raise UserError(
                    f"--federated-server must be one of {SERVERS}, with --engine federated; got {self.federated_server!r}"
                )
        if self.item_update not in ITEM_UPDATES:
            raise UserError(f"--item-update must be one of {ITEM_UPDATES}, got {self.item_update!r}")
        if self.item_update == "item-mean" and not self.biases:
            raise UserError("--item-update item-mean is a model of item biases alone: drop --no-biases")
        if self.item_update in ("als", "cmf", "item-mean") and self.encoder != "id":
            raise UserError(
                f"--item-update {self.item_update} solves one free vector per item: use it with --encoder id"
            )
        if None not in (self.rating_min, self.rating_max) and not self.rating_min < self.rating_max:
            raise UserError(f"rating range must have min < max, got [{self.rating_min}, {self.rating_max}]")
        if (
            isinstance(self.holdout, bool)
            or not isinstance(self.holdout, (int, float))
            or not 0.0 <= self.holdout < 1.0
        ):
            raise UserError(
                f"--holdout must be a number in [0, 1) (the share held out for evaluation; 0 trains on every row), got {self.holdout!r}"
            )
        _check_settings(self)
        self.privacy()  # validates the budget and plan
        release.check_bounds(
            self.settings(), not self.non_private, self.max_items_per_user, self.dpsgd_clip
        )  # before anything is written or spent

    def privacy(self, units: int | None = None) -> release.PrivacySettings:
        """The run's budget plan. An AM-DPSGD run plans its DP-SGD steps over `units`, the DP number
        of users the counts release publishes (pipelines.releases.counts; never the exact number); None
        before that release: its DP-SGD schedule is then release.DPSGD_PENDING."""
        mean_share = self.mean_share if self.protocol == "rmse" else 0.0
        gram_share = self.gram_share if self.gravity > 0 and self.item_update not in ("dpsgd", "none") else 0.0
        dpsgd = None
        if self.item_update == "dpsgd":
            dpsgd = self.dpsgd_schedule(units) if units is not None else release.DPSGD_PENDING
        common = dict(
            delta=self.delta,
            outer_steps=self.outer_steps,
            resamples=self.resamples,
            count_share=self.count_share,
            mean_share=mean_share,
            gram_share=gram_share,
            dpsgd=dpsgd,
        )
        accountant = engines.ENGINES[
            self.engine
        ].accountant  # federated: its Skellam noise is accounted on integer RDP orders
        if accountant is not None:
            common["accountant"] = accountant
        if self.non_private:  # no release leaves the trusted zone: nothing to charge to the data source
            return release.PrivacySettings(noise_multiplier=0.0, **common)
        return release.PrivacySettings(
            epsilon=self.epsilon,
            account=self.budget_account,
            account_cap=self.account_cap,
            account_window_days=self.account_window_days,
            **common,
        )

    @property
    def embedding_dim(self) -> int:
        """d, the embedding's dimension: --dim, or 0 for the per-item mean (biases alone)."""
        return 0 if self.item_update == "item-mean" else self.dim

    @property
    def encoder_dim(self) -> int:
        """What the item encoder outputs and the statistics hold: d, or with biases d + 1 ([v, item bias / c])."""
        return self.embedding_dim + 1 if self.biases else self.embedding_dim

    @property
    def vector_dim(self) -> int:
        """Length of the item and user embeddings a run writes: d, or with biases d + 2 (items [v, b_j, 1],
        users [u, 1, b_u]: the prediction DP mean + u.v + b_j + b_u stays one dot product)."""
        return self.embedding_dim + 2 if self.biases else self.embedding_dim

    def _default_outer_steps(self) -> int:
        """One release of the statistics for AM-SSP on ratings with biases, else two (a non-private run:
        NON_PRIVATE_OUTER_STEPS; the per-item mean: one). Most of what a second step adds is each item's
        bias estimated again under twice the noise variance, and only the last step's estimate is kept: one release
        at the whole budget estimated the biases of the middle of the catalog better than two (the
        ML-1M-like data, 6,040 users, test RMSE at 1 / 2 steps, seeds 101 and 102: epsilon 1 0.9438 /
        0.9537 and 0.9418 / 0.9550 (statistics threshold 1), epsilon 5 0.9034 / 0.9060 and 0.9033 /
        0.9065, epsilon 10 0.8941 / 0.8962, epsilon 20 0.8891 / 0.8880; ml-latest-small, seed 100:
        epsilon 1 0.9502 / 0.9525, epsilon 5 0.9389 / 0.9440, epsilon 20 0.9254 / 0.9310; 100,000
        users x 20 ratings at epsilon 5: 0.9233 / 0.9233). Averaging the two steps' bias estimates
        instead gained a fifth of that (epsilon 1: 0.9514 and 0.9505)."""
        if self.item_update == "item-mean":
            return 1
        if self.non_private:
            return NON_PRIVATE_OUTER_STEPS
        return 1 if self.item_update == "ssp" and self.biases else release.DEFAULT_OUTER_STEPS

    def settings(self) -> StatsSettings:
        confidence = (
            self.protocol == "recall" and self.loss == "square"
        )  # the ranking rows' labels are their confidences (pipelines.releases.mean.centred)
        if self.non_private:  # no noise, no clipping limits, plain sums (the logistic loss keeps its per-user weights)
            return StatsSettings(
                self.encoder_dim,
                math.inf,
                math.inf,
                "example",
                1.0,
                self.weight_exponent,
                self.loss,
                bias=self.bias_of_release,
                confidence=confidence,
            )
        return StatsSettings(
            self.encoder_dim,
            self.clip_u,
            self.clip_y,
            "user",
            self.wbar,
            self.weight_exponent,
            self.loss,
            bias=self.bias_of_release,
            confidence=confidence,
        )

    @property
    def bias_of_release(self) -> float:
        """The statistics' bias coordinate in units of the clip (StatsSettings.bias): 0 without biases."""
        return self.bias_coordinate if self.biases else 0.0

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

        return DPSGDConfig(
            epochs=self.dpsgd_epochs,
            batch_size=min(self.dpsgd_batch_size, units),
            learning_rate=self.dpsgd_learning_rate,
            l2_norm_clip=math.inf if self.non_private else self.dpsgd_clip,
            max_rows_per_user=self.dpsgd_max_rows_per_user,
            unit=self.unit_of_privacy(),
            seed=seed,
            loss=self.loss,
        )

    def dpsgd_schedule(self, units: int) -> tuple[float, int]:
        """(sampling probability, steps) of one outer step's DP-SGD training over `units` units."""
        from trainer import dpsgd

        return dpsgd.schedule(units, self.dpsgd_config(units))


# Every numeric setting's valid range, checked before anything is written or spent: a setting found
# wrong after the first release would strand a run whose budget is partly spent.
_POSITIVE_INTS = (
    "dim",
    "outer_steps",
    "resamples",
    "max_items_per_user",
    "epochs",
    "batch_size",
    "cmf_iterations",
    "dpsgd_batch_size",
    "dpsgd_max_rows_per_user",
    "shards",
)


_NON_NEGATIVE_INTS = ("split_seed", "model_seed")


_POSITIVE_FLOATS = (
    "learning_rate",
    "lambda_u",
    "lambda_bias",
    "bias_coordinate",
    "feature_ridge",
    "dpsgd_epochs",
    "dpsgd_learning_rate",
    "train_item_fraction",
)


_NON_NEGATIVE_FLOATS = (
    "user_prior",
    "ridge",
    "noise_ridge",
    "residual_penalty",
    "anchor",
    "gravity",
    "fold_in_gravity",
    "feature_weight",
    "gram_share",
    "mean_share",
    "stats_threshold",
    "confidence_alpha",
)


_CHOSEN_AT_PREPARE = (
    "positive_threshold",
    "stats_threshold",
    "rating_min",
    "rating_max",
)  # None: the default rule, applied to the DP counts once they are released


_CHOSEN_BY_THE_TRAINER = ("batch_size",)  # None: the trainer's rule, applied to the catalog the statistics cover


_FINITE_FLOATS = ("weight_exponent", "rating_min", "rating_max", "positive_threshold")


def _check_settings(config: TrainConfig) -> None:
    """Refuse any setting outside its range (NaN included), naming the flag."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
        value = getattr(config, name)
        if value is None and name in _CHOSEN_BY_THE_TRAINER:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name in _POSITIVE_INTS else 0):
            raise UserError(
                f"{flag(name)} must be {'a positive' if name in _POSITIVE_INTS else 'a non-negative'} integer, got {value!r}"
            )
    for name in _POSITIVE_FLOATS + _NON_NEGATIVE_FLOATS + _FINITE_FLOATS:
        value = getattr(config, name)
        if value is None and name in _CHOSEN_AT_PREPARE:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{flag(name)} must be a finite number, got {value!r}")
        if name in _POSITIVE_FLOATS and value <= 0 or name in _NON_NEGATIVE_FLOATS and value < 0:
            raise UserError(f"{flag(name)} must be {'> 0' if name in _POSITIVE_FLOATS else '>= 0'}, got {value!r}")
    if config.train_item_fraction > 1:
        raise UserError(
            f"--train-item-fraction is a share of the catalog: it must be <= 1, got {config.train_item_fraction!r}"
        )


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
        raise UserError(f"--config {path} is not {'TOML' if path.endswith('.toml') else 'JSON'} ({exc})") from None
    if isinstance(document, dict) and isinstance(document.get("config"), dict):
        document = document["config"]  # a run's manifest.json
    if not isinstance(document, dict):
        raise UserError(f"--config {path}: expected a table of settings")
    return _typed_settings(f"--config {path}", document)


def _typed_settings(where: str, document: dict) -> dict:
    """`document`'s settings by TrainConfig field, each of its field's type (`where` names the source
    in errors)."""
    kinds = {item.name: item.type for item in fields(TrainConfig)}
    settings = {}
    for key, value in document.items():
        name = key.replace("-", "_")
        if name not in kinds:
            raise UserError(f"{where}: unknown setting {key!r} (the settings are `ssp train`'s flags)")
        kind = kinds[name] if isinstance(kinds[name], str) else kinds[name].__name__
        wanted = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[kind.split(" ")[0]]
        if (
            value is None
            and "None" in kind
            or isinstance(value, wanted)
            and not (isinstance(value, bool) and bool not in wanted)
        ):
            settings[name] = float(value) if wanted == (int, float) and value is not None else value
        else:
            raise UserError(f"{where}: {key} must be {kind.replace(' | None', '')}, got {value!r}")
    return settings


def check_recorded(path: str, recorded: dict) -> None:
    """A run manifest's recorded settings: known, of their types and in their ranges, as flags are."""
    settings = _typed_settings(
        path, {key: value for key, value in recorded.items() if key != "unit"}
    )  # unit: recorded by older versions
    try:
        TrainConfig(**{**settings, "out": "-"})
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


def release_units(config: TrainConfig, multiplier: float, averaged: int = 1) -> tuple[float, float]:
    """(S, N) of a stats release: S = wbar Gamma_u^2, the most one user adds to an A_j (wbar when
    nothing is clipped), and N = 2 sqrt(d) z S / sqrt(R), about the spectral norm of the noise in
    A_j (z: the stats noise multiplier; R = `averaged` resamples averaged); 0 without noise."""
    settings = config.settings()
    if config.non_private:
        return settings.wbar, 0.0
    unit = settings.wbar * settings.noise_clips()[0] ** 2
    return unit, multiplier * unit * 2 * math.sqrt(settings.dim) / math.sqrt(averaged)
