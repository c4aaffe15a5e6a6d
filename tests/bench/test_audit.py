"""The privacy audit: its bounds by hand, its test on a known Gaussian, and `ssp audit` end to end.

The audits run in this process, on the test session's Spark (`ssp audit` uses a session that is
already active), `ssp audit` through the `ssp` command's own entry point (ssp.cli.main); only the bad
input, whose exit status and one error line are the process's, runs `ssp` as a process."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bench import audit
from pipelines.base import logs

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")


@pytest.fixture
def in_process(spark):
    """For an audit in this process: the session's Spark active, and the log level that `-q` sets put
    back afterwards."""
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is not None  # else `ssp audit` would start, and stop, a session of its own
    level = logs.LOGGER.level
    yield spark
    logs.LOGGER.setLevel(level)


def ssp_audit(capsys, *args: str) -> tuple[int, str]:
    """`ssp audit ARGS` through the `ssp` command's entry point: (exit status, stdout)."""
    from ssp import cli

    code = cli.main(["audit", *args])
    return code, capsys.readouterr().out


def test_one_run_bound_by_hand():
    # all r guesses right, delta 0: the p-value is q^r, so the bound solves q^r = failure
    q = 0.05 ** (1 / 10)
    assert audit.one_run_epsilon(100, 10, 10, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), abs=1e-9)
    assert audit.one_run_p_value(100, 10, 10, math.log(q / (1 - q)), 0.0) == pytest.approx(0.05)
    # half right is what epsilon 0 gives: no bound
    assert audit.one_run_epsilon(100, 10, 5, 0.0, 0.05) == 0.0
    # with delta, Theorem 5.2's term: P[Bin(r, q) >= v] + 2 m delta max_i P[v > Bin >= v - i] / i, here r = 2, v = 2
    q = 1 / (1 + math.exp(-1.0))
    alpha = max(2 * q * (1 - q), (2 * q * (1 - q) + (1 - q) ** 2) / 2)  # i = 1: P[Bin = 1]; i = 2: P[Bin in {0, 1}] / 2
    assert audit.one_run_p_value(10, 2, 2, 1.0, 1e-3) == pytest.approx(q**2 + 2 * 10 * 1e-3 * alpha)


def test_gaussian_test_finds_a_known_mu():
    rng = np.random.default_rng(0)
    member = rng.random(20000) < 0.5
    expected = np.full((member.size, 4), 0.25)  # mu = |x| / std = 1 / 2
    released = member[:, None] * expected + rng.normal(size=expected.shape)
    scores = audit.llr(released, expected, 1.0)
    # the log-likelihood ratio of N(x, 1) against N(0, 1): (x.y - |x|^2 / 2), by hand for one canary
    assert scores[0] == pytest.approx(released[0] @ expected[0] - 0.125)
    low = audit.gaussian_mu_bound(scores, member, 0.05)
    assert 0.45 < low < 0.5
    # its epsilon sits just below the mechanism's; the one-run bound well below, and above 0
    claimed = audit.gdp_epsilon(0.5, 1e-5, "pld")
    assert 0.8 * claimed < audit.gdp_epsilon(low, 1e-5, "pld") < claimed
    assert 0 < audit.one_run_bound(scores, member, 1e-5, 0.05) < 0.7 * claimed
    # no signal: (almost) no bound
    assert audit.gaussian_mu_bound(rng.normal(size=member.size), member, 0.05) < 0.03


def test_perfect_separation_gives_the_largest_bounds():
    member = np.arange(1000) % 2 == 0
    scores = np.where(member, 1.0, -1.0) + np.linspace(0, 1e-3, 1000)
    assert audit.gaussian_mu_bound(scores, member, 0.01) > 100
    assert audit.one_run_bound(scores, member, 1e-5, 0.05) > 5


