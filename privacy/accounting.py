"""Privacy accounting with dp-accounting: the run's plan, noise calibration, epsilon spent.

A run releases the DP item counts with the DP number of users (one Gaussian event), optionally other
small releases, then for each of S outer steps and R resamples one stats table (two Gaussian events,
A and b, with the stats noise multiplier z). The plan gives each release group a share of the budget
and a number of events; `calibrate` finds, with dp-accounting, the multipliers that spend exactly the
target (epsilon, delta) over the whole planned run, before the first release: a group with share s
and n events gets multiplier z_total * sqrt(n / s).

Accountant: PLD by default (at least as tight as RDP for every plan `ssp train` ships), RDP as an
option (the paper's). `canonical` puts any list of events in one form, so the calibration and every
later `epsilon_of` compose exactly the same thing and the ledger's total equals the target to the
last bit; below `PLD_MIN_MULTIPLIER` the 'pld' accountant reports RDP's epsilon (a PLD's grid grows
like 1/z^2). docs/privacy.md ("Accounting, in detail") has the reasons and the figures.

Privacy: the unit (user, or example for a stats release on given, fixed user embeddings) is
carried by the sensitivities the jobs enforce (weights with sum w_i^2 <= wbar^2 per user; one row
per example at example level); these multipliers are noise standard deviation over that
sensitivity.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import attr

from schemas.errors import UserError

if TYPE_CHECKING:
    import dp_accounting
# dp-accounting and scipy.optimize load scipy.signal (0.7 s): imported where used, so that a command
# that accounts nothing (--help, ingest, synth, a refused input) starts fast

ACCOUNTANTS = ("pld", "rdp", "rdp-integer")
DEFAULT_ACCOUNTANT = "pld"
PLD_DISCRETIZATION = 1e-3  # the PLD accountant's value_discretization_interval (dp-accounting's default: 1e-4)
PLD_MIN_MULTIPLIER = 0.2  # below it a PLD is too large to compute (module docstring): RDP's epsilon instead
# 'rdp-integer': RDP on dp-accounting's integer orders only, the domain of the Skellam bound (privacy.skellam)
INTEGER_ORDERS = tuple(range(2, 64)) + (128, 256, 512, 1024)


def make_accountant(kind: str) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant: 'pld' (default), 'rdp', or 'rdp-integer' (RDP on integer
    orders: federated runs, whose Skellam noise is bounded there)."""
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    if kind == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    if kind == "rdp-integer":
        return rdp_privacy_accountant.RdpAccountant(orders=list(INTEGER_ORDERS))
    if kind == "pld":
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    raise UserError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


def canonical(events: list[dp_accounting.DpEvent]) -> list[dp_accounting.DpEvent]:
    """The composition of `events` in one canonical form: compositions and self-compositions
    unfolded into their basic events (a Gaussian, a Poisson-sampled Gaussian, ...), identical ones
    merged into one self-composition, in a fixed order. Composition is commutative, so this is the
    same mechanism; any two lists of the same basic events get the same form whatever their order
    or grouping (a plan's `SelfComposedDpEvent(stats, 2 S R)` and a ledger's S R events of two)."""
    import dp_accounting

    counts: dict[str, list] = {}

    def unfold(event: dp_accounting.DpEvent, times: int) -> None:
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                unfold(inner, times)
        elif isinstance(event, dp_accounting.SelfComposedDpEvent):
            unfold(event.event, times * event.count)
        elif not isinstance(event, dp_accounting.NoOpDpEvent):
            key = json.dumps(event_to_json(event), sort_keys=True)
            counts.setdefault(key, [event, 0])[1] += times

    for event in events:
        unfold(event, 1)
    return [
        event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)
        for _, (event, count) in sorted(counts.items())
    ]


MAX_EPSILON = 100.0  # beyond it the noise is negligible: a "private" run that protects no one


def check_budget(epsilon: float, delta: float) -> None:
    """Reject impossible privacy parameters with a message that says which and why."""
    if not (isinstance(epsilon, (int, float)) and epsilon > 0) or math.isnan(epsilon):
        raise UserError(f"epsilon must be > 0, got {epsilon}")
    if epsilon > MAX_EPSILON:
        raise UserError(
            f"epsilon {epsilon:g} is over {MAX_EPSILON:g}, where the noise no longer protects anyone; for a run "
            "without privacy say so: --non-private (ssp train) or --noise-multiplier 0"
        )
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise UserError(f"delta must be in (0, 1), got {delta}")


