"""The sections of a training run's settings: every `ssp train` setting, once, with its help and range.

Each section is a frozen dataclass whose fields are flags (`item_update` is `--item-update`, and
`item-update` in a config file's section). A field's metadata holds its help text, its valid range
or choices, and, for a default of None, the rule that chooses it per mode (applied by
`pipelines.training.settings.resolved`). The CLI flags, the config file's sections and the settings
reference in docs/cli.md are generated from these fields; nothing else describes a setting.

Privacy: settings only; none of them is read from the private data.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields

from pipelines.data import ingest, splits
from pipelines.engines import engine as engines
from pipelines.releases import release
from pipelines.releases.counts import DEFAULT_MAX_ITEMS_PER_USER
from pipelines.releases.stats_core import LOSSES
from schemas.errors import UserError

# SSP2 trainer of the encoder; DP-ALS and DP-CMF closed-form solves (id-only encoder) from the same
# statistics; AM-DPSGD (TF-Privacy DP-SGD on the private rows, no statistics released); item-mean: the DP
# per-item mean; none: the starting point. The last two are baselines an item update must beat.
ITEM_UPDATES = ("ssp", "als", "cmf", "dpsgd", "item-mean", "gram", "none")
ENCODERS = ("features", "id")
ENCODER_INITS = ("principal", "random")  # see trainer.encoder.ItemEncoder.init_principal
NON_PRIVATE_OUTER_STEPS = 10  # a non-private run has no budget to split: enough steps to converge


@dataclass(frozen=True)
class Range:
    """A numeric setting's valid values: an integer at least `low`, or a finite number between
    `low` and `high` (each bound closed unless marked open; None: unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        if self.integer:
            return "a positive integer" if self.low == 1 else "a non-negative integer"
        if self.low is not None and self.high is not None:
            return (
                f"a number in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return "a finite number"

    def check(self, flag: str, value) -> None:
        """Refuse `value` (NaN and booleans included) naming the flag."""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int) or value < self.low:
                raise UserError(f"{flag} must be {self.describe()}, got {value!r}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value!r}")
        low_wrong = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        high_wrong = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if low_wrong or high_wrong:
            raise UserError(f"{flag} must be {self.describe()}, got {value!r}")


POSITIVE_INT = Range(low=1, integer=True)
NON_NEGATIVE_INT = Range(low=0, integer=True)
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
FINITE = Range()
SHARE = Range(low=0, high=1, high_open=True)


def setting(default, help: str, *, rule: str | None = None, valid: Range | None = None, choices=None):
    """A settings field: its default, help text, and (for a default of None) the rule that chooses it;
    `valid`: the range a value must be in (None is always allowed where the default is None)."""
    return field(default=default, metadata={"help": help, "rule": rule, "valid": valid, "choices": choices})


@dataclass(frozen=True)
class Source:
    """The data set, its split and its labels."""

    data: str = setting(
        ingest.BUNDLED,
        "data set folder (written by `ssp ingest` or `ssp synth`) or MovieLens folder; required (`ssp demo` runs on "
        "the "
        "bundled ml-latest-small)",
    )
    protocol: str = setting(
        "rmse",
        "rmse (ratings split per rating, RMSE) or recall (held-out users, Recall@20)",
        choices=splits.PROTOCOLS,
    )
    positive_threshold: float | None = setting(
        None,
        "--protocol recall: labels above it are the positives (implicit feedback keeps every interaction)",
        rule="the top 30% of the rating scale, 3.65 on 0.5..5 stars",
        valid=FINITE,
    )
    confidence_alpha: float = setting(
        1.0,
        "implicit feedback: a (user, item) pair that came n times (plays, clicks) weighs c = (1 + alpha log(1 + n)) / "
        "(1 + alpha log 2) in its user's fit and, within the user's weight budget (the sensitivity unchanged), in the "
        "statistics (Hu, Koren and Volinsky's confidence; c = 1 for one interaction); 0 counts a repeat once",
        valid=NON_NEGATIVE,
    )
    rating_min: float | None = setting(
        None,
        "lowest rating: the DP mean's clipping bound and the predictions' floor",
        rule="the data set's declared rating scale, see `ssp ingest --rating-scale`; 0.5 for data that declares none",
        valid=FINITE,
    )
    rating_max: float | None = setting(
        None,
        "highest rating: the DP mean's other clipping bound and the predictions' ceiling",
        rule="the data set's declared rating scale; 5 for data that declares none",
        valid=FINITE,
    )
    split_seed: int = setting(
        splits.DEFAULT_SEED,
        "seed of the train/valid/test split (the split is per user or per rating by a keyed hash: one user's rows "
        "never "
        "move another's)",
        valid=NON_NEGATIVE_INT,
    )
    holdout: float = setting(splits.DEFAULT_HOLDOUT, splits.HOLDOUT_HELP, valid=SHARE)


@dataclass(frozen=True)
class Budget:
    """The privacy budget and its plan: how it is split between the releases."""

    epsilon: float = setting(
        10.0,
        "target epsilon of the whole run, every release included (user level: what one user's whole history can "
        "change); the noise is calibrated to spend exactly this",
    )
    delta: float = setting(
        1e-5,
        "target delta of the whole run: the chance, beyond epsilon, that the guarantee fails; keep it below 1/(number "
        "of users)",
    )
    non_private: bool = setting(False, "no noise and no clipping: the non-private top line of the same pipeline")
    seed_file: str | None = setting(
        None,
        "a secret noise seed file for a new run; a seed file serves one run's ledger: another run's is refused (to "
        "reproduce a run, copy its folder)",
        rule="RUN/private/seed, from the OS CSPRNG",
    )
    outer_steps: int | None = setting(
        None,
        "outer steps S of alternating minimization (user update, then item update from newly released statistics); "
        "each step is one more release, so more steps mean more noise per release at the same epsilon",
        rule=f"1 for AM-SSP on ratings with biases, whose item biases gain most from one release at the whole budget; "
        f"{release.DEFAULT_OUTER_STEPS} for the other updates; {NON_PRIVATE_OUTER_STEPS} for --non-private, which "
        "has no budget to split; 1 "
        "for --item-update item-mean, whose users never change, and gram, whose items are fixed",
        valid=POSITIVE_INT,
    )
    resamples: int = setting(
        1,
        "independently noised copies R of each statistics release (the paper's SSP1); the budget is split among them",
        valid=POSITIVE_INT,
    )
    count_share: float = setting(
        release.DEFAULT_COUNT_SHARE,
        "share of the run's privacy budget spent on the DP item counts (the weights, the stats threshold and the "
        "encoder's start come from them)",
    )
    mean_share: float = setting(
        release.DEFAULT_MEAN_SHARE,
        "share of the budget spent on the DP mean rating (--protocol rmse: labels are centred by it)",
        valid=NON_NEGATIVE,
    )
    gram_share: float = setting(
        release.DEFAULT_GRAM_SHARE,
        "share of the budget spent on the users' DP Gram matrix (--gravity > 0, implicit feedback)",
        valid=NON_NEGATIVE,
    )
    item_gram_share: float = setting(
        None,
        "share of the budget spent on the DP item Gram (the users' co-occurrences over the top items: "
        "--item-update gram's model)",
        rule="all the budget the counts leave for --item-update gram; 0.5 for a private ranking AM-SSP (the square "
        "loss) with the item id (the start of its statistics); 0 otherwise. With statistics it is released in two "
        "halves, the second on the statistics when the first shows no taste beyond popularity",
        valid=NON_NEGATIVE,
    )
    max_items_per_user: int = setting(
        DEFAULT_MAX_ITEMS_PER_USER,
        "at most this many of a user's items count in the DP item counts (the first release): bounds the counts' "
        "sensitivity to sqrt of this",
        valid=POSITIVE_INT,
    )
    data_source: str | None = setting(
        None,
        "the name of the data source these interactions come from: every run on it, whatever its rows this week, is "
        "charged to its one budget account (named by the operator, who is trusted with it; the same rows under a "
        "second name are refused)",
        rule="the name `ssp ingest --data-source` recorded in the data set; else the interactions' content digest, "
        "a new source whenever the rows change",
    )
    shares_users_with: str | None = setting(
        None,
        "a new data source whose users are (some of) another source's: it shares that source's budget account "
        "(declared at its first run)",
        rule="its own account",
    )
    budget_account: str | None = setting(
        None,
        "where a new budget account of the data source is kept (a JSON file): every release of every run on these "
        "users is charged there, so their lifetime epsilon is composed and capped. A data source (identified by the "
        "content of its interactions, wherever they are stored) has one account, found through the registry "
        "$SSP_BUDGET_ACCOUNTS (default ~/.ssp/budget-accounts); a second one is refused",
        rule="the registry's own",
    )
    account_cap: float | None = setting(
        None,
        "lifetime epsilon cap of a new budget account: a release that would take the users past it is refused",
        rule="no cap, the lifetime epsilon is only reported",
    )
    account_window_days: float | None = setting(
        None,
        "renewal window of a new budget account: releases older than this many days stop counting against its cap",
        rule="none, every release counts forever",
    )


@dataclass(frozen=True)
class Execution:
    """Where the run is written and which engine does its row work."""

    out: str = setting("runs/train", "run directory (local or gs://)")
    engine: str = setting(
        "spark",
        "engine of the run's row work (the prepare stage, the user updates, the stats releases): spark, beam, or "
        "local (this process, no JVM: small logs); or federated: Beam's, with each step's statistics released by "
        "simulated devices (solving their own embeddings) through secure aggregation with distributed Skellam noise "
        "(pipelines.engines.federated; accountant: RDP on integer orders). A log under 2M rows is prepared locally "
        "on any engine",
        choices=tuple(engines.ENGINES),
    )
    shards: int = setting(
        4, "part files per statistics table, the parallelism of the stats job's write", valid=POSITIVE_INT
    )


@dataclass(frozen=True)
class Federated:
    """The federated engine's simulated rounds (--engine federated)."""

    federated_dropout: float = setting(
        0.0,
        "--engine federated: share of clients that drop out of each round after its setup (simulated; their masks "
        "are recovered from their neighbours' Shamir shares)",
        valid=SHARE,
    )
    federated_max_dropout: float = setting(
        0.1,
        "--engine federated: the noise shares are planned for this share of clients missing, and never fewer than a "
        "majority of the clients answering (the consistency check's quorum); a round with more dropouts is refused",
        valid=SHARE,
    )
    federated_server: str = setting(
        "honest",
        "--engine federated: the simulated server, honest, or partition: a malicious server showing holders "
        "different survivor sets to unmask one client (a drill: the consistency check refuses the round, nothing is "
        "published)",
        choices=engines.FEDERATED_SERVERS,
    )


@dataclass(frozen=True)
class Model:
    """The model and its item update."""

    item_update: str = setting(
        "ssp",
        "item update: ssp (AM-SSP: SSP2 trainer of the encoder), als (DP-ALS) or cmf (DP-CMF: public features as "
        "un-noised rows), closed-form solves from the same statistics with --encoder id, or dpsgd (AM-DPSGD: "
        "TF-Privacy DP-SGD on the rows, no statistics; its budget share is the statistics', and it ignores --gravity "
        "in the item update), item-mean (the DP per-item mean: each item's clipped, weighted label sum and count, "
        "noised and shrunk to the DP mean, with --encoder id; the baseline every model must beat), gram (--protocol "
        "recall, --encoder id: the principal directions of one DP release of the item Gram over the top items, "
        "those above its noise), or none (the starting point: the public-feature encoder as initialised, users "
        "fitted to it; no statistics released)",
        choices=ITEM_UPDATES,
    )
    loss: str = setting(
        "square",
        "square (the paper's AM-SSP) or logistic: SSP-convex for implicit feedback (--protocol recall): each step "
        "releases the logistic loss's H_j, g_j around the step's starting item embeddings, every user's positives "
        "against every item as a negative, and the SSP2 trainer descends that quadratic approximation; users are "
        "solved with the same loss (Spark engine)",
        choices=LOSSES,
    )
    encoder: str = setting(
        "features", "features (public feature families + item id) or id (one embedding per item)", choices=ENCODERS
    )
    encoder_init: str = setting(
        "principal",
        "the features encoder's start (and the starting point every item update is held near): principal (the "
        "top-d principal directions of the public feature vectors, items weighted by their DP counts: free "
        "post-processing) or random",
        choices=ENCODER_INITS,
    )
    item_id_feature: bool | None = setting(
        None,
        "the features encoder adds a free per-item residual to what the public features say, held at zero by "
        "--residual-penalty until the item's statistics outweigh the noise",
        rule="on",
    )
    dim: int | None = setting(
        None,
        "embedding dimension d",
        rule="32 for --non-private runs; private: for --protocol rmse 8 below --epsilon 5, 16 from 5; for recall 16 "
        "below --epsilon 10, 32 from 10, or as --dim-from-item-gram raises it",
        valid=POSITIVE_INT,
    )
    dim_from_item_gram: bool | None = setting(
        None,
        "a run whose item update starts from the DP item Gram's directions (--protocol recall) raises d to 32 where "
        "that release keeps at least 64 directions above its noise (enough users for the steps to fit them; "
        "recorded in the run's manifest; post-processing of the release)",
        rule="on unless --dim is given",
    )
    biases: bool | None = setting(
        None,
        "user and item biases: the prediction is DP mean + b_u + b_j + u.v, each user's bias solved with the user's "
        "embedding, each item's fitted with its embedding from the statistics (a constant coordinate appended to the "
        "clipped user vector). With --protocol recall the items' biases only, learned with the gravity; every user's "
        "bias is held at 0",
        rule="on for --protocol rmse with every item update and the square loss; the federated engine has none yet",
    )
    gravity: float | None = setting(
        None,
        "implicit-feedback weight alpha on the users' DP Gram matrix",
        rule="for --protocol recall with the square loss 0.1 (1 for --non-private), else 0",
        valid=NON_NEGATIVE,
    )
    model_seed: int = setting(
        0,
        "seed of the encoder's initialisation and the item trainer's shuffling (not of the noise: that comes from the "
        "secret seed file)",
        valid=NON_NEGATIVE_INT,
    )


@dataclass(frozen=True)
class Users:
    """The user side: each user's solve from their own history (trusted side, no privacy effect)."""

    lambda_u: float | None = setting(
        None,
        "ridge of the user update per rating: u = (sum v v^T + (lambda_u n + --user-prior) I)^-1 sum y v over the "
        "user's n ratings; users are solved privately on the trusted side, so it has no privacy effect",
        rule="0.01 with biases on ratings, else 0.1",
        valid=POSITIVE,
    )
    user_prior: float | None = setting(
        None,
        "the user ridge's fixed part, a prior precision on the embedding in the units of the unit-RMS item vectors: "
        "it weighs most for the users with fewest ratings (trusted side: no privacy effect)",
        rule="20 with biases on ratings, else 0",
        valid=NON_NEGATIVE,
    )
    lambda_bias: float = setting(
        5.0,
        "ridge of each user's bias, a pseudo-count of zero residuals: a user with few ratings keeps a bias near 0 "
        "(trusted side: no privacy effect)",
        valid=POSITIVE,
    )
    fold_in_gravity: float | None = setting(
        None,
        "the gravity alpha of a user folded in to be ranked for (evaluation, ssp recommend, the served model)",
        rule="1 where --gravity > 0, else --gravity",
        valid=NON_NEGATIVE,
    )
    popularity_column: bool = setting(
        True,
        "--protocol recall: a user folded in from their history also gets a coefficient on the items' DP counts (a "
        "public release: no privacy cost), so where the noise leaves the trained directions little signal the "
        "ranking falls back on popularity; ssp recommend does the same",
    )


@dataclass(frozen=True)
class Statistics:
    """What each user adds to the released statistics A_j, b_j, and which items they cover."""

    clip_u: float = setting(
        0.3,
        "Gamma_u: each user embedding is clipped to this L2 norm before it enters the statistics (item embeddings "
        "have unit RMS norm); with --wbar it bounds what one user adds to A_j, and so the noise",
    )
    clip_y: float | None = setting(
        None,
        "Gamma_y: each centred label is clipped to [-Gamma_y, Gamma_y] before it enters b_j; with --clip-u and "
        "--wbar it bounds what one user adds to b_j",
        rule="1.5 for --protocol rmse, in the centred labels' units (a smaller clip pulls every item's mean towards "
        "0); 1 for recall, whose labels are 1",
    )
    wbar: float = setting(
        1.0,
        "bound on each user's weights: their squares sum to wbar^2 over the user's items, so one user moves A by at "
        "most wbar Gamma_u^2 and b by wbar Gamma_y Gamma_u whatever the length of their history",
    )
    weight_exponent: float | None = setting(
        None,
        "exponent e of the user-level weights w = wbar n_j^e / sqrt(sum over the user's items of n^2e), n_j the "
        "item's DP count",
        rule="-0.25, towards rare items, for --protocol rmse; 0, even, for recall",
        valid=FINITE,
    )
    bias_coordinate: float | None = setting(
        None,
        "the constant c appended to each clipped user vector so that the statistics carry each item's bias, in units "
        "of --clip-u: it raises the statistics' sensitivity (and noise) by sqrt(1 + c^2), and gives the item biases "
        "a share c^2 / (1 + c^2) of it",
        rule="min(2, sqrt(20 / epsilon)): 2 up to epsilon 5, where noise blurs the embedding most, 1 at 20",
        valid=POSITIVE,
    )
    train_item_fraction: float | None = setting(
        None,
        "--protocol recall: the statistics cover this share of the catalog, the items with the largest DP counts",
        rule="0.1 for --encoder id, whose rare items would be fitted to noise alone; 1 for features, whose rare items "
        "fall back on their features",
        valid=Range(low=0, high=1, low_open=True),
    )
    stats_threshold: float | None = setting(
        None,
        "the statistics cover the items whose DP count is at least this many times N/S (the count at which an "
        "item's data would match the noise in its A_j); the others keep what their public features say, and no "
        "user's weight is spent on them; 0: every item",
        rule="6 for --item-update ssp with the features encoder when the release's noise-to-signal ratio sqrt(m) "
        "(N/S) / sqrt(total DP count x DP users) exceeds 0.15 with --biases, 0.03 without; 1 otherwise",
        valid=NON_NEGATIVE,
    )


@dataclass(frozen=True)
class SSP:
    """AM-SSP's item trainer (SSP2): its optimiser and the penalties that hold it near its start."""

    epochs: int = setting(
        30,
        "AM-SSP: passes of the item trainer over the released statistics in each item update (post-processing: no "
        "privacy effect)",
        valid=POSITIVE_INT,
    )
    batch_size: int | None = setting(
        None,
        "AM-SSP: items per minibatch of the item trainer",
        rule="the covered catalog over 8, at least 512: about 8 steps an epoch; each step updates every item's "
        "residual, so small batches on a large catalog cost time without gaining accuracy",
        valid=POSITIVE_INT,
    )
    learning_rate: float = setting(0.01, "AM-SSP: Adam learning rate of the item trainer", valid=POSITIVE)
    ridge: float = setting(
        0.1,
        "ridge lambda of the item update in units of the most one user adds to an item's statistics (S): lambda S I "
        "is added to every A_j",
        valid=NON_NEGATIVE,
    )
    noise_ridge: float = setting(
        0.25,
        "extra ridge of the item update in units of the noise's spectral norm (N): noise_ridge N I is added to every "
        "A_j, which keeps the noised A_j positive definite and items with little signal near their start",
        valid=NON_NEGATIVE,
    )
    psd_projection: bool = setting(
        True,
        "project each noised A_j onto the positive semi-definite cone before training on it (free post-processing)",
    )
    anchor: float = setting(
        10.0,
        "how strongly each item update holds the shared features encoder near where it began (its starting point), "
        "in the same units as --residual-penalty: larger keeps the model at its public-feature start when the "
        "statistics are mostly noise",
        valid=NON_NEGATIVE,
    )
    residual_penalty: float | None = setting(
        None,
        "penalty on each item's residual, in units of the most one user adds to an item's statistics plus the "
        "noise's spectral norm: larger keeps rare items at their public features",
        rule="3 for --protocol rmse (10 for --non-private), 0.1 for recall",
        valid=NON_NEGATIVE,
    )


@dataclass(frozen=True)
class CMF:
    """DP-CMF's closed-form solves (--item-update cmf)."""

    feature_weight: float = setting(1.0, "DP-CMF: weight mu of the public feature rows (0: DP-ALS)", valid=NON_NEGATIVE)
    feature_ridge: float = setting(1.0, "DP-CMF: ridge of the feature embeddings", valid=POSITIVE)
    cmf_iterations: int = setting(3, "DP-CMF: alternating item / feature solves in each outer step", valid=POSITIVE_INT)


@dataclass(frozen=True)
class DPSGD:
    """AM-DPSGD's TF-Privacy trainer (--item-update dpsgd)."""

    dpsgd_epochs: float = setting(
        5.0,
        "AM-DPSGD: expected passes over the users in each item update (more epochs: more DP-SGD steps, more noise "
        "per step)",
        valid=POSITIVE,
    )
    dpsgd_batch_size: int = setting(
        64, "AM-DPSGD: expected users per DP-SGD step (rows in a non-private run)", valid=POSITIVE_INT
    )
    dpsgd_learning_rate: float = setting(0.01, "AM-DPSGD: learning rate of DP-SGD", valid=POSITIVE)
    dpsgd_clip: float = setting(1.0, "AM-DPSGD: per-user gradient clip norm")
    dpsgd_max_rows_per_user: int = setting(
        256,
        "AM-DPSGD: at most this many of a user's rows form the user's example, whose gradient is clipped",
        valid=POSITIVE_INT,
    )


SECTIONS: dict[str, type] = {  # a config file's [section] -> its dataclass, in the order the docs list them
    "source": Source,
    "budget": Budget,
    "execution": Execution,
    "model": Model,
    "users": Users,
    "statistics": Statistics,
    "ssp": SSP,
    "cmf": CMF,
    "dpsgd": DPSGD,
    "federated": Federated,
}


@dataclass(frozen=True)
class Flag:
    """One setting: its section, its field, and the type its annotation declares."""

    section: str
    field: object  # dataclasses.Field
    kind: type  # bool, int, float or str
    optional: bool  # None allowed (a default chosen per mode, or none)

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def rule(self) -> str | None:
        """What a default of None means, or None."""
        return self.field.metadata["rule"]

    @property
    def valid(self) -> Range | None:
        return self.field.metadata["valid"]

    @property
    def choices(self) -> tuple | None:
        return self.field.metadata["choices"]


def _flags() -> dict[str, Flag]:
    flags = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for item in fields(cls):
            args = typing.get_args(hints[item.name]) or (hints[item.name],)
            kinds = [kind for kind in args if kind is not type(None)]
            flags[item.name] = Flag(section, item, kinds[0], type(None) in args)
    return flags


FLAGS = _flags()  # every setting by field name, in section order