def _table(stdout: str) -> dict[str, tuple[float, float]]:
    """{release: (claimed, bound)} of the printed table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 8 and re.match(r"^[\d.]+$|^inf$", cells[1]):
            rows[cells[0]] = (float(cells[1]), float(cells[2].split()[0]))
    return rows


def test_ssp_audit_quick_passes_on_the_product(in_process, capsys, tmp_path, monkeypatch):
    """Every release group of the central plans, on the test session's Spark (the item Gram's sums in
    its Python workers); the audit's budget accounts go to a registry of its own, never the machine's."""
    from privacy import accounting
    from privacy.ledger import Ledger
    from privacy.lifetime_budget import ACCOUNTS_ENV

    machine = tmp_path / "machine-registry"
    monkeypatch.setenv(ACCOUNTS_ENV, str(machine))
    work = tmp_path / "work"
    code, stdout = ssp_audit(
        capsys, "--quick", "--seed", "3", "-q", "--work", str(work), "--products", "ratings,ranking,item-mean,gram"
    )
    assert code == 0, stdout
    rows = _table(stdout)
    assert set(rows) == {
        "ratings: counts",
        "ratings: stats step 1",
        "ratings: counts and stats composed",
        "ratings: seed-file copy, stats step 1",
        f"ratings: mean ({audit.QUICK.trials} releases)",
        "ranking: counts",
        "ranking: stats step 1",
        "ranking: stats step 2",
        "ranking: stats steps 1-2 (difference)",
        "ranking: item gram",
        "ranking: second item gram",  # the plan's second part of the item Gram's share, as a second release
        "ranking: counts, stats, item gram and second item gram composed",
        f"ranking: gram ({audit.QUICK.trials} releases)",
        "item-mean: counts",
        "item-mean: stats step 1",
        "item-mean: counts and stats composed",
        f"item-mean: mean ({audit.QUICK.trials} releases)",
        "gram: counts",
        "gram: item gram",
        "gram: counts and item gram composed",
    }
    assert all(bound <= claimed for claimed, bound in rows.values())
    assert rows["ratings: stats step 1"][1] > 0 and rows["gram: item gram"][1] > 0  # the audit sees the releases
    # the item Gram is the product's release, in its ledger at the plan's multiplier, claimed as one Gaussian
    ledger = Ledger.open(str(work / "gram" / "run" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "item_gram"]
    multiplier = ledger.budget["multipliers"]["item_gram"]
    assert rows["gram: item gram"][0] == pytest.approx(
        accounting.epsilon_of([accounting.gaussian_event(multiplier)], 1e-5, "pld"), abs=0.005
    )
    assert ledger.epsilon_spent() == pytest.approx(4.0, abs=0.01)
    assert "PASS" in stdout and "at most 0.01" in stdout
    assert not machine.exists() and os.environ[ACCOUNTS_ENV] == str(machine)
    assert list((work / "budget-accounts").glob("*.account.json"))


def _cells(stdout: str) -> dict[str, list[str]]:
    """{release: its cells after the name} of the printed table."""
    return {line.split("|")[1].strip(): line.split("|")[2:-1] for line in stdout.splitlines() if line.startswith("| ")}


@pytest.mark.beam
def test_ssp_audit_quick_passes_on_the_federated_product(capsys, tmp_path):
    """The federated round (a Beam pipeline, every user a client), its release in the run's ledger
    as `ssp train --engine federated` makes it; the product has canaries of its own, fewer."""
    from privacy import accounting
    from privacy.ledger import Ledger

    work = tmp_path / "work"
    args = "--quick --seed 3 -q --engine local --trials 20 --products federated".split()
    code, stdout = ssp_audit(capsys, *args, "--work", str(work))
    assert code == 0, stdout
    rows, cells = _table(stdout), _cells(stdout)
    stats = ("stats step 1", "stats step 2", "stats steps 1-2 (difference)")
    assert set(rows) == {
        *(f"federated: {row}" for row in ("counts", *stats, "counts and stats composed", "mean (20 releases)"))
    }
    assert all(bound <= claimed for claimed, bound in rows.values())
    # the Skellam statistics keep their Gaussian bound in the verdict (docs/privacy.md)
    assert all("not in verdict" not in cells[f"federated: {row}"][3] for row in stats)
    assert int(cells["federated: stats step 1"][5]) == audit.QUICK.federated
    # the claim is the run's own: the federated plan's stats event, by its RDP accountant on integer orders
    ledger = Ledger.open(str(work / "federated" / "run" / "ledger.parquet"))
    assert ledger.budget["accountant"] == "rdp-integer"
    assert rows["federated: stats step 1"][0] == pytest.approx(
        accounting.epsilon_of(
            [accounting.gaussian_event(ledger.budget["multipliers"]["stats"], 2)], 1e-5, "rdp-integer"
        ),
        abs=0.005,
    )
    assert ledger.epsilon_spent() == pytest.approx(4.0, abs=0.01)  # the plan spends the budget, no more


@pytest.mark.slow
def test_ssp_audit_quick_passes_on_the_dpsgd_product(capsys, tmp_path):
    """AM-DPSGD's item updates (TensorFlow), each step's DP-SGD release in the run's ledger as
    `ssp train --item-update dpsgd` records it (the in-suite path: test_unnoised_dpsgd_is_found)."""
    from privacy import accounting
    from privacy.ledger import Ledger

    work = tmp_path / "work"
    args = "--quick --seed 3 -q --engine local --trials 20 --products dpsgd".split()
    code, stdout = ssp_audit(capsys, *args, "--work", str(work))
    assert code == 0, stdout
    rows, cells = _table(stdout), _cells(stdout)
    steps = ("dpsgd step 1", "dpsgd step 2")
    assert set(rows) == {
        f"dpsgd: {row}" for row in ("counts", *steps, "counts and dpsgd composed", "mean (20 releases)")
    }
    assert all(bound <= claimed for claimed, bound in rows.values())
    assert all("not in verdict" in cells[f"dpsgd: {row}"][3] for row in steps)  # a Poisson-sampled mixture
    ledger = Ledger.open(str(work / "dpsgd" / "run" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows if row["name"].endswith("/dpsgd")] == ["step-1/dpsgd", "step-2/dpsgd"]
    assert rows["dpsgd: dpsgd step 1"][0] == pytest.approx(
        accounting.epsilon_of([ledger.events()[-1]], 1e-5, ledger.budget["accountant"]), abs=0.005
    )
    assert ledger.epsilon_spent() == pytest.approx(4.0, abs=0.01)


def test_the_audit_follows_the_plan(monkeypatch, tmp_path):
    """A release group the audit cannot score is refused, not skipped."""
    from pipelines.releases.release import PrivacySettings

    planned = PrivacySettings.multipliers
    monkeypatch.setattr(PrivacySettings, "multipliers", lambda self: {**planned(self), "new-release": 1.0})
    with pytest.raises(ValueError, match="no auditor for the release group"):
        audit.audit(audit.QUICK, 4.0, 0.99, engine="local", work=str(tmp_path), seed=3, products=("ratings",))


@pytest.mark.slow
def test_ssp_audit_quick_passes_on_rankings_statistics_alone(capsys, tmp_path):
    """Ranking without the item Gram's start (`--item-gram-share 0`: the federated engine's plan, its
    statistics and the users' Gram) on the local engine."""
    args = "--quick --seed 3 -q --engine local --trials 20 --products ranking-statistics".split()
    code, stdout = ssp_audit(capsys, *args, "--work", str(tmp_path / "work"))
    assert code == 0, stdout
    rows = _table(stdout)
    assert {"ranking-statistics: stats step 2", "ranking-statistics: counts and stats composed"} <= set(rows)
    assert "ranking-statistics: item gram" not in rows
    assert all(bound <= claimed for claimed, bound in rows.values())


