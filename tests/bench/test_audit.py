"""The privacy audit: its bounds by hand, its test on a known Gaussian, and `ssp audit` end to end."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from bench import audit

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")


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


def test_ssp_audit_quick_passes_on_the_product():
    done = subprocess.run([SSP, "audit", "--quick", "--seed", "3", "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _table(done.stdout)
    assert set(rows) == {"counts", "stats step 1", "stats step 2", "stats steps 1-2 (difference)", "all releases composed", "seed-file copy, stats step 1"}
    assert all(bound <= claimed for claimed, bound in rows.values())
    assert rows["all releases composed"][0] == pytest.approx(4.0, rel=1e-6)
    assert rows["all releases composed"][1] > 0  # the audit sees the releases at all
    assert "PASS" in done.stdout


def test_ssp_audit_finds_a_planted_seed_copy():
    done = subprocess.run([SSP, "audit", "--quick", "--seed", "3", "-q", "--plant", "seed-copy"], capture_output=True, text=True, timeout=300)
    assert done.returncode == audit.EXIT_EXCEEDED, done.stdout + done.stderr
    claimed, bound = _table(done.stdout)["seed-file copy, stats step 1"]
    assert bound > claimed
    assert "FAIL" in done.stdout


@pytest.mark.parametrize("plant, found", [("sensitivity", {"stats step 1", "stats step 2", "all releases composed"}),
                                          ("shared-noise", {"stats steps 1-2 (difference)", "seed-file copy, stats step 1"})])
def test_planted_defects_exceed_the_claim(spark, tmp_path, plant, found):
    """In process, on the test session's Spark: the rows that must see each defect do (shared noise
    leaves every release alone a correct Gaussian release: only pairs of releases see it)."""
    table = audit.audit(audit.QUICK, audit.Settings(4.0), 0.95, spark, str(tmp_path), seed=3, plant=plant)
    assert found <= {row.release for row in table if row.exceeded}
    if plant == "shared-noise":
        assert {row.release for row in table if row.exceeded} == found


def test_bad_input_is_one_line_and_exit_2():
    done = subprocess.run([SSP, "audit", "--canaries", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["ssp audit: error: --canaries must be at least 10, got 3"]
    help_text = subprocess.run([SSP, "audit", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "--plant" in help_text and "Exit status" in help_text
