"""privacy.ledger: the run's releases against its budget, persisted as a LEDGER table."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from privacy import accounting
from privacy.ledger import BudgetExceededError, Ledger, ReleaseConflictError
from schemas import storage
from schemas.tables import LEDGER

DELTA = 1e-5
COUNTS = dp_accounting.GaussianDpEvent(12.0)
STATS = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(15.0), 2)


def direct_epsilon(events, accountant=rdp_privacy_accountant.RdpAccountant, delta=DELTA):
    a = accountant()
    for event in events:
        a.compose(event)
    return a.get_epsilon(delta)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "run" / "ledger.parquet")


def test_create_record_open_round_trip(path):
    ledger = Ledger.create(path, 1.0, DELTA, multipliers={"counts": 12.0, "stats": 15.0})
    assert ledger.rows == [] and ledger.epsilon_spent() == 0.0
    assert storage.exists(path)
    assert Ledger.open(path).rows == []
    assert ledger.record("counts", COUNTS, "fp-counts") == 0
    assert ledger.record("stats/step-1", STATS, "fp-stats-1") == 1
    opened = Ledger.open(path)
    assert opened.budget == {
        "epsilon": 1.0,
        "delta": DELTA,
        "accountant": "pld",
        "unit": "user",
        "multipliers": {"counts": 12.0, "stats": 15.0},
        "id": ledger.identity,
    }
    assert len(ledger.identity) == 32 and Ledger.create(path + ".other", 1.0, DELTA).identity != ledger.identity
    assert [r["name"] for r in opened.rows] == ["counts", "stats/step-1"]
    assert [r["release"] for r in opened.rows] == [0, 1]
    assert [r["data_fingerprint"] for r in opened.rows] == ["fp-counts", "fp-stats-1"]
    assert [r["noise_multiplier"] for r in opened.rows] == [12.0, 15.0]
    assert all(r["delta"] == DELTA for r in opened.rows)
    assert opened.events() == [COUNTS, STATS]
    assert opened.rows == ledger.rows
    # the stored table has the LEDGER schema and the budget in its metadata
    table = storage.read_table(path)
    assert table.schema.remove_metadata().equals(LEDGER)
    assert json.loads(table.schema.metadata[b"budget"])["epsilon"] == "1.0"


def test_epsilon_spent_matches_dp_accounting(path):
    ledger = Ledger.create(path, 2.0, DELTA, accountant="rdp")
    ledger.record("counts", COUNTS, "a")
    after_counts = ledger.rows[0]["epsilon_spent"]
    assert after_counts == pytest.approx(direct_epsilon([COUNTS]), rel=1e-12)
    ledger.record("stats/step-1", STATS, "b")
    ledger.record("stats/step-2", STATS, "c")
    expected = direct_epsilon([COUNTS, STATS, STATS])
    assert ledger.epsilon_spent() == pytest.approx(expected, rel=1e-12)
    assert Ledger.open(path).epsilon_spent() == pytest.approx(expected, rel=1e-12)
    assert ledger.rows[-1]["epsilon_spent"] == pytest.approx(expected, rel=1e-12)
    # the recorded figure is the same composition, read back instead of computed again
    assert (
        ledger.epsilon_recorded() == ledger.epsilon_spent()
        and Ledger.open(path).epsilon_recorded() == ledger.epsilon_spent()
    )
    assert (
        ledger.record("stats/step-1", STATS, "b") == 1 and ledger.epsilon_recorded() == ledger.epsilon_spent()
    )  # a release made again adds nothing
    assert Ledger.create(path + ".empty", 2.0, DELTA).epsilon_recorded() == 0.0
    # running totals increase
    totals = [r["epsilon_spent"] for r in ledger.rows]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_pld_ledger_uses_pld(path):
    ledger = Ledger.create(path, 2.0, DELTA)  # PLD: the default
    assert ledger.budget["accountant"] == "pld"
    ledger.record("counts", COUNTS, "a")
    ledger.record("stats", STATS, "b")
    ours = direct_epsilon(
        [COUNTS, STATS],
        accountant=lambda: pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=accounting.PLD_DISCRETIZATION
        ),
    )
    assert Ledger.open(path).epsilon_spent() == pytest.approx(ours, rel=1e-9)
    assert Ledger.open(path).epsilon_spent() == pytest.approx(
        direct_epsilon([COUNTS, STATS], accountant=pld_privacy_accountant.PLDAccountant), rel=1e-3
    )


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize(
    "epsilon, plan",
    [(1.0, accounting.stats_plan(3, 2, count_share=0.1)), (10.0, accounting.stats_plan(3, 1, 0.1, 0.05))],
)
def test_full_calibrated_plan_fits_its_budget(path, accountant, epsilon, plan):
    """Every planned release, recorded one at a time, is accepted and the last one spends the
    target (under PLD too, whose floating-point composition depends on grouping: the demo's plan,
    epsilon 10, came out 3e-8 over before both sides composed one canonical form)."""
    z = accounting.calibrate(epsilon, DELTA, plan, accountant)
    ledger = Ledger.create(path, epsilon, DELTA, accountant=accountant, multipliers=z)
    ledger.record("counts", accounting.gaussian_event(z["counts"]), "c")
    if "mean" in z:
        ledger.record("mean", accounting.gaussian_event(z["mean"], 2), "m")
    resamples = plan[-1].events // 6
    for step in range(3):
        for resample in range(resamples):
            ledger.record(f"stats/{step}/{resample}", accounting.gaussian_event(z["stats"], 2), f"s{step}{resample}")
    assert len(ledger.rows) == len(plan) + 3 * resamples - 1
    assert ledger.epsilon_spent() == pytest.approx(epsilon, rel=1e-6) and ledger.epsilon_spent() <= epsilon
    with pytest.raises(BudgetExceededError):
        ledger.record("one-more", accounting.gaussian_event(z["stats"], 2), "x")


def test_record_is_idempotent(path):
    ledger = Ledger.create(path, 1.0, DELTA)
    ledger.record("counts", COUNTS, "fp")
    ledger.record("stats", STATS, "fp2")
    before = storage.read_table(path)
    assert ledger.record("counts", dp_accounting.GaussianDpEvent(12.0), "fp") == 0
    assert ledger.record("stats", STATS, "fp2") == 1
    assert len(ledger.rows) == 2
    assert storage.read_table(path).equals(before)
    # also after reopening (a rerun of the same run)
    reopened = Ledger.open(path)
    assert reopened.record("stats", STATS, "fp2") == 1
    assert len(Ledger.open(path).rows) == 2


def test_record_conflicts(path):
    ledger = Ledger.create(path, 1.0, DELTA)
    ledger.record("counts", COUNTS, "fp")
    before = storage.read_table(path)
    with pytest.raises(ReleaseConflictError, match="counts"):
        ledger.record("counts", COUNTS, "other-fp")
    with pytest.raises(ReleaseConflictError, match="counts"):
        ledger.record("counts", dp_accounting.GaussianDpEvent(13.0), "fp")
    with pytest.raises(ReleaseConflictError):
        ledger.record("counts", dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(12.0), 2), "fp")
    assert issubclass(ReleaseConflictError, ValueError)
    assert len(ledger.rows) == 1
    assert storage.read_table(path).equals(before)


def test_budget_exceeded_leaves_ledger_unchanged(path):
    z = accounting.calibrate(1.0, DELTA, [accounting.Group("one", 1.0, 1)])["one"]
    ledger = Ledger.create(path, 1.0, DELTA)
    ledger.record("first", accounting.gaussian_event(z), "a")  # spends the whole budget
    assert ledger.epsilon_spent() == pytest.approx(1.0, abs=1e-4)
    bytes_before = open(path, "rb").read()  # the ledger is one file, replaced atomically
    table_before = storage.read_table(path)
    rows_before = [dict(r) for r in ledger.rows]
    with pytest.raises(BudgetExceededError, match="second") as info:
        ledger.record("second", dp_accounting.GaussianDpEvent(50.0), "b")
    assert "nothing was released" in str(info.value)
    assert issubclass(BudgetExceededError, ValueError)
    assert ledger.rows == rows_before
    assert open(path, "rb").read() == bytes_before
    assert storage.read_table(path).equals(table_before)
    assert len(Ledger.open(path).rows) == 1
    # the refused name is still free: a release that fits can take it later
    assert ledger.find("second") is None


def test_single_release_over_budget_refused_on_empty_ledger(path):
    ledger = Ledger.create(path, 0.5, DELTA)
    with pytest.raises(BudgetExceededError):
        ledger.record("big", dp_accounting.GaussianDpEvent(1.0), "a")
    assert Ledger.open(path).rows == []


def test_private_ledger_refuses_non_private_event(path):
    ledger = Ledger.create(path, 10.0, DELTA)
    with pytest.raises(BudgetExceededError):
        ledger.record("raw", accounting.gaussian_event(0), "a")
    assert ledger.rows == []


def test_non_private_ledger(path):
    ledger = Ledger.create(path, math.inf, DELTA)
    assert ledger.record("stats", accounting.gaussian_event(0), "fp") == 0
    assert ledger.epsilon_spent() == math.inf
    assert ledger.rows[0]["noise_multiplier"] == 0.0
    opened = Ledger.open(path)
    assert opened.budget["epsilon"] == math.inf
    assert opened.epsilon_spent() == math.inf
    assert opened.events() == [dp_accounting.NonPrivateDpEvent()]
    assert opened.record("stats", accounting.gaussian_event(0), "fp") == 0
    assert opened.record("more", dp_accounting.GaussianDpEvent(1.0), "fp2") == 1


def test_open_or_create(path):
    created = Ledger.open_or_create(path, epsilon=1.0, delta=DELTA, multipliers={"stats": 4.0})
    created.record("counts", COUNTS, "a")
    again = Ledger.open_or_create(path, epsilon=1.0, delta=DELTA, multipliers={"stats": 4.0})
    assert [r["name"] for r in again.rows] == ["counts"]
    for mismatch in (
        dict(epsilon=2.0, delta=DELTA, multipliers={"stats": 4.0}),
        dict(epsilon=1.0, delta=1e-6, multipliers={"stats": 4.0}),
        dict(epsilon=1.0, delta=DELTA, multipliers={"stats": 4.5}),
        dict(epsilon=1.0, delta=DELTA, multipliers={"stats": 4.0}, accountant="rdp"),
        dict(epsilon=1.0, delta=DELTA, multipliers={"stats": 4.0}, unit="example"),
    ):
        with pytest.raises(ValueError, match="one budget"):
            Ledger.open_or_create(path, **mismatch)
    assert len(Ledger.open(path).rows) == 1


def test_open_or_create_non_private(path):
    Ledger.open_or_create(path, epsilon=math.inf, delta=DELTA)
    assert Ledger.open_or_create(path, epsilon=math.inf, delta=DELTA).budget["epsilon"] == math.inf
    with pytest.raises(ValueError):
        Ledger.open_or_create(path, epsilon=1.0, delta=DELTA)


def test_open_or_create_reopens_with_multipliers_none(path):
    created = Ledger.open_or_create(path, epsilon=1.0, delta=DELTA, multipliers=None)
    reopened = Ledger.open_or_create(path, epsilon=1.0, delta=DELTA, multipliers=None)
    assert (
        reopened.identity == created.identity
        and reopened.budget == created.budget
        and created.budget["multipliers"] == {}
    )
    with pytest.raises(ValueError, match="a run keeps one budget"):
        Ledger.open_or_create(path, epsilon=1.0, delta=DELTA, multipliers={"counts": 2.0})


def test_a_settled_plan_gives_its_multipliers_once(path):
    ledger = Ledger.create(path, 5.0, DELTA, multipliers={"counts": 2.0, "item_gram_more": 1.5, "stats": 3.0})
    assert ledger.multipliers == {"counts": 2.0, "item_gram_more": 1.5, "stats": 3.0}
    ledger.settle({"counts": 2.0, "stats": 2.5})
    ledger.settle({"counts": 2.0, "stats": 2.5})  # the same again (a resumed run): nothing changes
    reopened = Ledger.open(path)
    assert reopened.multipliers == {"counts": 2.0, "stats": 2.5}
    assert reopened.budget["multipliers"]["stats"] == 3.0  # the plan stays as planned
    with pytest.raises(ReleaseConflictError, match="already settled"):
        reopened.settle({"counts": 2.0, "stats": 2.4})
    assert (
        Ledger.open_or_create(path, epsilon=5.0, delta=DELTA, multipliers=ledger.budget["multipliers"]).multipliers[
            "stats"
        ]
        == 2.5
    )


def test_next_index(path):
    ledger = Ledger.create(path, 1.0, DELTA)
    assert ledger.next_index("counts") == 0
    ledger.record("counts", COUNTS, "a")
    assert ledger.next_index("counts") == 0
    assert ledger.next_index("stats") == 1


def test_describe_lists_each_release(path):
    ledger = Ledger.create(path, 1.0, DELTA, unit="example")
    ledger.record("counts", COUNTS, "a")
    ledger.record("stats/step-1", STATS, "b")
    text = ledger.describe()
    assert path in text
    assert "epsilon 1, delta 1e-05, example-level, PLD accountant" in text
    lines = text.splitlines()
    counts_line = next(line for line in lines if " counts " in line)
    stats_line = next(line for line in lines if "stats/step-1" in line)
    assert counts_line.split()[0] == "0" and "12" in counts_line
    assert stats_line.split()[0] == "1" and "15" in stats_line
    assert f"{ledger.rows[1]['epsilon_spent']:.4g}" in stats_line
    assert f"epsilon spent: {ledger.epsilon_spent():.4g} of 1" in lines[-1]


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(epsilon=0.0, delta=DELTA), "epsilon"),
        (dict(epsilon=-1.0, delta=DELTA), "epsilon"),
        (dict(epsilon=math.nan, delta=DELTA), "epsilon"),
        (dict(epsilon=1.0, delta=0.0), "delta"),
        (dict(epsilon=1.0, delta=1.0), "delta"),
        (dict(epsilon=1.0, delta=1.5), "delta"),
        (dict(epsilon=math.inf, delta=0.0), "delta"),
        (dict(epsilon=1.0, delta=DELTA, accountant="moments"), "accountant"),
        (dict(epsilon=1.0, delta=DELTA, unit="group"), "unit"),
    ],
)
def test_invalid_budgets_raise(path, kwargs, word):
    with pytest.raises(ValueError, match=word):
        Ledger.create(path, **kwargs)
    assert not storage.exists(path)


def test_open_missing_ledger_raises(path):
    with pytest.raises(FileNotFoundError):
        Ledger.open(path)