def test_item_gram_plants_are_found(tmp_path):
    """The item Gram's noise halved, or its rows left at 1 per item (a covered canary has 2: twice its
    unit-norm entries): each exceeds the claim at --quick. Scaled by 2 at the same noise, or at half
    the noise, the canaries' released entries are one affine image of the other (same seed, same
    noise draws): the two audits find the same bounds."""
    found = {}
    for plant in ("item-gram-noise", "item-gram-norm"):
        table = audit.audit(
            audit.QUICK, 4.0, 0.99, engine="local", work=str(tmp_path / plant), seed=3, plant=plant, products=("gram",)
        )
        found[plant] = {row.release: row for row in table}
        assert {row.release for row in table if row.exceeded} == {"gram: item gram"}
    noise, norm = found["item-gram-noise"]["gram: item gram"], found["item-gram-norm"]["gram: item gram"]
    assert noise.claimed == norm.claimed == pytest.approx(3.76, abs=0.01)
    assert noise.gaussian == pytest.approx(norm.gaussian, rel=1e-6) and noise.one_run == norm.one_run


@pytest.mark.parametrize(
    "plant, products, found",
    [
        ("bias-noise", ("ratings",), {"ratings: stats step 1"}),
        ("embedding-clip", ("ratings",), {"ratings: stats step 1"}),
        ("label-clip", ("ratings",), {"ratings: stats step 1"}),
        ("weights", ("ratings",), {"ratings: stats step 1"}),
        ("halved-noise", ("ranking",), {"ranking: stats step 1"}),
        ("shared-noise", ("ranking",), {"ranking: stats steps 1-2 (difference)"}),
        ("seed-copy", ("ratings",), {"ratings: seed-file copy, stats step 1"}),
    ],
)
def test_planted_defects_are_found(tmp_path, plant, products, found):
    """Each plant on the local engine (the stats job's item tasks in this process, where the plant
    is): the rows that must see it exceed their claim."""
    table = audit.audit(
        audit.QUICK, 4.0, 0.99, engine="local", work=str(tmp_path), seed=3, plant=plant, products=products
    )
    assert found <= {row.release for row in table if row.exceeded}


