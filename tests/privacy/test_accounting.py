"""privacy.accounting: the run's plan, calibrated multipliers, epsilon of events, event JSON."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from privacy import accounting as acct

DELTA = 1e-5


def direct_epsilon(events, delta=DELTA, accountant=rdp_privacy_accountant.RdpAccountant):
    a = accountant()
    for event in events:
        a.compose(event)
    return a.get_epsilon(delta)


def test_make_accountant():
    assert isinstance(acct.make_accountant("rdp"), rdp_privacy_accountant.RdpAccountant)
    assert isinstance(acct.make_accountant("pld"), pld_privacy_accountant.PLDAccountant)
    assert acct.make_accountant("rdp") is not acct.make_accountant("rdp")  # fresh each time
    with pytest.raises(ValueError, match="accountant"):
        acct.make_accountant("gdp")


def test_calibrate_one_gaussian_rdp_matches_dp_accounting():
    expected = dp_accounting.calibrate_dp_mechanism(
        rdp_privacy_accountant.RdpAccountant, dp_accounting.GaussianDpEvent, 1.0, DELTA
    )
    got = acct.calibrate(1.0, DELTA, [acct.Group("one", 1.0, 1)], accountant="rdp")
    assert set(got) == {"one"}
    assert got["one"] == pytest.approx(expected, abs=1e-5)
    assert got["one"] == pytest.approx(4.045, abs=0.01)
    assert direct_epsilon([dp_accounting.GaussianDpEvent(got["one"])]) == pytest.approx(1.0, abs=1e-4)


def test_calibrate_one_gaussian_pld_matches_dp_accounting():
    expected = dp_accounting.calibrate_dp_mechanism(
        pld_privacy_accountant.PLDAccountant, dp_accounting.GaussianDpEvent, 1.0, DELTA
    )
    got = acct.calibrate(1.0, DELTA, [acct.Group("one", 1.0, 1)], accountant="pld")
    assert got["one"] == pytest.approx(expected, abs=1e-4)
    assert got["one"] == pytest.approx(3.73, abs=0.01)
    # PLD (the default) is tighter than RDP: less noise for the same budget
    assert acct.calibrate(1.0, DELTA, [acct.Group("one", 1.0, 1)])["one"] == got["one"]
    assert got["one"] < acct.calibrate(1.0, DELTA, [acct.Group("one", 1.0, 1)], accountant="rdp")["one"]


def test_stats_plan_shape():
    plan = acct.stats_plan(3, 2, count_share=0.1)
    assert plan == [acct.Group("counts", 0.1, 1), acct.Group("stats", 0.9, 12)]
    assert acct.stats_plan(5) == [acct.Group("counts", 0.1, 1), acct.Group("stats", 0.9, 10)]


FRESH = {
    "rdp": rdp_privacy_accountant.RdpAccountant,
    "pld": pld_privacy_accountant.PLDAccountant,
}  # dp-accounting's own defaults


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("epsilon", [1.0, 0.3, 8.0])
def test_calibrated_stats_plan_composes_to_the_target(epsilon, accountant):
    plan = acct.stats_plan(3, 2, count_share=0.1)
    z = acct.calibrate(epsilon, DELTA, plan, accountant)
    assert set(z) == {"counts", "stats"}
    events = [
        dp_accounting.GaussianDpEvent(z["counts"]),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z["stats"]), 12),
    ]
    spent = direct_epsilon(
        events, accountant=FRESH[accountant]
    )  # a fresh dp-accounting accountant, its default settings
    assert spent == pytest.approx(epsilon, abs=1e-3 * epsilon)
    ours = acct.epsilon_of(acct.plan_events(z, plan), DELTA, accountant)
    assert ours == pytest.approx(epsilon, rel=1e-5) and ours <= epsilon  # never over the target
    assert spent <= epsilon * (1 + 1e-6)  # PLD on dp-accounting's finer grid: no more than on ours
    # the share relation: counts get 10% of the "1/z^2 budget", stats 90% over 12 events
    assert z["counts"] ** -2 / (12 * z["stats"] ** -2) == pytest.approx(0.1 / 0.9, rel=1e-12)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_more_steps_need_more_noise(accountant):
    one = acct.calibrate(1.0, DELTA, acct.stats_plan(1), accountant)["stats"]
    many = acct.calibrate(1.0, DELTA, acct.stats_plan(8), accountant)["stats"]
    assert many > one * 1.5


def test_multipliers_for_relation():
    plan = acct.stats_plan(3, 2, count_share=0.1)
    z = acct.multipliers_for(2.0, plan)
    assert z["counts"] == pytest.approx(2.0 * math.sqrt(1 / 0.1), rel=1e-15)
    assert z["stats"] == pytest.approx(2.0 * math.sqrt(12 / 0.9), rel=1e-15)
    # Gaussian composition: sum n_i / z_i^2 = 1 / z^2
    assert 1 / z["counts"] ** 2 + 12 / z["stats"] ** 2 == pytest.approx(1 / 4.0, rel=1e-12)
    three = [acct.Group("a", 0.5, 1), acct.Group("b", 0.25, 4), acct.Group("c", 0.25, 9)]
    assert acct.multipliers_for(1.0, three) == pytest.approx({"a": math.sqrt(2), "b": 4.0, "c": 6.0}, rel=1e-15)


def test_multipliers_for_rejects_shares_not_adding_to_one():
    with pytest.raises(ValueError, match="shares"):
        acct.multipliers_for(1.0, [acct.Group("a", 0.5, 1), acct.Group("b", 0.4, 1)])


def test_infinite_epsilon_gives_zero_multipliers():
    assert acct.calibrate(math.inf, DELTA, acct.stats_plan(3, 2)) == {"counts": 0.0, "stats": 0.0}


@pytest.mark.parametrize("epsilon", [0, 0.0, -1.0, math.nan, -math.inf])
def test_bad_epsilon_raises(epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        acct.calibrate(epsilon, DELTA, acct.stats_plan(1))
    with pytest.raises(ValueError, match="epsilon"):
        acct.check_budget(epsilon, DELTA)


@pytest.mark.parametrize("delta", [0, 0.0, 1, 1.0, 1.5, -1e-5, math.nan])
def test_bad_delta_raises(delta):
    with pytest.raises(ValueError, match="delta"):
        acct.calibrate(1.0, delta, acct.stats_plan(1))
    with pytest.raises(ValueError, match="delta"):
        acct.check_budget(1.0, delta)


def test_check_budget_accepts_valid():
    acct.check_budget(1, 1e-5)
    acct.check_budget(0.01, 0.5)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(outer_steps=0), "outer steps"),
        (dict(outer_steps=-2), "outer steps"),
        (dict(outer_steps=1.5), "outer steps"),
        (dict(outer_steps=2, resamples=0), "resamples"),
        (dict(outer_steps=2, count_share=0.0), "count share"),
        (dict(outer_steps=2, count_share=1.0), "count share"),
        (dict(outer_steps=2, count_share=-0.1), "count share"),
        (dict(outer_steps=2, count_share=math.nan), "count share"),
    ],
)
def test_bad_plan_raises(kwargs, word):
    with pytest.raises(ValueError, match=word):
        acct.stats_plan(**kwargs)


def test_gaussian_event():
    assert acct.gaussian_event(2.0) == dp_accounting.GaussianDpEvent(2.0)
    assert acct.gaussian_event(2.0, 3) == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3)
    assert acct.gaussian_event(0) == dp_accounting.NonPrivateDpEvent()
    assert acct.gaussian_event(0.0, 5) == dp_accounting.NonPrivateDpEvent()


def test_epsilon_of_matches_dp_accounting():
    events = [
        dp_accounting.GaussianDpEvent(3.0),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(10.0), 4),
    ]
    assert acct.epsilon_of(events, DELTA, accountant="rdp") == pytest.approx(direct_epsilon(events), rel=1e-12)
    pld = acct.epsilon_of(events, DELTA)  # the default
    assert pld == acct.epsilon_of(events, DELTA, accountant="pld")
    assert pld == pytest.approx(
        direct_epsilon(
            events,
            accountant=lambda: pld_privacy_accountant.PLDAccountant(
                value_discretization_interval=acct.PLD_DISCRETIZATION
            ),
        ),
        rel=1e-9,
    )
    assert pld == pytest.approx(
        direct_epsilon(events, accountant=pld_privacy_accountant.PLDAccountant), rel=1e-3
    )  # dp-accounting's finer grid
    assert pld < acct.epsilon_of(events, DELTA, accountant="rdp")
    assert acct.epsilon_of([], DELTA) == 0.0


def test_epsilon_of_non_private_is_inf():
    assert acct.epsilon_of([dp_accounting.NonPrivateDpEvent()], DELTA) == math.inf
    assert acct.epsilon_of([dp_accounting.GaussianDpEvent(5.0), acct.gaussian_event(0)], DELTA) == math.inf
    assert acct.epsilon_of([acct.gaussian_event(0)], DELTA, accountant="pld") == math.inf


NESTED = dp_accounting.ComposedDpEvent(
    [
        dp_accounting.GaussianDpEvent(12.5),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(2.0), dp_accounting.GaussianDpEvent(3.5)]), 6
        ),
        dp_accounting.PoissonSampledDpEvent(
            0.01, dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.1), 100)
        ),
    ]
)


@pytest.mark.parametrize(
    "event",
    [
        dp_accounting.GaussianDpEvent(4.0),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 12),
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(0.9)),
        dp_accounting.NonPrivateDpEvent(),
        dp_accounting.ComposedDpEvent([]),
        NESTED,
    ],
)
def test_event_json_round_trip(event):
    data = acct.event_to_json(event)
    text = json.dumps(data, sort_keys=True)  # plain JSON data
    back = acct.event_from_json(json.loads(text))
    assert back == event
    assert type(back) is type(event)
    assert json.dumps(acct.event_to_json(back), sort_keys=True) == text


def test_event_json_shape():
    assert acct.event_to_json(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3)) == {
        "class": "SelfComposedDpEvent",
        "event": {"class": "GaussianDpEvent", "noise_multiplier": 2.0},
        "count": 3,
    }


def test_round_tripped_nested_event_has_same_epsilon():
    back = acct.event_from_json(json.loads(json.dumps(acct.event_to_json(NESTED))))
    assert direct_epsilon([back]) == pytest.approx(direct_epsilon([NESTED]), rel=1e-12)


def test_dpsgd_event_matches_tf_privacy_statement():
    """The DP-SGD event the ledger will record gives the epsilon TF-Privacy states for the same
    parameters (Poisson sampling line), within 5%."""
    import re

    from tensorflow_privacy.privacy.analysis.compute_dp_sgd_privacy_lib import compute_dp_sgd_privacy_statement

    for units, batch, epochs, z in ((10_000, 100, 5, 1.1), (60_000, 256, 3, 0.9), (610, 64, 10, 2.0)):
        q, steps = acct.dpsgd_schedule(units, batch, epochs)
        ours = acct.epsilon_of([acct.dpsgd_event(z, q, steps)], 1e-5, accountant="rdp")  # TF-Privacy states RDP
        statement = compute_dp_sgd_privacy_statement(
            number_of_examples=units,
            batch_size=batch,
            num_epochs=epochs,
            noise_multiplier=z,
            delta=1e-5,
            used_microbatching=False,
        )
        theirs = float(re.search(r"Poisson sampling \(\*\):\s+([0-9.]+)", statement).group(1))
        assert ours == pytest.approx(theirs, rel=0.05), (units, batch, epochs, z, ours, theirs)


def test_dpsgd_schedule_and_bad_parameters():
    assert acct.dpsgd_schedule(1000, 100, 2.5) == (0.1, 25)
    with pytest.raises(ValueError, match="batch size"):
        acct.dpsgd_schedule(10, 20, 1)
    with pytest.raises(ValueError, match="sampling probability"):
        acct.dpsgd_event(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        acct.dpsgd_event(1.0, 0.5, 0)


def test_dpsgd_calibration_spends_the_budget_and_keeps_the_other_groups():
    plan = acct.stats_plan(3, 1, count_share=0.1, mean_share=0.05)
    ssp = acct.calibrate(5.0, 1e-5, plan)
    multipliers = acct.calibrate_dpsgd(5.0, 1e-5, plan, outer_steps=3, sampling_probability=0.05, steps=200)
    assert set(multipliers) == {"counts", "mean", "dpsgd"}
    assert multipliers["counts"] == ssp["counts"] and multipliers["mean"] == ssp["mean"]
    events = [acct.gaussian_event(multipliers["counts"]), acct.gaussian_event(multipliers["mean"], 2)]
    events += [acct.dpsgd_event(multipliers["dpsgd"], 0.05, 200)] * 3
    assert acct.epsilon_of(events, 1e-5) == pytest.approx(5.0, rel=1e-3)
    # more steps at the same budget need more noise
    assert (
        acct.calibrate_dpsgd(5.0, 1e-5, plan, outer_steps=3, sampling_probability=0.05, steps=400)["dpsgd"]
        > multipliers["dpsgd"]
    )


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_item_grams_second_part_settled_on_the_statistics_spends_the_same_budget(accountant):
    """Either way the second half of the item Gram's share goes, the run spends its epsilon: as a
    second Gram release (the plan's multipliers) or in the statistics' four events (recalibrated,
    the counts, users' Gram and first item Gram kept)."""
    plan = acct.stats_plan(2, 1, count_share=0.1, gram_share=0.05, item_gram_share=0.5, item_gram_parts=2)
    assert [(group.name, group.share) for group in plan][2:4] == [("item_gram", 0.25), ("item_gram_more", 0.25)]
    planned = acct.calibrate(5.0, 1e-5, plan, accountant)
    settled = acct.settle_item_gram(planned, plan, 5.0, 1e-5, accountant)
    assert set(settled) == {"counts", "gram", "item_gram", "stats"} and settled["stats"] < planned["stats"]
    assert all(settled[name] == planned[name] for name in ("counts", "gram", "item_gram"))

    def spent(multipliers):
        return acct.epsilon_of(
            [acct.gaussian_event(multipliers[group.name], group.events) for group in plan if group.name in multipliers],
            1e-5,
            accountant,
        )

    assert spent(planned) == pytest.approx(5.0, rel=1e-4) and spent(settled) == pytest.approx(5.0, rel=1e-4)
    assert spent(settled) <= 5.0


def test_the_item_grams_second_part_without_a_target_adds_its_gaussian_budget_to_the_statistics():
    plan = acct.stats_plan(2, 1, item_gram_share=0.4, item_gram_parts=2)
    settled = acct.settle_item_gram({group.name: 3.0 for group in plan}, plan, None, 1e-5, "pld")
    assert settled == {
        "counts": 3.0,
        "item_gram": 3.0,
        "stats": pytest.approx(3.0 * math.sqrt(4 / 5)),
    }  # 4/z'^2 = 5/3^2
    assert acct.settle_item_gram({group.name: 0.0 for group in plan}, plan, None, 1e-5, "pld")["stats"] == 0.0


def test_dpsgd_calibration_of_a_non_private_run_is_zero_noise():
    plan = acct.stats_plan(2)
    assert acct.calibrate_dpsgd(math.inf, 1e-5, plan, outer_steps=2, sampling_probability=0.1, steps=10) == {
        "counts": 0.0,
        "dpsgd": 0.0,
    }


def test_canonical_form_is_independent_of_order_and_grouping():
    g, p = (
        dp_accounting.GaussianDpEvent(1.5),
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(0.9)),
    )
    grouped = [
        acct.gaussian_event(3.0),
        dp_accounting.SelfComposedDpEvent(g, 6),
        dp_accounting.SelfComposedDpEvent(p, 20),
    ]
    released = (
        [dp_accounting.SelfComposedDpEvent(p, 10)]
        + [acct.gaussian_event(1.5, 2)] * 3
        + [
            dp_accounting.ComposedDpEvent(
                [dp_accounting.GaussianDpEvent(3.0), dp_accounting.SelfComposedDpEvent(p, 10)]
            )
        ]
    )
    assert (
        acct.canonical(grouped)
        == acct.canonical(released)
        == acct.canonical([dp_accounting.ComposedDpEvent(released[::-1])])
    )
    assert sorted(map(repr, acct.canonical(grouped))) == sorted(
        map(
            repr,
            [
                dp_accounting.GaussianDpEvent(3.0),
                dp_accounting.SelfComposedDpEvent(g, 6),
                dp_accounting.SelfComposedDpEvent(p, 20),
            ],
        )
    )
    assert acct.canonical([dp_accounting.NoOpDpEvent(), g]) == [g]


def release_order(multipliers: dict, outer_steps: int, resamples: int) -> list:
    """The events a run's ledger records, one release at a time, in the order `ssp train` makes them."""
    events = [acct.gaussian_event(multipliers["counts"])]
    if "mean" in multipliers:
        events.append(acct.gaussian_event(multipliers["mean"], 2))
    for _ in range(outer_steps):
        events += [acct.gaussian_event(multipliers["stats"], 2)] * resamples
        if "gram" in multipliers:
            events.append(acct.gaussian_event(multipliers["gram"]))
    return events


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize(
    "epsilon, steps, resamples, mean, gram", [(10.0, 3, 1, 0.05, 0.0), (5.0, 2, 3, 0.05, 0.0), (1.0, 3, 1, 0.0, 0.05)]
)
def test_the_ledgers_release_order_spends_exactly_the_calibrated_plan(
    accountant, epsilon, steps, resamples, mean, gram
):
    """The ledger composes the releases one by one, the plan as groups; PLD in floating point is not
    exactly associative (up to 3e-8 relative on the demo's plan), and the ledger refuses anything
    1e-9 past the budget. Both compose the canonical form: the same epsilon to the last bit."""
    plan = acct.stats_plan(steps, resamples, 0.1, mean, gram)
    multipliers = acct.calibrate(epsilon, DELTA, plan, accountant)
    planned = acct.epsilon_of(acct.plan_events(multipliers, plan), DELTA, accountant)
    released = acct.epsilon_of(release_order(multipliers, steps, resamples), DELTA, accountant)
    assert released == planned and released <= epsilon
    assert released == pytest.approx(epsilon, rel=1e-6)


def shipped_plans(protocol: str, epsilon: float, units: int) -> dict:
    """The distinct budget plans `ssp train` makes (default settings) for each item update."""
    from pipelines.training import settings

    plans = {}
    for item_update in ("ssp", "als", "cmf", "dpsgd"):
        config = settings.TrainConfig.create(
            protocol=protocol,
            epsilon=epsilon,
            item_update=item_update,
            encoder="id" if item_update in ("als", "cmf") else "features",
        )
        privacy = config.privacy(units if item_update == "dpsgd" else None)
        plans.setdefault(repr(privacy), (item_update, privacy))  # ssp, als and cmf share one plan
    return dict(plans.values())


_CALIBRATED: dict = {}


@pytest.fixture
def calibrated_once(monkeypatch):
    """`acct.calibrate` made once per distinct (epsilon, delta, plan, accountant) in this process (it
    is a pure function of them), every later call given a copy: a shipped AM-DPSGD plan calibrates
    the AM-SSP plan of the same budget first (calibrate_dpsgd keeps its other groups), the same plan
    the ssp/als/cmf run calibrates, at every number of units. Only for tests that compare
    calibrations with each other, not ones that check what calibrate_dpsgd does with calibrate's."""
    real = acct.calibrate

    def calibrate(epsilon, delta, plan, accountant=acct.DEFAULT_ACCOUNTANT):
        key = (epsilon, delta, tuple(plan), accountant)
        if key not in _CALIBRATED:
            _CALIBRATED[key] = real(epsilon, delta, plan, accountant)
        return dict(_CALIBRATED[key])

    monkeypatch.setattr(acct, "calibrate", calibrate)


def check_pld_needs_no_more_noise_than_rdp(protocol: str, epsilon: float, units: int) -> None:
    import dataclasses

    for item_update, privacy in shipped_plans(protocol, epsilon, units).items():
        assert privacy.accountant == "pld"  # the default
        pld, rdp = privacy.multipliers(), dataclasses.replace(privacy, accountant="rdp").multipliers()
        assert set(pld) == set(rdp) and all(pld[name] <= rdp[name] for name in pld), (item_update, pld, rdp)


@pytest.mark.slow  # a minute of PLD calibrations: its representative case runs by default (the test below)
@pytest.mark.parametrize("units", [610, 100_000])  # the bundled data's training users; a synthetic set
@pytest.mark.parametrize("epsilon", [1.0, 5.0, 10.0, 20.0])
@pytest.mark.parametrize("protocol", ["rmse", "recall"])
def test_pld_needs_no_more_noise_than_rdp_for_every_plan_ssp_train_ships(protocol, epsilon, units, calibrated_once):
    """PLD is the default only because it is at least as tight as RDP on everything shipped: every
    group's multiplier, for every item update, both protocols, epsilon 1 to 20."""
    check_pld_needs_no_more_noise_than_rdp(protocol, epsilon, units)


def test_pld_needs_no_more_noise_than_rdp_for_every_item_update_on_the_bundled_data(calibrated_once):
    """The sweep above (`-m slow`) at its cheapest point: every item update's plan (ssp, als and cmf
    share one; dpsgd), every group of the rating protocol's plans (counts, mean, stats or dpsgd), at
    epsilon 1 over the bundled data's 610 training users."""
    check_pld_needs_no_more_noise_than_rdp("rmse", 1.0, 610)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrated_dpsgd_plan_composes_to_the_target_with_fresh_dp_accounting(accountant):
    plan = acct.stats_plan(3, 1, count_share=0.1, mean_share=0.05)
    q, steps = acct.dpsgd_schedule(610, 64, 5.0)
    z = acct.calibrate_dpsgd(
        10.0, DELTA, plan, outer_steps=3, sampling_probability=q, steps=steps, accountant=accountant
    )
    events = [acct.gaussian_event(z["counts"]), acct.gaussian_event(z["mean"], 2)] + [
        acct.dpsgd_event(z["dpsgd"], q, steps)
    ] * 3
    # the same mechanism, its 3 outer steps of DP-SGD as one run of 3 x steps steps: a fresh PLD
    # accountant (its fine default grid) then builds the sampled Gaussian's PLD once, not three times
    merged = [
        acct.gaussian_event(z["counts"]),
        acct.gaussian_event(z["mean"], 2),
        acct.dpsgd_event(z["dpsgd"], q, 3 * steps),
    ]
    assert direct_epsilon(merged, accountant=FRESH[accountant]) == pytest.approx(10.0, rel=1e-3)
    assert acct.epsilon_of(events, DELTA, accountant) <= 10.0


def test_pld_falls_back_to_rdp_where_its_grid_would_be_huge():
    """A PLD's grid grows like 1/z^2 (small z: gigabytes); below PLD_MIN_MULTIPLIER the 'pld'
    accountant reports RDP's epsilon (a valid bound), so the largest budget accepted (MAX_EPSILON,
    whose stats z is below it) still calibrates, quickly, and the ledger agrees with the calibration."""
    import time

    started = time.perf_counter()
    plan = acct.stats_plan(1)
    z = acct.calibrate(acct.MAX_EPSILON, DELTA, plan, "pld")
    assert time.perf_counter() - started < 5 and z["stats"] < acct.PLD_MIN_MULTIPLIER
    assert z == pytest.approx(acct.calibrate(acct.MAX_EPSILON, DELTA, plan, "rdp"), rel=1e-5)
    events = [acct.gaussian_event(z["counts"]), acct.gaussian_event(z["stats"], 2)]
    assert acct.epsilon_of(events, DELTA, "pld") == acct.epsilon_of(events, DELTA, "rdp") <= acct.MAX_EPSILON
    tiny = [
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(acct.PLD_MIN_MULTIPLIER / 2)),
        dp_accounting.GaussianDpEvent(5.0),
    ]
    assert acct.epsilon_of(tiny, DELTA, "pld") == acct.epsilon_of(tiny, DELTA, "rdp")
    fine = [dp_accounting.GaussianDpEvent(acct.PLD_MIN_MULTIPLIER * 5)]
    assert acct.epsilon_of(fine, DELTA, "pld") < acct.epsilon_of(fine, DELTA, "rdp")


