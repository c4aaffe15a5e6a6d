"""The settings of a training run (`TrainConfig`): its sections, the defaults chosen per mode, and their checks.

`TrainConfig` is made of the sections in `pipelines.training.sections`, where every setting is
declared once with its help and range; a setting is read by its flag's name (`config.epsilon`).
`TrainConfig.create(**settings)` is the one way to make one: it fills the settings left None by
their mode's rule (`resolved`, a pure function) and refuses anything out of range (`checked`) before
anything is written or spent. A run's recorded settings go through the same (`check_recorded`): a
setting found wrong after the first release would strand a run whose budget is partly spent. A
config file (`read_config`) holds the settings by section (`[budget] epsilon = 5`) or flat.

Privacy: settings only; none of them is read from the private data.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from pipelines.data import splits
from pipelines.engines import engine as engines
from pipelines.engines import user_solves
from pipelines.releases import release
from pipelines.releases.stats_core import LOSSES, StatsSettings
from pipelines.training.sections import (
    CMF,
    DPSGD,
    ENCODER_INITS,
    FLAGS,
    ITEM_UPDATES,
    NON_PRIVATE_OUTER_STEPS,
    SECTIONS,
    SSP,
    Budget,
    Execution,
    Federated,
    Model,
    Source,
    Statistics,
    Users,
)
from privacy import lifetime_budget
from schemas import storage
from schemas.errors import UserError

STATS_UPDATES = ("ssp", "als", "cmf", "item-mean")  # the item updates that train from released statistics
FIXED_UPDATES = ("gram", "none")  # the items are fixed at the start: no statistics, no item update
BIASED_UPDATES = ("ssp", "als", "cmf", "dpsgd", "item-mean", "none")
FOLD_IN_GRAVITY = 1.0  # implicit feedback: the gravity of a ranked user's fold-in
RANKING_ITEM_GRAM_SHARE = 0.5  # a private ranking AM-SSP's item Gram start, of the whole budget
NON_PRIVATE_RESIDUAL_PENALTY = 10.0  # a non-private ratings run's (docs/results.md#the-non-private-ratings-line)
DIM_32_FROM_KEPT = 64  # the item Gram's kept directions from which a run that starts from it takes d 32 or more
NON_PRIVATE_GRAVITY = 1.0  # a non-private ranking run's training gravity (implicit ALS's weight of an unobserved item)
ENGINES = tuple(engines.ENGINES)
STAGES = ("all", "prepare")  # `ssp train --stage`: the later stages have their own commands
__all__ = ["ENCODER_INITS", "ITEM_UPDATES", "LOSSES", "NON_PRIVATE_OUTER_STEPS", "TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run (a resumed run must be started with the same), by section.

    Make one with `TrainConfig.create(**settings)`; read a setting by its flag's name."""

    source: Source = field(default_factory=Source)
    budget: Budget = field(default_factory=Budget)
    execution: Execution = field(default_factory=Execution)
    model: Model = field(default_factory=Model)
    users: Users = field(default_factory=Users)
    statistics: Statistics = field(default_factory=Statistics)
    ssp: SSP = field(default_factory=SSP)
    cmf: CMF = field(default_factory=CMF)
    dpsgd: DPSGD = field(default_factory=DPSGD)
    federated: Federated = field(default_factory=Federated)

    @classmethod
    def create(cls, **settings) -> TrainConfig:
        """The run's settings from `settings` (by flag name; the rest at their defaults), each left
        None chosen by its mode's rule, all checked."""
        return checked(resolved(cls().with_settings(**settings)))

    def __getattr__(self, name: str):
        flag = FLAGS.get(name)
        section = self.__dict__.get(flag.section) if flag is not None else None
        if section is None:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}")
        return getattr(section, name)

    def with_settings(self, **settings) -> TrainConfig:
        """These settings changed, as given: nothing resolved or checked (`replace` does both)."""
        unknown = sorted(set(settings) - set(FLAGS))
        if unknown:
            raise TypeError(f"TrainConfig has no setting {unknown[0]!r}")
        changed = {}
        for name, value in settings.items():
            changed.setdefault(FLAGS[name].section, {})[name] = value
        return dataclasses.replace(
            self,
            **{section: dataclasses.replace(getattr(self, section), **values) for section, values in changed.items()},
        )

    def replace(self, **settings) -> TrainConfig:
        """A new run's settings: these changed, the others kept, then resolved and checked as `create` does
        (a setting given as None is chosen by its rule again)."""
        return TrainConfig.create(**{**self.flags(), **settings})

    def flags(self) -> dict:
        """Every setting by its flag's name (what a run's manifest records)."""
        return {name: getattr(self, name) for name in FLAGS}

    def sections(self) -> dict[str, dict]:
        """Every setting that is not None, by config file section (what `toml` writes)."""
        return {
            section: {
                name: value for name, value in dataclasses.asdict(getattr(self, section)).items() if value is not None
            }
            for section in SECTIONS
        }

    def toml(self) -> str:
        """The settings as a config file with one [section] per section, as `read_config` reads it."""
        lines = []
        for section, values in self.sections().items():
            lines += [f"[{section}]"] + [
                f"{name.replace('_', '-')} = {json.dumps(value)}" for name, value in values.items()
            ]
            lines.append("")
        return "\n".join(lines)

    def privacy(self, units: int | None = None) -> release.PrivacySettings:
        """The run's budget plan. An AM-DPSGD run plans its DP-SGD steps over `units`, the DP number
        of users the counts release publishes (pipelines.releases.counts; never the exact number); None
        before that release: its DP-SGD schedule is then release.DPSGD_PENDING."""
        mean_share = self.mean_share if self.protocol == "rmse" else 0.0
        gram_share = self.gram_share if self.gravity > 0 and self.item_update not in ("dpsgd", *FIXED_UPDATES) else 0.0
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
            item_gram_share=self.item_gram_share,
            item_gram_parts=2 if self.item_gram_share > 0 and self.item_update in STATS_UPDATES else 1,
            dpsgd=dpsgd,
        )
        accountant = engines.ENGINES[self.engine].accountant  # federated: Skellam noise, on integer RDP orders
        if accountant is not None:
            common["accountant"] = accountant
        if self.non_private:  # no release leaves the trusted zone: nothing to charge to the data source
            return release.PrivacySettings(noise_multiplier=0.0, **common)
        return release.PrivacySettings(
            epsilon=self.epsilon,
            source=self.data_source,
            shares_users_with=self.shares_users_with,
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


# The rules that choose a setting left None (sections.FLAGS[name].rule says each in words). The
# measurements behind them: docs/results.md#the-defaults-and-their-measurements.


def _dim(config: TrainConfig) -> int:
    """Under user-level noise a small d generalises best for ratings; ranking needs more directions to
    order the popular items, as many as the noise allows."""
    if config.non_private:
        return 32
    if config.protocol == "recall":
        return 32 if config.epsilon >= 10 else 16
    return 16 if config.epsilon >= 5 else 8


def dim_chosen_by_item_gram(config: TrainConfig) -> bool:
    """Whether prepare takes d from the item Gram's release: --dim-from-item-gram where an item update
    trained from statistics starts from the Gram."""
    return bool(config.dim_from_item_gram) and config.item_gram_share > 0 and config.item_update in STATS_UPDATES


def raised_dim(dim: int, kept: int) -> int:
    """d of a run that starts from the item Gram: its rule's `dim`, raised to 32 where the release keeps
    many directions above the noise (docs/results.md#the-dimension-from-the-item-gram)."""
    return max(dim, 32) if kept >= DIM_32_FROM_KEPT else dim


def _bias_coordinate(config: TrainConfig) -> float:
    """The item biases' share of the statistics' budget, k^2 / (1 + k^2), falls as the noise does."""
    return min(2.0, math.sqrt(20.0 / config.epsilon)) if 0 < config.epsilon < math.inf else 2.0  # bad: refused later


def _biases(config: TrainConfig) -> bool:
    """Ratings fit user and item biases; ranking gains nothing over its popularity column."""
    return (
        config.protocol == "rmse"
        and config.loss == "square"
        and config.item_update in BIASED_UPDATES
        and config.engine in ENGINES
        and engines.supports(config.engine, "biases")
    )


def _outer_steps(config: TrainConfig) -> int:
    """One release of the statistics for AM-SSP with biases, which gain most from one release at the
    whole budget (a second step re-estimates every bias under twice the noise variance)."""
    if config.item_update in ("item-mean", "gram"):
        return 1
    if config.non_private:
        return NON_PRIVATE_OUTER_STEPS
    return 1 if config.item_update == "ssp" and config.biases else release.DEFAULT_OUTER_STEPS


def _item_gram_share(config: TrainConfig) -> float:
    """The item Gram's share: all the budget beside the counts for its own model; for a private
    ranking AM-SSP (the square loss) with the item id, RANKING_ITEM_GRAM_SHARE as its start (its taste directions
    are where the statistics begin; docs/results.md#the-item-grams-start); else none (the
    federated engine's clients release statistics only)."""
    if config.item_update == "gram":
        return 1.0 - config.count_share
    ranking_ssp = (
        config.protocol == "recall"
        and config.item_update == "ssp"
        and config.encoder == "features"
        and config.loss == "square"  # SSP-convex's logistic loss was not measured with the start
    )
    if ranking_ssp and config.item_id_feature and not config.non_private and config.engine != "federated":
        return RANKING_ITEM_GRAM_SHARE
    return 0.0


def _gravity(config: TrainConfig) -> float:
    """Implicit feedback (ranking, the square loss): every unobserved item weighs NON_PRIVATE_GRAVITY
    against the observed ones in a non-private run, as implicit ALS weighs them; under noise 0.1
    (the users' Gram is a release: docs/results.md#the-fold-ins-gravity)."""
    if config.protocol != "recall" or config.loss != "square":
        return 0.0
    return NON_PRIVATE_GRAVITY if config.non_private else 0.1


def _residual_penalty(config: TrainConfig) -> float:
    """Ratings hold an item's residual near its features (NON_PRIVATE_RESIDUAL_PENALTY without noise,
    where nothing else shrinks a rare item's fit); a ranked item's residual is its taste beyond its
    features' (docs/results.md#rankings-residual-penalty)."""
    if config.protocol != "rmse":
        return 0.1
    return NON_PRIVATE_RESIDUAL_PENALTY if config.non_private else 3.0


def _rated(config: TrainConfig) -> bool:
    """Ratings with biases: where the user ridge with a fixed part was measured (ranking keeps its own)."""
    return bool(config.biases) and config.protocol == "rmse"


RULES = (  # in the order they are applied: a rule reads the settings chosen before it
    ("dim_from_item_gram", lambda config: config.dim is None),
    ("dim", _dim),
    ("clip_y", lambda config: 1.5 if config.protocol == "rmse" else 1.0),  # a ratings clip is a bias too; labels 1
    ("bias_coordinate", _bias_coordinate),
    ("weight_exponent", lambda config: 0.0 if config.protocol == "recall" else -0.25),  # ranking hits popular items
    ("biases", _biases),
    ("outer_steps", _outer_steps),
    ("lambda_u", lambda config: 0.01 if _rated(config) else user_solves.DEFAULT_LAMBDA_U),
    ("user_prior", lambda config: 20.0 if _rated(config) else 0.0),  # a light user's embedding shrunk the most
    ("item_id_feature", lambda config: True),
    ("item_gram_share", _item_gram_share),
    ("residual_penalty", _residual_penalty),
    ("gravity", _gravity),
    # a ranked user is scored against every item: the unobserved ones weigh more than in training's solves
    ("fold_in_gravity", lambda config: FOLD_IN_GRAVITY if config.gravity > 0 else config.gravity),
    # an id embedding outside the top items would be fitted to noise alone; features fall back on features
    ("train_item_fraction", lambda config: splits.TRAIN_ITEM_FRACTION if config.encoder == "id" else 1.0),
)


def resolved(config: TrainConfig) -> TrainConfig:
    """`config` with every setting left None that has a rule chosen by it; the others as they are."""
    for name, rule in RULES:
        if getattr(config, name) is None:
            config = config.with_settings(**{name: rule(config)})
    return config


def _problems(*conditions: tuple[str, bool]) -> list[str]:
    return [flag for flag, wrong in conditions if wrong]


def checked(config: TrainConfig) -> TrainConfig:
    """`config`, after refusing any setting outside its range or choices (NaN included) and any
    combination the run cannot make, naming the flag; the budget plan and clip bounds included."""
    for name, flag in FLAGS.items():
        value = getattr(config, name)
        if value is None:
            if not flag.optional:
                raise UserError(f"{flag.flag} must be given")
        elif flag.choices is not None and value not in flag.choices:
            raise UserError(f"{flag.flag} must be one of {flag.choices}, got {value!r}")
        elif flag.valid is not None:
            flag.valid.check(flag.flag, value)
    if config.biases:
        problems = _problems(
            ("--loss square", config.loss != "square"),
            (f"--item-update {' or '.join(BIASED_UPDATES)}", config.item_update not in BIASED_UPDATES),
        )
        if problems:
            raise UserError(f"--biases needs {', '.join(problems)} (use --no-biases otherwise)")
    if config.item_update == "item-mean" and config.outer_steps != 1:
        raise UserError(
            "--item-update item-mean releases the same statistics at every step (its users never change): one outer "
            "step (--resamples R averages R copies)"
        )
    if config.stats_threshold and config.encoder == "id":
        raise UserError(
            "--stats-threshold needs the features encoder: an id encoder has no embedding for an item outside the "
            "statistics"
        )
    if config.loss == "logistic":
        problems = _problems(
            ("--protocol recall", config.protocol != "recall"),
            ("--item-update ssp, dpsgd or none", config.item_update not in ("ssp", "dpsgd", "none")),
            ("--gravity 0", config.gravity != 0),
            ("--weight-exponent 0", config.weight_exponent != 0),
        )
        if problems:
            raise UserError(f"--loss logistic (SSP-convex on implicit feedback) needs {', '.join(problems)}")
    engines.check_supported(
        config.engine,
        {
            "biases": config.biases,
            "logistic": config.loss == "logistic",
            "no-statistics": config.item_update not in STATS_UPDATES,
            "rounds": config.federated_server != "honest",
        },
    )
    if config.item_update == "item-mean" and not config.biases:
        raise UserError("--item-update item-mean is a model of item biases alone: drop --no-biases")
    if config.item_update == "gram" and config.protocol != "recall":
        raise UserError("--item-update gram ranks from the users' co-occurrences: use it with --protocol recall")
    if config.item_update == "gram" and not config.item_gram_share > 0:
        raise UserError("--item-update gram needs a positive --item-gram-share (the budget of its one release)")
    if config.item_gram_share > 0 and config.protocol != "recall":
        raise UserError("--item-gram-share releases the users' co-occurrences: use it with --protocol recall")
    if config.item_gram_share > 0 and config.encoder == "features" and not config.item_id_feature:
        raise UserError("--item-gram-share starts the items' residuals from the item Gram: drop --no-item-id-feature")
    if config.item_update in ("als", "cmf", "item-mean", "gram") and config.encoder != "id":
        raise UserError(f"--item-update {config.item_update} solves one free vector per item: use it with --encoder id")
    for name in ("data_source", "shares_users_with"):
        if getattr(config, name) is not None:
            lifetime_budget.check_source_name(FLAGS[name].flag, getattr(config, name))
    if config.shares_users_with is not None and config.shares_users_with == config.data_source:
        raise UserError("--shares-users-with names another data source than --data-source")
    if None not in (config.rating_min, config.rating_max) and not config.rating_min < config.rating_max:
        raise UserError(f"rating range must have min < max, got [{config.rating_min}, {config.rating_max}]")
    plan = config.privacy().plan()  # validates the budget and plan
    if config.item_update in STATS_UPDATES and "stats" not in {group.name for group in plan}:
        raise UserError(
            f"--item-update {config.item_update} trains from released statistics, but the other releases' "
            "shares leave none of the budget for them: lower --item-gram-share or --count-share"
        )
    release.check_bounds(config.settings(), not config.non_private, config.max_items_per_user, config.dpsgd_clip)
    return config


def read_config(path: str) -> dict:
    """The settings in a --config file (TOML, or JSON such as a run's manifest.json, whose "config"
    section holds them), by field name: in [sections] as `TrainConfig.toml` writes them, or flat; an
    unknown setting or section, or a value of the wrong type, is refused naming the file and the setting."""
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
    flat = {}
    for key, value in document.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"--config {path}: [{key}] must be a table of settings")
            wrong = [
                name
                for name in value
                if FLAGS.get(name.replace("-", "_"), None) and FLAGS[name.replace("-", "_")].section != key
            ]
            if wrong:
                raise UserError(
                    f"--config {path}: {wrong[0]} belongs in [{FLAGS[wrong[0].replace('-', '_')].section}], not [{key}]"
                )
            flat.update(value)
        else:
            flat[key] = value
    return _typed_settings(f"--config {path}", flat)


def _typed_settings(where: str, document: dict) -> dict:
    """`document`'s settings by field name, each of its field's type (`where` names the source in errors)."""
    settings = {}
    for key, value in document.items():
        name = key.replace("-", "_")
        flag = FLAGS.get(name)
        if flag is None:
            raise UserError(f"{where}: unknown setting {key!r} (the settings are `ssp train`'s flags)")
        if value is None and flag.optional:
            settings[name] = None
        elif isinstance(value, bool) != (flag.kind is bool) or not isinstance(
            value, (int, float) if flag.kind is float else flag.kind
        ):
            raise UserError(f"{where}: {key} must be {flag.kind.__name__}, got {value!r}")
        else:
            settings[name] = float(value) if flag.kind is float else value
    return settings


def check_recorded(path: str, recorded: dict) -> None:
    """A run manifest's recorded settings: known, of their types and in their ranges, as flags are."""
    settings = _typed_settings(path, {key: value for key, value in recorded.items() if key != "unit"})  # unit: old
    try:
        TrainConfig.create(**{**settings, "out": "-"})
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