def test_unnoised_dpsgd_is_found(tmp_path):
    """DP-SGD without noise: in step 1 an excluded canary's items never move and an included one's
    do, so every guess of the one-run test is right (in step 2 Adam's unnoised steps overshoot some).
    At epsilon 2 a step's claim (1.29) is far below what that reaches with 300 canaries at delta
    1e-5 (2.4 or more, whatever the coins); at the default 4 the claim (2.62) is near it
    (docs/privacy.md)."""
    table = audit.audit(
        audit.QUICK, 2.0, 0.99, engine="local", work=str(tmp_path), seed=3, plant="dpsgd-noise", products=("dpsgd",)
    )
    rows = {row.release: row for row in table}
    first, second = rows["dpsgd: dpsgd step 1"], rows["dpsgd: dpsgd step 2"]
    assert first.claimed == second.claimed == pytest.approx(1.29, abs=0.05)
    assert first.one_run >= 2.4 and first.exceeded and second.exceeded
    assert not rows["dpsgd: counts"].exceeded


@pytest.mark.slow
@pytest.mark.beam
def test_halved_skellam_noise_is_found_at_the_full_federated_size(tmp_path):
    """The federated round's clients' Skellam shares at half their std: the Gaussian bound of each
    step's statistics exceeds the claim with the full size's federated canaries (at --quick's 100 the
    DP count's planning margin leaves too little power; docs/privacy.md)."""
    size = dataclasses.replace(audit.QUICK, federated=audit.FULL.federated)
    table = audit.audit(
        size, 4.0, 0.99, engine="local", work=str(tmp_path), seed=3, plant="skellam-noise", products=("federated",)
    )
    found = {row.release for row in table if row.exceeded}
    assert {"federated: stats step 1", "federated: stats step 2"} <= found
    assert all(row.canaries == audit.FULL.federated for row in table if "stats" in row.release)


def test_bad_input_is_one_line_and_exit_2(capsys):
    done = subprocess.run([SSP, "audit", "--canaries", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["ssp audit: error: --canaries must be at least 10, got 3"]
    from ssp import cli

    with pytest.raises(SystemExit) as exited:  # `ssp audit --help`, through the command's entry point
        cli.main(["audit", "--help"])
    help_text = capsys.readouterr().out
    assert exited.value.code == 0 and "--plant" in help_text and "Exit status" in help_text
