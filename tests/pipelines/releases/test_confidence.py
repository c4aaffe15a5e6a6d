"""Implicit feedback's confidence (repeated plays): the split counts a pair's repeats, the ranking
rows carry c = trainer.solve.confidence(count), and a row weighs c inside its user's normalised
weight budget in the statistics (the real Spark job, the real Beam pipeline and the installed `ssp
stats --confidence`) and in the user's solve. Exact values by hand, and one user removed moves the
statistics within the bound the noise is scaled to."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from pipelines.data import splits
from pipelines.releases.mean import centred
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.accumulator import unpack_upper
from privacy.weights import user_level_weights
from schemas import storage
from schemas.tables import INTERACTIONS, validate_stats
from tests.pipelines.stats_inputs import expected_stats, noise_free_release, register_counts, write_inputs
from trainer.solve import confidence, ridge_solve

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
CLIP_U, CLIP_Y, WBAR = 1.0, 2.0, 1.5
SETTINGS = StatsSettings(
    2, CLIP_U, CLIP_Y, "user", WBAR, weight_exponent=0.0, confidence=True
)  # the ranking protocol's uniform exponent
CATALOG = [10, 20, 30]
COUNTS = {10: 16.0, 20: 1.0, 30: 81.0}
# (user, item, confidence): user 3 came back to item 30 often; user 4's embedding is beyond the clip
ROWS = [(1, 10, 1.0), (1, 20, 1.0), (2, 10, 2.5), (2, 30, 1.0), (3, 30, 4.0), (3, 20, 1.0), (4, 10, 3.0), (4, 30, 1.0)]
EMBEDDINGS = {1: [0.3, 0.4], 2: [0.5, -0.5], 3: [0.0, 0.2], 4: [3.0, 4.0]}


def released(engine: str, folder, rows, spark=None):
    """(A_j full matrices, b_j) of the noise-free release on `engine`, in catalog order."""
    return read(noise_free_release(engine, folder, rows, EMBEDDINGS, COUNTS, CATALOG, SETTINGS, spark))


def read(path):
    table = validate_stats(storage.read_table(path)).sort_by("item_id")
    return unpack_upper(np.array(table["a_upper"].to_pylist()), 2), np.array(table["b"].to_pylist())


def test_the_confidence_of_repeats_by_hand():
    np.testing.assert_allclose(confidence([1, 3, 9], 1.0), (1 + np.log([2, 4, 10])) / (1 + np.log(2)))
    assert confidence([1], 0.0)[0] == confidence([50], 0.0)[0] == 1.0  # alpha 0: a repeat counts once
    with pytest.raises(ValueError, match="at least 1"):
        confidence([0.5], 1.0)


def test_a_users_confidences_move_its_weights_but_not_their_budget():
    users, counts, c = np.array([7, 7, 7, 8]), np.array([16.0, 1.0, 81.0, 4.0]), np.array([1.0, 3.0, 2.0, 5.0])
    w = user_level_weights(users, counts, WBAR, -0.25, c)
    scaled = c[:3] * counts[:3] ** -0.25
    np.testing.assert_allclose(w[:3], WBAR * scaled / np.sqrt(np.sum(scaled**2)))
    assert np.sum(w[:3] ** 2) == pytest.approx(WBAR**2) and w[3] == pytest.approx(
        WBAR
    )  # the budget whatever the confidences


def test_the_split_counts_repeats_for_implicit_feedback_and_keeps_the_latest_rating_otherwise():
    table = pa.table(
        {
            "user_id": [1, 1, 1, 2, 1, 2],
            "item_id": [10, 20, 10, 10, 10, 30],
            "label": [1.0] * 6,
            "timestamp": [5, 6, 7, 1, None, 2],
        },
        schema=INTERACTIONS,
    )
    counted = splits._canonical(table, count_repeats=True)
    assert list(zip(*(counted[c].to_pylist() for c in ("user_id", "item_id", "label")), strict=True)) == [
        (1, 10, 3.0),
        (1, 20, 1.0),
        (2, 10, 1.0),
        (2, 30, 1.0),
    ]
    latest = splits._canonical(table.set_column(2, "label", pa.array([4.0, 3.0, 2.0, 5.0, 1.0, 3.5])))
    assert (
        latest.num_rows == 4 and latest["label"].to_pylist()[0] == 1.0
    )  # user 1's item 10: the row with no time sorts last
    # user-local: removing user 2 leaves user 1's counted rows as they were
    assert splits._canonical(table.filter(pa.compute.equal(table["user_id"], 1)), count_repeats=True).equals(
        counted.slice(0, 2)
    )
    # the ranking rows: each positive's confidence, 1 for explicit data
    rows = centred(counted, 0.0, "recall", None, confidence_alpha=1.0)
    np.testing.assert_allclose(rows["label"].to_numpy(), confidence(np.array([3.0, 1, 1, 1]), 1.0))
    assert centred(counted, 0.0, "recall", None)["label"].to_pylist() == [1.0] * 4


def test_a_confident_row_weighs_its_confidence_in_the_users_solve():
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    users, c, lam = np.array([5, 5, 5]), np.array([1.0, 3.0, 2.0]), 0.5
    _, u = ridge_solve(users, v, c, lam, scale_by_rows=True, confidence=True)
    want = np.linalg.solve((v.T * c) @ v + lam * 3 * np.eye(2), v.T @ c)  # sum c v v^T + lambda n I against sum c 1 v
    np.testing.assert_allclose(u[0], want)
    _, plain = ridge_solve(users, v, np.ones(3), lam, scale_by_rows=True)
    np.testing.assert_allclose(
        ridge_solve(users, v, np.ones(3), lam, scale_by_rows=True, confidence=True)[1], plain
    )  # c = 1: unchanged


@pytest.mark.parametrize("engine", ["local", "spark", "beam"])
def test_confident_statistics_are_exact_and_one_user_moves_them_within_the_bound(engine, spark, tmp_path):
    a, b = released(engine, tmp_path / "all", ROWS, spark)
    want_a, want_b = expected_stats(
        ROWS, EMBEDDINGS, COUNTS, CATALOG, CLIP_U, CLIP_Y, WBAR, exponent=0.0, confidence=True
    )
    for row, j in enumerate(CATALOG):
        np.testing.assert_allclose(a[row], want_a[j], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b[row], want_b[j], rtol=1e-12, atol=1e-15)
    # by hand, item 30: user 2 (weights 1.5 (2.5, 1) / sqrt(2.5^2 + 1) over its two rows: its 1 on item 30),
    # user 3 (4 of 4, 1), user 4 (1 of 3, 1), each with label 1 and its clipped embedding
    w2, w3, w4 = WBAR / np.sqrt(2.5**2 + 1), WBAR * 4 / np.sqrt(17), WBAR / np.sqrt(10)
    np.testing.assert_allclose(
        b[2], w2 * np.array([0.5, -0.5]) + w3 * np.array([0.0, 0.2]) + w4 * np.array([0.6, 0.8]), rtol=1e-12
    )
    for user in (2, 4):
        a2, b2 = released(engine, tmp_path / f"without-{user}", [row for row in ROWS if row[0] != user], spark)
        assert 0 < np.sqrt(np.sum((a - a2) ** 2)) <= WBAR * CLIP_U**2 * (1 + 1e-9)
        assert 0 < np.sqrt(np.sum((b - b2) ** 2)) <= WBAR * CLIP_Y * CLIP_U * (1 + 1e-9)


def test_installed_ssp_stats_confidence_matches_the_formulas(tmp_path):
    paths = write_inputs(tmp_path, ROWS, EMBEDDINGS, COUNTS, CATALOG)
    out = tmp_path / "out"
    register_counts(paths["counts"], str(out / "ledger.parquet"), PrivacySettings(noise_multiplier=0.0))
    result = subprocess.run(
        [
            SSP,
            "stats",
            "--engine",
            "beam",
            "--interactions",
            paths["interactions"],
            "--user-embeddings",
            paths["user_embeddings"],
            "--items",
            paths["items"],
            "--counts",
            paths["counts"],
            "--out",
            str(out),
            "--dim",
            "2",
            "--confidence",
            "--weight-exponent",
            "0",
            "--clip-u",
            str(CLIP_U),
            "--clip-y",
            str(CLIP_Y),
            "--wbar",
            str(WBAR),
            "--noise-multiplier",
            "0",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = read(str(out / "resample-0.parquet"))
    want_a, want_b = expected_stats(
        ROWS, EMBEDDINGS, COUNTS, CATALOG, CLIP_U, CLIP_Y, WBAR, exponent=0.0, confidence=True
    )
    np.testing.assert_allclose(b, np.array([want_b[j] for j in CATALOG]), rtol=1e-12)
    np.testing.assert_allclose(a, np.array([want_a[j] for j in CATALOG]), rtol=1e-12, atol=1e-15)
