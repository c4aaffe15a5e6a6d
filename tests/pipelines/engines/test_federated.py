"""Federated SSP2 on Beam's DirectRunner: the release equals, within the fixed-point quantisation,
the central statistics plus the clients' summed noise; dropouts are recovered or the round is
refused; the ledger plans it; `ssp train --engine federated` trains from it end to end."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc
import pytest

from pipelines.engines import federated
from pipelines.releases import stats_job
from pipelines.releases.counts import dp_units, dp_units_std
from pipelines.releases.stats_core import user_contributions
from pipelines.training import run_dir, stats_stage
from pipelines.training.run_dir import Run
from privacy import secure_aggregation as secagg
from privacy.accumulator import grouped_sums, packed_size
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from ssp import cli
from trainer.solve import ridge_solve

pytestmark = pytest.mark.beam  # federated rounds run on Beam's DirectRunner

ROUND_SECRET = bytes(range(32))
SETTINGS = ["--epsilon", "5", "--outer-steps", "1", "--epochs", "2", "--dim", "3", "--stats-threshold", "0"]


def prepared(folder, engine="federated"):
    assert (
        cli.main(
            ["synth", "--users", "60", "--items", "25", "--ratings-per-user", "8", "--out", str(folder / "data"), "-q"]
        )
        == 0
    )
    run = folder / f"run-{engine}"
    assert (
        cli.main(
            [
                "train",
                "--stage",
                "prepare",
                "--data",
                str(folder / "data"),
                "--out",
                str(run),
                "--engine",
                engine,
                *SETTINGS,
                *(["--no-biases"] if engine != "federated" else []),
            ]
        )
        == 0
    )  # the federated round has no biases
    return Run(str(run))


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory):
    """One prepared federated run (`prepared`), and its budget account's document as the prepare stage
    left it, for `prepared_run`."""
    run = prepared(tmp_path_factory.mktemp("federated-prepared"))
    account = Ledger.open(run.ledger).account()
    with open(account.path, "rb") as handle:
        return run, account.path, handle.read()


@pytest.fixture
def prepared_run(prepared_once, tmp_path):
    """A copy of the prepared federated run in this test's folder, as `prepared(tmp_path)` would make
    it. Every copy charges the one budget account of the data source (outside the run folder, where a
    round's start is recorded: a second copy's round would be refused, tests/pipelines/
    test_federated_integrity.py), so the account is put back as the prepare stage left it first."""
    run, account, document = prepared_once
    with open(account, "wb") as handle:
        handle.write(document)
    copy = Run(str(shutil.copytree(run.root, tmp_path / "run-federated")))
    assert Ledger.open(copy.ledger).account().path == account
    return copy


def federated_job(run: Run, dropout=0.0, max_dropout=0.1) -> federated.FederatedJob:
    manifest = run.prepared()
    config = run_dir.config_of(run, manifest)
    job = stats_stage.stats_job_for(run, config, 1, manifest["prepared"]["stats_items"])
    return federated.FederatedJob(
        job, run.centred, run.item_embeddings(0), config.lambda_u, config.gravity, dropout, max_dropout, ROUND_SECRET
    )


def central_sums(job: federated.FederatedJob, users: set):
    """The exact A_j, b_j of `users`, as the central stats job computes them: each user's embedding
    solved on all its rows, then clipped, weighted terms summed per item (no noise)."""
    items = np.sort(storage.read_table(job.stats.items)["item_id"].to_numpy())
    counts = storage.read_table(job.stats.counts).sort_by("item_id")
    count_of = counts["count"].to_numpy()[np.searchsorted(counts["item_id"].to_numpy(), items)]
    embeddings = storage.read_table(job.item_embeddings)
    v = list_column_to_matrix(embeddings["embedding"], job.stats.settings.dim, "item")
    v_of = dict(zip(embeddings["item_id"].to_numpy().tolist(), v, strict=True))
    solve, stats = (
        storage.read_table(job.solve_rows).to_pandas(),
        storage.read_table(job.stats.interactions).to_pandas(),
    )
    keys, rows = [], []
    for user in sorted(users):
        mine = solve[solve.user_id == user]
        _, u = ridge_solve(
            mine.user_id.to_numpy(),
            np.array([v_of[i] for i in mine.item_id]),
            mine.label.to_numpy(),
            job.lambda_u,
            scale_by_rows=True,
        )
        rated = stats[stats.user_id == user]
        at = np.searchsorted(items, rated.item_id.to_numpy())
        k, r = user_contributions(
            rated.user_id.to_numpy(),
            at,
            rated.label.to_numpy(),
            np.repeat(u, len(at), axis=0),
            count_of[at],
            settings=job.stats.settings,
        )
        keys.append(k)
        rows.append(r)
    positions, a, b = grouped_sums(np.concatenate(keys), np.concatenate(rows))
    d = job.stats.settings.dim
    out = np.zeros((items.size, packed_size(d) + d))
    out[positions, : packed_size(d)], out[positions, packed_size(d) :] = a, b
    return out


def released(job: federated.FederatedJob) -> np.ndarray:
    table = storage.read_table(stats_job.resample_path(job.stats.out, 0)).sort_by("item_id")
    d = job.stats.settings.dim
    return np.hstack(
        [list_column_to_matrix(table["a_upper"], packed_size(d), "a"), list_column_to_matrix(table["b"], d, "b")]
    )


@pytest.mark.parametrize("dropout, max_dropout", [(0.0, 0.1), (0.1, 0.3)])
def test_the_federated_release_is_the_central_sums_plus_the_clients_noise(prepared_run, dropout, max_dropout):
    run = prepared_run
    job = federated_job(run, dropout, max_dropout)
    summary = federated.run(job)
    clients = np.unique(storage.read_table(run.centred)["user_id"].to_numpy())
    dropped = federated.dropped_clients(clients, federated.public_round_seed(ROUND_SECRET), dropout)
    survivors = set(clients.tolist()) - dropped
    assert len(dropped) > 0 if dropout > 0 else not dropped
    ledger = Ledger.open(run.ledger)
    multiplier = ledger.budget["multipliers"]["stats"]
    plan = federated.plan_round(job.stats, multiplier, clients.size, max_dropout, summary["items"])
    assert summary["noise_multiplier"] == multiplier and ledger.budget["accountant"] == "rdp-integer"
    noise = sum(
        federated.client_noise(federated.client_secret(ROUND_SECRET, c), plan) for c in sorted(survivors)
    ).reshape(plan.items, plan.width)
    expected = central_sums(job, survivors) + noise / plan.scale
    got = released(job)
    assert np.abs(got - expected).max() <= len(survivors) / plan.scale + 1e-8 * np.abs(expected).max()
    # the noise is the calibrated one: std z_s * wbar * clip_u^2 on A's entries (at least, with dropouts)
    s = job.stats.settings
    std_a = (noise[:, : packed_size(s.dim)] / plan.scale).std()
    assert std_a == pytest.approx(
        plan.skellam_multiplier * s.wbar * s.clip_u**2 * np.sqrt(len(survivors) / plan.noise_clients), rel=0.25
    )


def test_the_published_plan_is_the_same_for_one_client_more_or_less(prepared_run):
    """Every published parameter comes from the counts release's DP number of units: n - 1, n and
        n + 1 clients give one public plan (only the unpublished quorum may move); a client count more
        than HIGH_STDS of the units' noise above the DP count is refused as a mismatch (`run` plans before
    it releases)."""
    run = prepared_run
    job = federated_job(run)
    n = np.unique(storage.read_table(run.centred)["user_id"].to_numpy()).size
    low, high = federated.planned_population(run.counts)
    std = dp_units_std(run.counts)
    assert low == max(3, dp_units(run.counts) - math.ceil(federated.LOW_STDS * std)) and low <= n <= high
    plans = [federated.plan_round(job.stats, 1.0, clients, 0.1, 25) for clients in (n - 1, n, n + 1)]
    assert plans[0].public_json() == plans[1].public_json() == plans[2].public_json()
    assert plans[1].noise_clients == math.ceil(0.9 * low) and plans[1].min_clients == max(
        plans[1].noise_clients, n // 2 + 1
    )
    with pytest.raises(UserError, match=f"the round has {high + 1} clients, outside the range {low}-{high}"):
        federated.plan_round(job.stats, 1.0, high + 1, 0.1, 25)


def test_removing_a_user_moves_the_round_by_its_own_vector_and_noise_share_only(prepared_run, tmp_path):
    """Neighbouring data through the round's Beam pipeline: one user's rows removed from the round's
    inputs (the split and the centred rows are per user: tests/test_privacy_guards.py), everything
    public held (the broadcast, the plan, which depends on the number of clients only). The unmasked
    sum then moves by that user's own clipped, weighted vector and noise share, within one fixed-point
    step: no other client's input looks at another user's rows, and nothing else in the round does."""
    run = prepared_run
    job = federated_job(run)
    catalog, broadcast = federated.broadcast_of(job)
    clients = np.unique(storage.read_table(run.centred)["user_id"].to_numpy())
    removed = int(clients[len(clients) // 2])

    def rows(path, keep):
        table = storage.read_table(path, columns=["user_id", "item_id", "label"])
        mine = pc.equal(table["user_id"], removed)
        return table.filter(pc.invert(mine) if keep else mine)

    folder = tmp_path / "without"
    storage.write_table(rows(job.solve_rows, keep=True), str(folder / "solve.parquet"))
    storage.write_table(rows(job.stats.interactions, keep=True), str(folder / "stats.parquet"))
    neighbour = dataclasses.replace(
        job,
        solve_rows=str(folder / "solve.parquet"),
        stats=dataclasses.replace(job.stats, interactions=str(folder / "stats.parquet")),
    )
    plan = federated.plan_round(job.stats, 1.0, clients.size, 0.1, catalog.size)
    totals = []
    for round_job, members in ((job, clients), (neighbour, clients[clients != removed])):
        graph = secagg.neighbours(members, federated.public_round_seed(ROUND_SECRET), plan.neighbours)
        result = federated.round_sums(
            round_job, broadcast, plan, round_secret=ROUND_SECRET, graph=graph, dropped=frozenset(), options=None
        )
        assert result.survivors == members.size and result.unrecovered == [] and result.refusals == 0
        totals.append(secagg.decode(result.masked - result.corrections, plan.scale))
    own = [rows(path, keep=False) for path in (job.solve_rows, job.stats.interactions)]
    assert own[1].num_rows > 0
    vector = federated.client_contribution(
        removed,
        *[(t["item_id"].to_numpy(), t["label"].to_numpy()) for t in own],
        broadcast,
        settings=job.stats.settings,
        lambda_u=job.lambda_u,
        plan=plan,
    )
    share = federated.client_noise(federated.client_secret(ROUND_SECRET, removed), plan) / plan.scale
    assert np.abs(vector).max() > 0 and np.abs(share).max() > 0
    assert np.abs(totals[0] - totals[1] - vector - share).max() <= 1 / plan.scale + 1e-9 * np.abs(vector).max()


@pytest.mark.parametrize("drawn", [1, 2, 5])
def test_a_dp_count_drawn_far_below_the_clients_still_gives_every_client_its_neighbours(
    prepared_run, monkeypatch, drawn
):
    """The DP number of units is noisy (std 30 here, for 60 clients): a draw of 1, 2 or 5 must still
    plan a graph in which every client's secret is shared with at least t neighbours, so that a round
    without dropouts unmasks every client (the neighbours come from the count's high end)."""
    job = federated_job(prepared_run)
    catalog, broadcast = federated.broadcast_of(job)
    clients = np.unique(storage.read_table(prepared_run.centred)["user_id"].to_numpy())
    monkeypatch.setattr(federated, "dp_units", lambda path: drawn)
    plan = federated.plan_round(job.stats, 1.0, clients.size, 0.1, catalog.size)
    graph = secagg.neighbours(clients, federated.public_round_seed(ROUND_SECRET), plan.neighbours)
    assert min(len(near) for near in graph.values()) >= secagg.threshold(plan.neighbours) >= 2
    result = federated.round_sums(
        job, broadcast, plan, round_secret=ROUND_SECRET, graph=graph, dropped=frozenset(), options=None
    )
    assert result.unrecovered == [] and result.survivors == clients.size


def test_a_round_with_more_dropouts_than_planned_is_refused_and_publishes_nothing(prepared_run):
    run = prepared_run
    job = federated_job(run, dropout=0.4, max_dropout=0.1)
    with pytest.raises(
        federated.RoundRefusedError,
        match="fewer than the .* the noise is planned for .* round refused, nothing published",
    ):
        federated.run(job)
    assert not storage.exists(stats_job.resample_path(job.stats.out, 0)) and not storage.exists(
        storage.join(job.stats.out, stats_job.RELEASE_SUMMARY)
    )
    assert [row["name"] for row in Ledger.open(run.ledger).rows][
        -1
    ] == "step-1/stats/r0"  # planned and recorded before the round
    # the clients revealed no share, so the round may run again (fresh noise, nothing was unmasked, no new charge); once
    # run, never again
    spent = Ledger.open(run.ledger).epsilon_spent()
    federated.run(federated_job(run, dropout=0.0, max_dropout=0.1))
    assert Ledger.open(run.ledger).epsilon_spent() == spent
    with pytest.raises(ValueError, match="already ran .* start a new run"):
        federated.run(federated_job(run, dropout=0.0, max_dropout=0.1))


def test_a_round_whose_dropped_clients_cannot_be_unmasked_is_refused_and_never_rerun(prepared_run):
    run = prepared_run
    job = federated_job(
        run, dropout=0.3, max_dropout=0.6
    )  # enough survivors for the noise, too few neighbours left for some secrets
    with pytest.raises(
        federated.RoundRefusedError, match="too few neighbours revealed the secrets .* round refused, nothing published"
    ):
        federated.run(job)
    assert not storage.exists(stats_job.resample_path(job.stats.out, 0))
    with pytest.raises(ValueError, match="already ran"):
        federated.run(federated_job(run, dropout=0.0, max_dropout=0.6))


def test_a_run_accounted_otherwise_is_refused_before_any_release(tmp_path):
    run = prepared(tmp_path, engine="beam")
    releases = len(Ledger.open(run.ledger).rows)
    with pytest.raises(ValueError, match="RDP on integer orders"):
        federated.run(federated_job(run))
    assert len(Ledger.open(run.ledger).rows) == releases


def test_ssp_train_federated_end_to_end_through_the_installed_command(tmp_path):
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    assert (
        cli.main(
            [
                "synth",
                "--users",
                "300",
                "--items",
                "30",
                "--ratings-per-user",
                "30",
                "--out",
                str(tmp_path / "data"),
                "-q",
            ]
        )
        == 0
    )
    result = subprocess.run(
        [
            installed,
            "train",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "run"),
            "--engine",
            "federated",
            "--federated-dropout",
            "0.05",
            "--federated-max-dropout",
            "0.4",
            "--epsilon",
            "10",
            "--outer-steps",
            "2",
            "--dim",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.load(open(tmp_path / "run" / "metrics.json"))
    ledger = Ledger.open(str(tmp_path / "run" / "ledger.parquet"))
    assert ledger.budget["accountant"] == "rdp-integer" and 10.0 - 1e-4 < ledger.epsilon_spent() <= 10.0
    assert [row["name"] for row in ledger.rows][-2:] == ["step-1/stats/r0", "step-2/stats/r0"]
    summary = json.load(open(tmp_path / "run" / "step-2" / "stats" / "release.json"))
    assert summary["federated"]["upload_bytes_per_client"] > 8 * summary["items"] * 9
    assert not (tmp_path / "run" / "private" / "step-1" / "user_embeddings.parquet").exists()  # the clients kept theirs
    # 300 ratings an item at epsilon 10 and the trainer's default epochs: the model's edge over the DP mean is several
    # times the test set's noise; at 80 users, epsilon 5 and 2 epochs neither could be told from the other, and the DP
    # mean sometimes won by chance
    assert metrics["test_rmse"] < metrics["test_mean_predictor_rmse"]


def test_a_federated_run_charges_the_data_sources_account_beside_a_central_run(tmp_path):
    central, federated_run = (
        prepared(tmp_path, engine="beam"),
        prepared(tmp_path),
    )  # one data source keeps one lifetime budget
    accounts = [Ledger.open(run.ledger).budget.get("account") for run in (central, federated_run)]
    assert accounts[0] is not None and accounts[0] == accounts[1]


def test_a_refused_round_is_one_line_and_exit_status_2_through_the_installed_command(tmp_path):
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    assert (
        cli.main(
            [
                "synth",
                "--users",
                "40",
                "--items",
                "20",
                "--ratings-per-user",
                "6",
                "--out",
                str(tmp_path / "data"),
                "-q",
            ]
        )
        == 0
    )
    result = subprocess.run(
        [
            installed,
            "train",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "run"),
            "--engine",
            "federated",
            "--federated-dropout",
            "0.9",  # 21 or more of the 40 survive (the quorum) with chance 2e-10; at 0.7 it was 0.3%
            "--federated-max-dropout",
            "0.1",
            *SETTINGS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and "clients answered, fewer than the" in errors[0] and "run the command again" in errors[0]
    assert not (tmp_path / "run" / "step-1" / "stats" / "release.json").exists()


def test_a_client_with_a_repeated_pair_is_refused_as_the_central_job_refuses_it():
    from pipelines.releases.stats_core import StatsSettings
    from schemas.ids import IdIndex

    broadcast = federated.Broadcast(
        (IdIndex(np.array([1, 2])), np.eye(2)), None, IdIndex(np.array([1, 2])), np.array([5.0, 5.0])
    )
    plan = federated.Plan(3, 3, 3, 2, 2, 2.0**20, 1.0, (1.0, 1.0), 2)
    rows = (np.array([1, 1]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="client 7 has repeated \\(user, item\\) pairs"):
        federated.client_contribution(
            7, rows, rows, broadcast, settings=StatsSettings(2, 1.0, 1.0), lambda_u=0.1, plan=plan
        )
    once = federated.client_contribution(
        7,
        rows,
        (np.array([2]), np.array([1.0])),
        broadcast,
        settings=StatsSettings(2, 1.0, 1.0),
        lambda_u=0.1,
        plan=plan,
    )
    assert (
        np.count_nonzero(once.reshape(2, -1)[0]) == 0 and np.count_nonzero(once.reshape(2, -1)[1]) > 0
    )  # only its own item