def gaussian_event(noise_multiplier: float, count: int = 1) -> dp_accounting.DpEvent:
    """`count` Gaussian releases with the given noise multiplier (0 means no noise: not private)."""
    import dp_accounting

    if noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    return event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)


def dpsgd_event(noise_multiplier: float, sampling_probability: float, steps: int) -> dp_accounting.DpEvent:
    """`steps` DP-SGD steps: each a Gaussian with the noise multiplier on a Poisson sample of the
    units (users or examples) with the given probability; noise multiplier 0 is not private."""
    import dp_accounting

    if not 0 < sampling_probability <= 1:
        raise UserError(f"sampling probability must be in (0, 1], got {sampling_probability}")
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"DP-SGD steps must be a positive integer, got {steps}")
    if noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    step = dp_accounting.PoissonSampledDpEvent(sampling_probability, gaussian_event(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(step, steps)


def dpsgd_schedule(units: int, batch_size: int, epochs: float) -> tuple[float, int]:
    """(sampling probability, steps) of `epochs` passes over `units` in expected batches of
    `batch_size`, as TF-Privacy counts them."""
    if units < 1 or not 1 <= batch_size <= units or epochs <= 0:
        raise UserError(
            f"need 1 <= batch size <= units and epochs > 0, got units={units}, batch size={batch_size}, epochs={epochs}"
        )
    return batch_size / units, int(math.ceil(epochs * units / batch_size))


MEMO_SIZE = 1024  # the accountings a process keeps (a run makes a few dozen distinct ones)
_memo: dict = {}


def _memoized(key: tuple, compute):
    """compute(), made once per process for each key: `calibrate` and `epsilon_of` are pure
    functions of their arguments (canonical events compose to the same epsilon to the last bit),
    and a run asks the same ones many times (its plan's calibration from each stage, the ledger's
    total after each release). The oldest answer goes first once MEMO_SIZE are kept; a failure is
    not kept."""
    if key not in _memo:
        value = compute()
        if len(_memo) >= MEMO_SIZE:
            _memo.pop(next(iter(_memo)))
        _memo[key] = value
    return _memo[key]


def epsilon_of(events: list[dp_accounting.DpEvent], delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Epsilon at `delta` of the composition of `events` (inf if any is not private), composed in
    their `canonical` form."""
    events = canonical(events)
    key = ("epsilon_of", json.dumps([event_to_json(event) for event in events]), delta, accountant)
    return _memoized(key, lambda: _epsilon_of_canonical(events, delta, accountant))


def _epsilon_of_canonical(events: list[dp_accounting.DpEvent], delta: float, accountant: str) -> float:
    import dp_accounting

    if any(isinstance(e, dp_accounting.NonPrivateDpEvent) for e in events):
        return math.inf
    if not events:
        return 0.0
    if accountant == "pld" and min(map(_multiplier, events)) < PLD_MIN_MULTIPLIER:
        accountant = "rdp"
    acc = make_accountant(accountant)
    acc.compose(dp_accounting.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))


def _multiplier(event: dp_accounting.DpEvent) -> float:
    """The noise multiplier of a basic (canonical) event's Gaussian, inf if it has none."""
    import dp_accounting

    while isinstance(event, (dp_accounting.SelfComposedDpEvent, dp_accounting.PoissonSampledDpEvent)):
        event = event.event
    return event.noise_multiplier if isinstance(event, dp_accounting.GaussianDpEvent) else math.inf


def _calibrate(make_event, epsilon: float, delta: float, accountant: str, guess: float, tol: float = 1e-6) -> float:
    """The smallest parameter z (a noise multiplier, to `tol`) whose `make_event(z)` spends at most
    (epsilon, delta), composed as `epsilon_of` composes (so the ledger finds the same epsilon).

    As dp-accounting's `calibrate_dp_mechanism`: a bracket, scipy's brentq, then a step up if the
    root spends a hair too much. The bracket is searched from `guess` by halving and doubling
    (dp-accounting's search starts at its lower endpoint, and a PLD of a tiny multiplier, with its
    huge privacy losses, can take minutes), and every epsilon is computed once."""
    from scipy import optimize

    cache: dict[float, float] = {}

    def gap(z: float) -> float:
        if z not in cache:
            cache[z] = epsilon_of([make_event(z)], delta, accountant) - epsilon
        return cache[z]

    if gap(guess) > 0:  # too little noise: double until enough
        low, high = guess, guess * 2
        for _ in range(60):
            if gap(high) <= 0:
                break
            low, high = high, high * 2
        else:
            raise UserError(f"no noise multiplier up to {high:g} spends at most epsilon {epsilon:g}")
    else:  # enough noise: halve until too little
        low, high = guess / 2, guess
        for _ in range(60):
            if gap(low) > 0:
                break
            low, high = low / 2, low
        else:
            return low  # a vanishing multiplier already fits (epsilon huge)
    root = float(optimize.brentq(gap, low, high, xtol=tol))
    while gap(root) > 0:
        root = min(root + tol, high)
    return root


@dataclass(frozen=True)
class Group:
    """A group of planned releases: `events` Gaussian events sharing `share` of the budget."""

    name: str
    share: float
    events: int


def stats_plan(
    outer_steps: int,
    resamples: int = 1,
    count_share: float = 0.1,
    mean_share: float = 0.0,
    gram_share: float = 0.0,
    item_gram_share: float = 0.0,
    item_gram_parts: int = 1,
) -> list[Group]:
    """The AM-SSP plan: the count release, optionally the DP mean rating (a sum and a count: two
    events), one users' Gram matrix per outer step (the implicit-feedback "gravity") and the item
    Gram, then S x R stats tables of two events (A and b) each with the share left (none when
    nothing is left: a run whose items come from the item Gram alone). With `item_gram_parts` 2 the
    item Gram's share is halved between "item_gram" and "item_gram_more", a second release or, once
    the first is seen, the statistics' (`settle_item_gram`)."""
    for name, value in (("outer steps", outer_steps), ("resamples", resamples)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value}")
    if not 0 < count_share < 1:
        raise UserError(f"count share must be in (0, 1), got {count_share}")
    others = mean_share + gram_share + item_gram_share
    if min(mean_share, gram_share, item_gram_share) < 0 or not others <= 1 - count_share + 1e-12:
        raise UserError(
            f"mean, gram and item gram shares must be >= 0 and fit beside the counts' {count_share}, got "
            f"{mean_share}, {gram_share} and {item_gram_share}"
        )
    plan = [Group("counts", count_share, 1)]
    if mean_share > 0:
        plan.append(Group("mean", mean_share, 2))
    if gram_share > 0:
        plan.append(Group("gram", gram_share, outer_steps))
    if item_gram_parts not in (1, 2):
        raise UserError(f"the item Gram is released in 1 or 2 parts, got {item_gram_parts}")
    if item_gram_share > 0:
        plan.append(Group("item_gram", item_gram_share / item_gram_parts, 1))
        if item_gram_parts == 2:
            plan.append(Group("item_gram_more", item_gram_share / 2, 1))
    stats_share = 1 - count_share - others
    return plan + ([Group("stats", stats_share, 2 * outer_steps * resamples)] if stats_share > 1e-12 else [])


def multipliers_for(total_multiplier: float, plan: list[Group]) -> dict[str, float]:
    """Each group's per-event noise multiplier when the whole plan composes to `total_multiplier`."""
    shares = sum(group.share for group in plan)
    if not math.isclose(shares, 1.0, rel_tol=1e-9):
        raise UserError(f"plan shares must add up to 1, got {shares}")
    return {group.name: total_multiplier * math.sqrt(group.events / group.share) for group in plan}


def plan_events(multipliers: dict[str, float], plan: list[Group]) -> list[dp_accounting.DpEvent]:
    return [gaussian_event(multipliers[group.name], group.events) for group in plan]


def calibrate(
    epsilon: float, delta: float, plan: list[Group], accountant: str = DEFAULT_ACCOUNTANT
) -> dict[str, float]:
    """Per-group noise multipliers that spend (epsilon, delta) over the whole plan.

    The search runs dp-accounting's `calibrate_dp_mechanism` on the composed event of the full
    plan (PLD: from the RDP calibration, which is fast and close); epsilon = inf gives zeros (a
    non-private run).
    """
    if epsilon != math.inf:
        check_budget(epsilon, delta)
    key = ("calibrate", epsilon, delta, tuple(plan), accountant)
    # a copy: callers may change theirs (calibrate_dpsgd does)
    return dict(_memoized(key, lambda: _calibrate_plan(epsilon, delta, plan, accountant)))


def _calibrate_plan(epsilon: float, delta: float, plan: list[Group], accountant: str) -> dict[str, float]:
    """`calibrate` itself, once its budget is checked."""
    import dp_accounting

    if epsilon == math.inf:
        return {group.name: 0.0 for group in plan}
    if accountant.startswith("rdp"):  # fast: dp-accounting's own bracket search
        total = dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(accountant),
            lambda z: dp_accounting.ComposedDpEvent(plan_events(multipliers_for(z, plan), plan)),
            epsilon,
            delta,
        )
        return multipliers_for(float(total), plan)
    make_accountant(accountant)
    guess = calibrate(epsilon, delta, plan, "rdp")
    total = guess[plan[0].name] / multipliers_for(1.0, plan)[plan[0].name]
    return multipliers_for(
        _calibrate(
            lambda z: dp_accounting.ComposedDpEvent(plan_events(multipliers_for(z, plan), plan)),
            epsilon,
            delta,
            accountant,
            total,
        ),
        plan,
    )


def calibrate_dpsgd(
    epsilon: float,
    delta: float,
    plan: list[Group],
    *,
    outer_steps: int,
    sampling_probability: float,
    steps: int,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> dict[str, float]:
    """The plan with its stats releases replaced by DP-SGD training (AM-DPSGD): per outer step,
    `steps` Poisson-sampled Gaussian steps. The other groups (counts, mean, gram) keep the
    multipliers they get in the AM-SSP plan of the same budget (so every method pays the same for
    them), and the DP-SGD multiplier is calibrated with dp-accounting to spend the rest exactly.
    Returns the other groups' multipliers and 'dpsgd' (no 'stats')."""
    import dp_accounting

    multipliers = calibrate(epsilon, delta, plan, accountant)
    fixed = [gaussian_event(multipliers[group.name], group.events) for group in plan if group.name != "stats"]
    del multipliers["stats"]
    if epsilon == math.inf:
        return {**multipliers, "dpsgd": 0.0}
    dpsgd_event(1.0, sampling_probability, steps)  # validates q and steps
    multipliers["dpsgd"] = _calibrate(
        lambda z: dp_accounting.ComposedDpEvent(fixed + [dpsgd_event(z, sampling_probability, steps)] * outer_steps),
        epsilon,
        delta,
        accountant,
        1.0,
    )  # a Poisson-sampled event needs z > 0: a bracket above 0
    return multipliers


def settle_item_gram(
    multipliers: dict[str, float], plan: list[Group], epsilon: float | None, delta: float, accountant: str
) -> dict[str, float]:
    """The plan's multipliers once "item_gram_more" goes to the statistics instead of a second item
    Gram release: the stats multiplier recalibrated with every other group fixed, to spend (epsilon,
    delta) exactly (as `calibrate_dpsgd` does); without a target epsilon (an explicit noise multiplier),
    the Gaussian budgets added, sum of events / z^2 kept. Every event is Gaussian, so the total is the
    same whichever way the second part goes, and the choice may follow the first part's release
    (Gaussian DP's fully adaptive composition)."""
    import dp_accounting

    settled = {name: value for name, value in multipliers.items() if name != "item_gram_more"}
    stats = next(group for group in plan if group.name == "stats")
    more, planned = multipliers["item_gram_more"], multipliers["stats"]
    if more == 0 or planned == 0:  # a non-private run: nothing to move
        return settled
    if epsilon is None:
        settled["stats"] = math.sqrt(stats.events / (stats.events / planned**2 + 1 / more**2))
        return settled
    others = [group for group in plan if group.name not in ("stats", "item_gram_more")]
    fixed = [gaussian_event(settled[group.name], group.events) for group in others]
    settled["stats"] = _calibrate(
        lambda z: dp_accounting.ComposedDpEvent(fixed + [gaussian_event(z, stats.events)]),
        epsilon,
        delta,
        accountant,
        planned,
    )
    return settled


def event_to_json(event: dp_accounting.DpEvent) -> dict:
    """A dp-accounting event as plain JSON data (class name and fields, nested)."""
    import dp_accounting

    fields = {}
    for key in attr.fields_dict(type(event)):
        value = getattr(event, key)
        if isinstance(value, dp_accounting.DpEvent):
            fields[key] = event_to_json(value)
        elif isinstance(value, list):
            fields[key] = [event_to_json(v) if isinstance(v, dp_accounting.DpEvent) else v for v in value]
        else:
            fields[key] = value
    return {"class": type(event).__name__, **fields}


def event_from_json(data: dict) -> dp_accounting.DpEvent:
    """Inverse of `event_to_json`."""
    import dp_accounting

    fields = {}
    for key, value in data.items():
        if key == "class":
            continue
        if isinstance(value, dict) and "class" in value:
            fields[key] = event_from_json(value)
        elif isinstance(value, list):
            fields[key] = [event_from_json(v) if isinstance(v, dict) and "class" in v else v for v in value]
        else:
            fields[key] = value
    return getattr(dp_accounting, data["class"])(**fields)