def test_each_accounting_is_made_once_per_process_and_callers_get_copies(monkeypatch):
    """The memo: the same canonical events (grouped differently) and the same plan are computed
    once, their answers equal to a fresh accountant's; a changed copy leaves the memo as it was, and a
    refusal is not kept."""
    made = {"epsilon_of": 0, "calibrate": 0}
    for name, key in (("_epsilon_of_canonical", "epsilon_of"), ("_calibrate_plan", "calibrate")):
        real = getattr(acct, name)

        def counted(*args, real=real, key=key):
            made[key] += 1
            return real(*args)

        monkeypatch.setattr(acct, name, counted)
    delta = 1.234567e-6  # a delta no other test asks for
    grouped = [acct.gaussian_event(1.7, 3), acct.gaussian_event(2.9)]
    unfolded = [acct.gaussian_event(2.9)] + [acct.gaussian_event(1.7)] * 3
    first = acct.epsilon_of(grouped, delta)
    assert acct.epsilon_of(unfolded, delta) == first and made["epsilon_of"] == 1
    fresh = acct.make_accountant("pld")
    fresh.compose(dp_accounting.ComposedDpEvent(acct.canonical(grouped)))
    assert first == fresh.get_epsilon(delta)
    plan = acct.stats_plan(2, count_share=0.1)
    multipliers = acct.calibrate(3.0, delta, plan, "rdp")
    multipliers["stats"] = 0.0
    again = acct.calibrate(3.0, delta, plan, "rdp")
    assert again["stats"] > 0 and made["calibrate"] == 1
    assert again == dict(acct.calibrate(3.0, delta, list(plan), "rdp"))
    for _ in range(2):
        with pytest.raises(ValueError, match="epsilon must be > 0"):
            acct.calibrate(-1.0, delta, plan)
