"""SSP-convex on Spark (`--loss logistic`): the released H_j, g_j expanded for SSP2 give the exact
gradient and curvature of the implicit-feedback logistic loss at the expansion point; removing a user
moves them by at most the effective clips' sensitivity; `ssp train --loss logistic` runs end to end
(through the installed `ssp` under -m slow; in this process, on the test session's Spark, by default)."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from pipelines.engines import spark_stats as stats
from pipelines.releases import stats_job
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy import quadratic
from privacy.accumulator import packed_size, unpack_upper
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.tables import ITEM_EMBEDDINGS
from ssp import cli
from tests.pipelines.stats_inputs import registered, write_inputs
from trainer import ssp

D, CLIP_U, WBAR = 3, 0.8, 0.7
CATALOG = [10, 11, 12, 13, 14, 15]


def inputs(folder, drop_user=None):
    rng = np.random.default_rng(3)
    embeddings = {u: rng.normal(size=D) * rng.uniform(0.2, 2.0) for u in range(1, 9)}
    positives = [(u, j, 1.0) for u in embeddings for j in CATALOG if rng.random() < 0.4 or j == 10 + u % 6]
    if drop_user is not None:
        positives = [row for row in positives if row[0] != drop_user]
        embeddings = {u: v for u, v in embeddings.items() if u != drop_user}
    paths = write_inputs(folder, positives, embeddings, {j: 5.0 for j in CATALOG}, CATALOG)
    points = rng.normal(size=(len(CATALOG), D))
    paths["expansion"] = storage.join(str(folder), "expansion.parquet")
    storage.write_table(
        pa.table({"item_id": CATALOG, "embedding": [list(v) for v in points]}, schema=ITEM_EMBEDDINGS),
        paths["expansion"],
    )
    return paths, positives, embeddings, points


def release(spark, folder, paths):
    settings = StatsSettings(D, CLIP_U, 1.0, "user", WBAR, 0.0, "logistic")
    job = registered(
        stats_job.StatsJob(
            paths["interactions"],
            paths["user_embeddings"],
            paths["items"],
            paths["counts"],
            str(folder / "out"),
            settings,
            PrivacySettings(noise_multiplier=0.0),
            expansion=paths["expansion"],
        )
    )
    stats.run(job, spark)
    table = storage.read_table(stats_job.resample_path(job.out, 0)).sort_by("item_id")
    return (
        table,
        list_column_to_matrix(table["a_upper"], packed_size(D), "a"),
        list_column_to_matrix(table["b"], D, "b"),
    )


def test_the_expanded_release_is_the_exact_gradient_and_curvature_of_the_logistic_loss(spark, tmp_path):
    paths, positives, embeddings, points = inputs(tmp_path)
    table, h_upper, g = release(spark, tmp_path, paths)
    assert table.schema.metadata[b"loss"] == b"logistic"
    expanded = ssp.expand_table(
        stats_job.resample_path(str(tmp_path / "out"), 0),
        str(tmp_path / "expanded.parquet"),
        (np.array(CATALOG), points),
        psd_projection=False,
    )
    a = storage.read_table(expanded).sort_by("item_id")
    a_full = unpack_upper(list_column_to_matrix(a["a_upper"], packed_size(D), "a"), D)
    b = list_column_to_matrix(a["b"], D, "b")
    # the loss by hand: each user's positives (label 1) and every catalog item as a negative (label 0)
    users = sorted(embeddings)
    n_pos = np.array([sum(1 for row in positives if row[0] == u) for u in users])
    w_p, w_n = quadratic.logistic_weights(n_pos, len(CATALOG), WBAR)
    clipped = np.array([embeddings[u] * min(1.0, CLIP_U / np.linalg.norm(embeddings[u])) for u in users])
    v = tf.Variable(points)
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            scores = tf.constant(clipped) @ tf.transpose(v)  # users x items
            positive = np.zeros((len(users), len(CATALOG)))
            for u, j, _ in positives:
                positive[users.index(u), CATALOG.index(j)] = 1.0
            loss = tf.reduce_sum(
                w_p[:, None] * positive * (tf.math.softplus(scores) - scores) + w_n[:, None] * tf.math.softplus(scores)
            )
        gradient = inner.gradient(loss, v)
    hessian = outer.jacobian(gradient, v).numpy()
    np.testing.assert_allclose(np.einsum("jab,jb->ja", a_full, points) - b, gradient.numpy(), rtol=1e-9, atol=1e-12)
    for j in range(len(CATALOG)):
        np.testing.assert_allclose(a_full[j], hessian[j, :, j, :], rtol=1e-9, atol=1e-12)


def test_removing_a_user_moves_the_release_by_at_most_the_effective_sensitivity(spark, tmp_path):
    whole, _, _, _ = inputs(tmp_path / "whole")
    _, h, g = release(spark, tmp_path / "whole", whole)
    for user in (1, 4):
        fewer, _, _, _ = inputs(tmp_path / f"without-{user}", drop_user=user)
        _, h2, g2 = release(spark, tmp_path / f"without-{user}", fewer)
        moved_h = np.linalg.norm(unpack_upper(h - h2, D))
        moved_g = np.linalg.norm(g - g2)
        clip_u, clip_y = quadratic.effective_clips(CLIP_U)
        assert 0 < moved_h <= WBAR * clip_u**2 * (1 + 1e-9) and 0 < moved_g <= WBAR * clip_y * clip_u * (1 + 1e-9)


INSTALLED = os.path.join(os.path.dirname(sys.executable), "ssp")


def installed_ssp(*args):
    """The installed `ssp`: (exit status, stderr)."""
    result = subprocess.run([INSTALLED, *map(str, args)], capture_output=True, text=True, timeout=600)
    return result.returncode, result.stderr


def logistic_end_to_end(tmp_path, run_ssp) -> None:
    """`ssp train --loss logistic`, run by `run_ssp`: refused without --protocol recall (before it writes
    anything), then two outer steps end to end."""
    assert (
        run_ssp(
            "synth", "--users", "150", "--items", "40", "--ratings-per-user", "10", "--out", tmp_path / "data", "-q"
        )[0]
        == 0
    )
    status, stderr = installed_ssp(
        "train", "--data", tmp_path / "data", "--out", tmp_path / "rmse", "--loss", "logistic"
    )
    assert status == 2 and "--loss logistic (SSP-convex on implicit feedback) needs --protocol recall" in stderr
    assert not (tmp_path / "rmse").exists()
    status, stderr = run_ssp(
        "train",
        "--data",
        tmp_path / "data",
        "--out",
        tmp_path / "run",
        "--protocol",
        "recall",
        "--loss",
        "logistic",
        "--epsilon",
        5,
        "--outer-steps",
        2,
        "--epochs",
        2,
        "--dim",
        3,
        "--stats-threshold",
        0,  # every item's statistics released whatever the counts' noise (150 users x 40 items sit near the rule's N/S)
    )
    assert status == 0, stderr[-3000:]
    metrics = json.load(open(tmp_path / "run" / "metrics.json"))
    assert 0 <= metrics["test_recall_at_20"] <= 1 and metrics["epsilon_spent"] == pytest.approx(5.0, abs=1e-4)
    released = storage.read_schema(stats_job.resample_path(str(tmp_path / "run" / "step-2" / "stats"), 0))
    assert released.metadata[b"loss"] == b"logistic"


@pytest.mark.parametrize("way", [pytest.param("installed", marks=pytest.mark.slow), "in-process"])
def test_ssp_train_loss_logistic_end_to_end(way, spark, tmp_path, capsys):
    """Every command through the installed `ssp` (the training run starts a Spark of its own: slow), or
    through `ssp`'s entry point in this process (on the test session's Spark), the refusal still through
    the installed `ssp` (it starts no Spark)."""

    def in_process(*args):
        capsys.readouterr()
        status = cli.main(list(map(str, args)))
        return status, capsys.readouterr().err

    logistic_end_to_end(tmp_path, installed_ssp if way == "installed" else in_process)
