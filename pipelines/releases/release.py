"""Making a DP release: the run's budget and ledger, its secret seed, and the checks before noise.

Every job that releases something (DP counts, stats) goes through `make_release`: the release's
fingerprint (name, parameters, digests of every input) is bound to the seed for its ledger index
(refused if that index was used on something else), then recorded in the ledger (refused past the
budget), and only then computed. The returned index keys the release's noise.

The run's privacy settings fix the budget for the whole run: with a target (epsilon, delta) the
noise multipliers of every planned release are calibrated up front (privacy.accounting); with an
explicit noise multiplier the ledger has no cap and reports what was spent.

Privacy: the seed file lives in the run's private directory (`<run>/private/seed` by default) and
must never be published; the ledger and its fingerprints may be.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelines.base import logs
from pipelines.base.lock import release_lock
from privacy import accounting
from privacy.clipping import check_bound
from privacy.ledger import Ledger
from privacy.lifetime_budget import BudgetAccount, private_registry
from privacy.noise import NOISE_VERSION
from privacy.seeds import SeedFile, SeedReuseError, content_digest_table
from schemas import storage
from schemas.errors import UserError

if TYPE_CHECKING:
    import dp_accounting

DEFAULT_DELTA = 1e-5
# PrivacySettings.dpsgd of an AM-DPSGD run before its DP-SGD schedule is known: the schedule is
# planned over the DP number of users, which the counts release (pipelines.releases.counts) publishes, so
# the ledger is opened with the other groups' multipliers only (they do not depend on it)
DPSGD_PENDING = "planned from the DP counts"


# The budget plan's defaults, one for every command that takes them (`ssp train` and the releasing jobs).
# A run plans the mean only for ratings (--protocol rmse) and the Gram matrices only for implicit
# feedback (--gravity > 0); a releasing job run by hand plans what it is given.
DEFAULT_OUTER_STEPS = 2
DEFAULT_COUNT_SHARE = 0.1
DEFAULT_MEAN_SHARE = 0.05
DEFAULT_GRAM_SHARE = 0.05


@dataclass(frozen=True)
class PrivacySettings:
    """The run's budget: a target (epsilon, delta), or an explicit stats noise multiplier."""

    epsilon: float | None = None
    delta: float = DEFAULT_DELTA
    noise_multiplier: float | None = None
    accountant: str = accounting.DEFAULT_ACCOUNTANT
    outer_steps: int = DEFAULT_OUTER_STEPS
    resamples: int = 1
    count_share: float = DEFAULT_COUNT_SHARE
    mean_share: float = DEFAULT_MEAN_SHARE
    gram_share: float = DEFAULT_GRAM_SHARE
    item_gram_share: float = 0.0
    item_gram_parts: int = 1  # 2: the item Gram's second half is settled after its first (accounting.settle_item_gram)
    dpsgd: tuple[float, int] | str | None = (
        None  # AM-DPSGD: (sampling probability, steps) per outer step, in place of stats releases; or DPSGD_PENDING
    )
    account: str | None = (
        # an explicit path for the data source's budget account (privacy.lifetime_budget), charged with every release
        None
    )
    source: str | None = None  # the data source's name (--data-source): its account in the registry
    digest: str | None = None  # the content digest of its interactions, when already taken (else read here)
    shares_users_with: str | None = None  # the source whose account a newly named one shares
    account_cap: float | None = None  # its lifetime epsilon cap, set when the account is created
    account_window_days: float | None = None  # its renewal window, set when the account is created

    def __post_init__(self):
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise UserError("give either --epsilon (with --delta) or --noise-multiplier")
        if self.epsilon == math.inf:  # would calibrate to no noise at all: say so explicitly instead
            raise UserError(
                "epsilon must be finite (inf would add no noise); for a run without privacy give --noise-multiplier 0 "
                "(ssp train: --non-private)"
            )
        if self.epsilon is not None:
            accounting.check_budget(self.epsilon, self.delta)
        if not 0 < self.delta < 1:
            raise UserError(f"delta must be in (0, 1), got {self.delta}")
        if self.noise_multiplier is not None and (
            not math.isfinite(self.noise_multiplier) or self.noise_multiplier < 0
        ):
            raise UserError(f"noise multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        accounting.make_accountant(self.accountant)
        if self.account_cap is not None and not (math.isfinite(self.account_cap) and self.account_cap > 0):
            raise UserError(f"--account-cap must be a finite epsilon > 0, got {self.account_cap}")
        if self.account_window_days is not None and not (
            math.isfinite(self.account_window_days) and self.account_window_days > 0
        ):
            raise UserError(f"--account-window-days must be a positive number of days, got {self.account_window_days}")
        self.plan()

    def plan(self) -> list[accounting.Group]:
        """The release groups this budget plans (accounting.stats_plan)."""
        return accounting.stats_plan(
            self.outer_steps,
            self.resamples,
            self.count_share,
            self.mean_share,
            self.gram_share,
            self.item_gram_share,
            self.item_gram_parts,
        )

    def multipliers(self) -> dict[str, float]:
        """Per-event noise multipliers of the run's release groups ('counts', 'stats', ...; 'dpsgd'
        in place of 'stats' for an AM-DPSGD run, none while its schedule is DPSGD_PENDING)."""
        plan = self.plan()
        planned = self.dpsgd is not None and self.dpsgd != DPSGD_PENDING
        if self.noise_multiplier is not None:
            names = [group.name for group in plan if not (self.dpsgd and group.name == "stats")] + (
                ["dpsgd"] if planned else []
            )
            return {name: self.noise_multiplier for name in names}
        if self.dpsgd == DPSGD_PENDING:  # the groups calibrate_dpsgd keeps as the AM-SSP plan has them
            return {
                name: value
                for name, value in accounting.calibrate(self.epsilon, self.delta, plan, self.accountant).items()
                if name != "stats"
            }
        if self.dpsgd:
            sampling_probability, steps = self.dpsgd
            return accounting.calibrate_dpsgd(
                self.epsilon,
                self.delta,
                plan,
                outer_steps=self.outer_steps,
                sampling_probability=sampling_probability,
                steps=steps,
                accountant=self.accountant,
            )
        return accounting.calibrate(self.epsilon, self.delta, plan, self.accountant)

    def item_gram_to_stats(self) -> dict[str, float]:
        """The multipliers once the item Gram's second part goes to the statistics (accounting.settle_item_gram)."""
        return accounting.settle_item_gram(self.multipliers(), self.plan(), self.epsilon, self.delta, self.accountant)

    def open_ledger(self, path: str, unit: str, interactions: str | None = None) -> Ledger:
        """The run's ledger at `path`, created with this budget if new (checked if not). A new
        ledger charges the data source's one account (privacy.lifetime_budget: found through the registry
        by `source`, the operator's name, else by the content digest of `interactions`; or the explicit `account`);
        an existing one keeps the account it charges."""
        cap = self.epsilon if self.epsilon is not None else math.inf
        budget = dict(
            epsilon=cap, delta=self.delta, accountant=self.accountant, unit=unit, multipliers=self.multipliers()
        )
        if storage.exists(path):
            ledger = Ledger.open_or_create(path, **budget)
            if self.account is not None and ledger.budget.get("account") != storage.canonical(self.account):
                raise UserError(
                    f"{path}: the run's ledger charges the budget account {ledger.budget.get('account')}, not "
                    f"{self.account}; a run keeps one account"
                )
            held = ledger.account()  # refused when missing or replaced
        else:
            ledger = held = None
            digest = self.digest
            if digest is None and interactions is not None:
                digest = content_digest_table(interactions)
            source = self.source or digest
            if source is not None:
                with release_lock(storage.join(private_registry(), "registry")):  # one registry change at a time
                    held = BudgetAccount.for_source(
                        source,
                        self.account,
                        self.account_cap,
                        self.delta,
                        self.accountant,
                        self.account_window_days,
                        digest=digest,
                        shares_users_with=self.shares_users_with,
                    )
            elif self.account is not None:
                held = BudgetAccount.open_or_create(
                    self.account, self.account_cap, self.delta, self.accountant, self.account_window_days
                )
        if (
            held is not None and self.noise_multiplier == 0 and held.cap is not None
        ):  # before anything is written: the ledger would refuse its first release
            raise UserError(
                "--noise-multiplier 0 (no noise, infinite epsilon) cannot be charged to the capped budget account "
                f"{held.path} "
                f"(cap {held.cap:g}); nothing was released"
            )
        if ledger is not None:
            return ledger
        if held is not None and held.cap is None and not held.document["charges"]:
            logs.log(
                f"budget account {held.path} (the data source's) has no lifetime epsilon cap: its epsilon over every "
                "run is reported, "
                "not capped (give --account-cap when it is made)"
            )
        return Ledger.create(
            path, **budget, account=held.path if held else None, account_id=held.identity if held else None
        )


def check_bounds(settings, noised: bool, max_items_per_user: int = 1, gradient_clip: float = 1.0) -> None:
    """The bounds a run's sensitivity rests on, checked before anything is written or spent:
    the clip norms of `settings` (`clip_u`, `clip_y`) finite when the release is noised (infinite
    ones mean no clipping, for runs without noise only), K (`--max-items-per-user`, the items a user
    adds to the DP counts) a positive integer, the DP-SGD gradient clip finite and > 0."""
    if noised:
        check_bound("--clip-u", settings.clip_u)
        check_bound("--clip-y", settings.clip_y)
    if isinstance(max_items_per_user, bool) or not isinstance(max_items_per_user, int) or max_items_per_user < 1:
        raise UserError(f"--max-items-per-user must be a positive integer, got {max_items_per_user}")
    check_bound("--dpsgd-clip", gradient_clip)


def default_seed_path(ledger_path: str) -> str:
    """`<folder of the ledger>/private/seed`: the run's private directory."""
    folder = ledger_path.rstrip("/").rsplit("/", 1)[0] if "/" in ledger_path else "."
    return storage.join(folder, "private", "seed")


def open_seed_file(seed_file: str | None, ledger_path: str) -> SeedFile:
    """The given seed file, or the run's own (drawn from the OS CSPRNG on first use, written when first bound)."""
    if seed_file is not None:
        return SeedFile.load(seed_file)
    return SeedFile.load_or_new(default_seed_path(ledger_path))


def make_release(
    ledger: Ledger, seed_file: SeedFile, name: str, event: dp_accounting.DpEvent, description: dict
) -> int:
    """Check, record and bind a release; returns its index (see the module docstring).

    Under the ledger's release lock, so that concurrent releases into one ledger get distinct
    indices: the ledger and the seed file are re-read (what other processes recorded counts), a
    ledger missing releases the seed file saw recorded in it is refused, the seed binding of the
    index is checked, the release is recorded (and charged to the budget account) and bound. All
    of it happens before any noise is drawn."""
    account = ledger.budget.get(
        "account"
    )  # shared by every run on the data source: locked too (always after the ledger)
    with release_lock(ledger.path), release_lock(account) if account else contextlib.nullcontext():
        if ledger.rows or storage.exists(ledger.path):
            ledger.reload()  # refuses a ledger deleted, replaced or rolled back while in use
        else:
            ledger.save()
        if storage.exists(seed_file.path):
            seed_file.reload()
        _refuse_lost_releases(
            ledger, seed_file, "(nothing was released)"
        )  # also refuses a seed bound to another ledger
        held = ledger.account()  # refused when missing or replaced
        if held is not None:
            seed_file.witness_account(held.path, len(held.document["charges"]))
        index = ledger.next_index(name)
        fingerprint = seed_file.fingerprint(
            {"name": name, "event": accounting.event_to_json(event), "noise": NOISE_VERSION, **description}
        )
        seed_file.check(index, fingerprint)
        index = ledger.record(name, event, fingerprint)
        seed_file.bind(index, fingerprint, ledger.identity)
        if held is not None:
            held.reload()
            seed_file.witness_account(held.path, len(held.document["charges"]))
    if logs.verbose():  # the accountant's sum is only worth computing when shown
        logs.detail(
            f"release {index} {name}: {accounting.event_to_json(event)}; epsilon spent {ledger.epsilon_spent():.6g} "
            f"of {ledger.budget['epsilon']:g}"
        )
    return index


def check_ledger_complete(ledger: Ledger, seed_path: str) -> None:
    """Refuse a ledger that lacks releases its seed file saw recorded in it (deleted, replaced or
    rolled back): the epsilon it reports would leave them out, and their noise keys would be
    handed out again."""
    if storage.exists(seed_path):
        _refuse_lost_releases(ledger, SeedFile.load(seed_path))


def _refuse_lost_releases(ledger: Ledger, seed_file: SeedFile, note: str = "") -> None:
    """Refuse a ledger that lacks releases the seed file saw recorded in its ledger: the same
    ledger rolled back, or another ledger (the seed's own deleted or replaced)."""
    recorded = {row["release"]: row["data_fingerprint"] for row in ledger.rows}
    bound = next(iter(seed_file.ledgers), ledger.identity)
    if bound != ledger.identity:
        raise SeedReuseError(
            f"the seed file {seed_file.path} is bound to another privacy ledger, which recorded releases "
            f"{seed_file.ledgers[bound]}: "
            f"{ledger.path} was deleted and replaced, or the seed belongs to another run. Those releases still "
            "count; restore the "
            f"ledger or start a new run (no --seed-file) {note}".rstrip()
        )
    lost = seed_file.missing_from(bound, recorded)
    if lost:
        raise UserError(
            f"{ledger.path} does not list releases {lost} that its seed file {seed_file.path} saw recorded in its "
            "ledger: the ledger "
            "was deleted, replaced or rolled back. Those releases still count; restore the ledger or start a new "
            f"run {note}".rstrip()
        )


def check_counts_release(ledger: Ledger, seed_file: SeedFile, counts_path: str, counts_digest: str) -> None:
    """Refuse a counts table that is not a DP counts release recorded in this ledger: the weights'
    sensitivity bound holds only for noised counts (exact counts, with the same schema, would
    make the weights a function of other users' data)."""
    if storage.exists(ledger.path):
        ledger.reload()
    if storage.exists(seed_file.path):
        seed_file.reload()
    recorded = [row["release"] for row in ledger.rows if row["name"] == "counts"]
    if not recorded or seed_file.outputs.get(recorded[0]) != counts_digest:
        raise UserError(
            f"{counts_path} is not the DP counts release recorded in the ledger {ledger.path} (its content is not "
            "what that release "
            "wrote); use the counts released into this run's ledger (`ssp counts` with the same --ledger)"
        )


def add_privacy_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that fix a run's budget, shared by every releasing job."""
    group = parser.add_argument_group("privacy budget (for the whole run)")
    group.add_argument(
        "--epsilon", type=float, help="target epsilon of the whole run (noise is calibrated to spend exactly this)"
    )
    group.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="target delta (default: %(default)g)")
    group.add_argument(
        "--noise-multiplier",
        type=float,
        help="use this noise multiplier instead of calibrating (0: no noise, infinite epsilon, for tests and "
        "non-private top lines)",
    )
    group.add_argument(
        "--accountant",
        choices=accounting.ACCOUNTANTS,
        default=accounting.DEFAULT_ACCOUNTANT,
        help="pld (default: privacy loss distributions, at least as tight as RDP for the plans ssp train makes) or "
        "rdp (as in the paper)",
    )
    group.add_argument(
        "--outer-steps",
        type=int,
        default=DEFAULT_OUTER_STEPS,
        help="outer steps S of alternating minimization the budget covers; "
        "each is one stats release, so more steps mean more noise per release (default: %(default)s, as ssp train)",
    )
    group.add_argument(
        "--resamples",
        type=int,
        default=1,
        help="independently noised copies R of each stats release (SSP1; default: %(default)s)",
    )
    group.add_argument(
        "--count-share",
        type=float,
        default=DEFAULT_COUNT_SHARE,
        help="share of the budget spent on the DP item counts (default: %(default)s)",
    )
    group.add_argument(
        "--mean-share",
        type=float,
        default=DEFAULT_MEAN_SHARE,
        help="share of the budget planned for the DP mean rating of a "
        "regression run; give 0 to a job whose run releases no mean, or that share is left unspent (default: "
        "%(default)s, as ssp train)",
    )
    group.add_argument(
        "--gram-share",
        type=float,
        default=DEFAULT_GRAM_SHARE,
        help="share of the budget planned for the users' DP Gram matrices "
        "of an implicit-feedback run; give 0 to a job whose run releases none, or that share is left unspent "
        "(default: %(default)s, as ssp train)",
    )
    group.add_argument("--ledger", help="the run's privacy ledger (default: <out>/ledger.parquet)")
    group.add_argument(
        "--budget-account",
        help="where a new budget account of the data source is kept (a JSON file): every release is also "
        "charged there, so the users' lifetime epsilon over all runs is composed and capped; a data source has one "
        "account, found "
        "through the registry $SSP_BUDGET_ACCOUNTS (default ~/.ssp/budget-accounts) by the content of its "
        "interactions (default: "
        "the registry's own)",
    )
    group.add_argument(
        "--account-cap", type=float, help="lifetime epsilon cap of a new budget account: a release past it is refused"
    )
    group.add_argument(
        "--account-window-days",
        type=float,
        help="renewal window of a new budget account: releases older than this many days "
        "stop counting against its cap (default: none, they count forever)",
    )
    group.add_argument(
        "--seed-file",
        help="secret noise seed of the run (default: <ledger folder>/private/seed, created from the OS CSPRNG); "
        "a seed file serves the one ledger it first released into (a rerun or resume of that run reproduces its "
        "releases "
        "exactly); another run's ledger, other data or other settings with it are refused",
    )


def privacy_settings(args: argparse.Namespace) -> PrivacySettings:
    return PrivacySettings(
        epsilon=args.epsilon,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        accountant=args.accountant,
        outer_steps=args.outer_steps,
        resamples=args.resamples,
        count_share=args.count_share,
        mean_share=args.mean_share,
        gram_share=args.gram_share,
        account=args.budget_account,
        account_cap=args.account_cap,
        account_window_days=args.account_window_days,
    )
