"""The privacy audit: its bounds by hand, its test on a known Gaussian, and `ssp audit` end to end.

The audits run in this process, on the test session's Spark (`ssp audit` uses a session that is
already active), `ssp audit` through the `ssp` command's own entry point (ssp.cli.main); only the bad
input, whose exit status and one error line are the process's, runs `ssp` as a process."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bench import audit
from pipelines.base import logs
from tests.bench import cached_accounting

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")


@pytest.fixture
def in_process(spark, monkeypatch):
    """For an audit in this process: the session's Spark active, PLD calibrations made once per plan
    (tests/bench/cached_accounting.py), and the log level that `-q` sets put back afterwards."""
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is not None  # else `ssp audit` would start, and stop, a session of its own
    cached_accounting.install(monkeypatch)
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
        if len(cells) == 9 and re.match(r"^[\d.]+$|^inf$", cells[1]):
            rows[cells[0]] = (float(cells[1]), float(cells[2].split()[0]))
    return rows


def test_ssp_audit_quick_passes_on_the_product(in_process, capsys):
    code, stdout = ssp_audit(capsys, "--quick", "--seed", "3", "-q")
    assert code == 0, stdout
    rows = _table(stdout)
    assert set(rows) == {
        "counts",
        "stats step 1",
        "stats step 2",
        "stats steps 1-2 (difference)",
        "all releases composed",
        "seed-file copy, stats step 1",
    }
    assert all(bound <= claimed for claimed, bound in rows.values())
    assert rows["all releases composed"][0] == pytest.approx(4.0, rel=1e-6)
    assert rows["all releases composed"][1] > 0  # the audit sees the releases at all
    assert "PASS" in stdout


def test_ssp_audit_finds_a_planted_seed_copy(in_process, capsys):
    code, stdout = ssp_audit(capsys, "--quick", "--seed", "3", "-q", "--plant", "seed-copy")
    assert code == audit.EXIT_EXCEEDED, stdout
    claimed, bound = _table(stdout)["seed-file copy, stats step 1"]
    assert bound > claimed
    assert "FAIL" in stdout


@pytest.mark.parametrize(
    "plant, found",
    [
        ("sensitivity", {"stats step 1", "stats step 2", "all releases composed"}),
        ("shared-noise", {"stats steps 1-2 (difference)", "seed-file copy, stats step 1"}),
    ],
)
def test_planted_defects_exceed_the_claim(in_process, tmp_path, plant, found):
    """The rows that must see each defect do (shared noise leaves every release alone a correct
    Gaussian release: only pairs of releases see it)."""
    table = audit.audit(
        audit.QUICK, audit.Settings(4.0), 0.95, spark=in_process, work=str(tmp_path), seed=3, plant=plant
    )
    assert found <= {row.release for row in table if row.exceeded}
    if plant == "shared-noise":
        assert {row.release for row in table if row.exceeded} == found


def test_bad_input_is_one_line_and_exit_2(capsys):
    done = subprocess.run([SSP, "audit", "--canaries", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["ssp audit: error: --canaries must be at least 10, got 3"]
    from ssp import cli

    with pytest.raises(SystemExit) as exited:  # `ssp audit --help`, through the command's entry point
        cli.main(["audit", "--help"])
    help_text = capsys.readouterr().out
    assert exited.value.code == 0 and "--plant" in help_text and "Exit status" in help_text
