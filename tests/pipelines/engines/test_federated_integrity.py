"""What an operator or a server can do to a federated round: a second round of a step is refused
whatever happens to the step's output folder (through the installed `ssp`), a round refused before
any share was revealed reruns at no new charge, a server that shows holders different survivor sets
gets nothing, and the published files hold no exact client count.

The checks that run `ssp train` twice are parametrised over the two ways to run it (the fixture
`ssp_run`): through the installed command (a Spark start each: slow), and through `ssp`'s entry point in
this process (`cli.main`, on the test session's Spark) in the default run. The installed command's own
refusals (one line, exit status 2) stay in the default run: a partitioning server here, a copied run
folder here, and too few survivors in tests/pipelines/engines/test_federated.py."""

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pipelines.engines import federated
from pipelines.releases import stats_job
from pipelines.releases.counts import dp_units
from pipelines.training.run_dir import Run
from privacy import secure_aggregation as secagg
from privacy.ledger import Ledger
from privacy.seeds import ROUND_STARTED, ROUND_UNREVEALED, SeedFile
from schemas import storage
from ssp import cli
from tests.pipelines.engines.test_federated import ROUND_SECRET, SETTINGS, federated_job, prepared

pytestmark = pytest.mark.beam  # federated rounds run on Beam's DirectRunner

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
TRAIN = ["train", "--data", "data", "--out", "run", "--engine", "federated", *SETTINGS]


def ssp(folder, *args):
    """The installed `ssp` in `folder`: (exit status, stderr)."""
    result = subprocess.run([SSP, *args], cwd=folder, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stderr


@pytest.fixture(params=[pytest.param("installed", marks=pytest.mark.slow), "in-process"])
def ssp_run(request, spark, capsys):
    """`ssp` run in a folder, (exit status, stderr), both ways: the installed command (a Spark start each
    run: slow), and its entry point in this process (`cli.main`, on the test session's Spark)."""
    if request.param == "installed":
        return ssp

    def run(folder, *args):
        capsys.readouterr()
        with contextlib.chdir(folder):
            status = cli.main(list(args))
        return status, capsys.readouterr().err

    return run


@pytest.fixture(scope="module")
def finished(tmp_path_factory, spark):
    """A finished one-step federated run (`run`), and `copy`: its folder as the prepare stage left it,
    before the round (seed file and ledger included). Made in this process, on the test session's
    Spark: the tests read it, or copy it before they change it (only the copy test changes `copy`)."""
    folder = tmp_path_factory.mktemp("federated-run")
    assert (
        cli.main(
            ["synth", "--users", "60", "--items", "25", "--ratings-per-user", "8", "--out", str(folder / "data"), "-q"]
        )
        == 0
    )
    with contextlib.chdir(folder):  # TRAIN's relative paths, as the installed `ssp` runs them in this folder
        assert cli.main([*TRAIN, "--stage", "prepare", "-q"]) == 0
        shutil.copytree(folder / "run", folder / "copy")
        assert cli.main([*TRAIN, "-q"]) == 0
    return folder


def finished_copy(finished, folder):
    """The finished run and its data, copied into `folder`: a test that changes the run changes its own
    copy. The copy charges the same budget account (outside the run folder), where the round is
    recorded as started, as in the original."""
    for name in ("data", "run"):
        shutil.copytree(finished / name, folder / name)
    return folder


def redo_step_one(folder) -> None:
    """What a run killed after step 1's round (or an operator redoing the step) leaves: step 1 not done."""
    path = folder / "run" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["steps_done"].remove(1)
    path.write_text(json.dumps(manifest))


def test_the_published_release_holds_no_exact_client_count(finished):
    run = Run(str(finished / "run"))
    clients = np.unique(storage.read_table(run.centred)["user_id"].to_numpy()).size
    summary = json.loads((finished / "run" / "step-1" / "stats" / "release.json").read_text())
    block = summary["federated"]
    assert not {"clients", "min_clients", "survivors", "dropped", "share_variance"} & set(block)
    low, high = federated.planned_population(run.counts)  # the noise's clients come from the DP count, not the clients
    assert block["dp_units"] == dp_units(run.counts) and block["neighbours"] == secagg.neighbour_count(high)
    assert block["noise_clients"] == math.ceil((1 - block["max_dropout"]) * low) and low <= clients
    metadata = storage.read_schema(str(finished / "run" / "step-1" / "stats" / "resample-0.parquet")).metadata or {}
    assert not any(b"client" in key for key in metadata)
    report = (finished / "run" / "privacy.md").read_text()
    assert "## Federated trust model" in report and "Dropout threshold" in report and "Collusion threshold" in report
    assert f"t = {block['neighbours'] // 2 + 1}" in report and "Sybil" in report


def second_round_is_refused(folder, ssp_run) -> None:
    """A copy of the finished run with step 1 not done: the step's marker deleted, then its whole stats
    folder; `ssp train` (run by `ssp_run`) is refused each time, one line, exit status 2."""
    stats = folder / "run" / "step-1" / "stats"
    before = storage.read_table(str(stats / "resample-0.parquet"))
    spent = Ledger.open(str(folder / "run" / "ledger.parquet")).epsilon_spent()
    redo_step_one(folder)
    for removed in ("marker", "stats folder"):
        if removed == "marker":
            (stats / ".round-started").unlink(missing_ok=True)  # where the round was recorded before
        else:
            shutil.rmtree(stats)
        status, stderr = ssp_run(folder, *TRAIN)
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert status == 2 and "Traceback" not in stderr, (removed, stderr[-2000:])
        assert len(errors) == 1 and "already ran" in errors[0] and "start a new run" in errors[0], errors
        ledger = Ledger.open(str(folder / "run" / "ledger.parquet"))
        assert ledger.epsilon_spent() == spent and [row["name"] for row in ledger.rows].count("step-1/stats/r0") == 1
        if removed == "marker":
            assert storage.read_table(str(stats / "resample-0.parquet")).equals(before)  # nothing new published
        else:
            assert not stats.exists()


def test_a_second_round_of_a_step_is_refused_whatever_became_of_its_output_folder(finished, tmp_path, ssp_run):
    second_round_is_refused(finished_copy(finished, tmp_path), ssp_run)


def refused_round_reruns_and_is_charged_once(folder, ssp_run) -> None:
    """Too few survivors, twice: the second round is a rerun of the same release, refused again for
    too few survivors, not for having run, and charged once."""
    assert (
        cli.main(
            ["synth", "--users", "40", "--items", "20", "--ratings-per-user", "6", "--out", str(folder / "data"), "-q"]
        )
        == 0
    )
    # 0.9: 40 clients leave 21 or more survivors (the quorum) with chance 2e-10; at 0.7 it was 0.3% a round
    refused = [*TRAIN, "--federated-dropout", "0.9", "--federated-max-dropout", "0.1"]
    spent = []
    for _ in range(2):
        status, stderr = ssp_run(folder, *refused)
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert status == 2 and len(errors) == 1 and "clients answered, fewer than the" in errors[0], stderr[-2000:]
        ledger = Ledger.open(str(folder / "run" / "ledger.parquet"))
        assert [row["name"] for row in ledger.rows].count("step-1/stats/r0") == 1
        spent.append(ledger.epsilon_spent())
    assert spent[0] == spent[1]
    index = next(row["release"] for row in ledger.rows if row["name"] == "step-1/stats/r0")
    assert SeedFile.load(str(folder / "run" / "private" / "seed")).rounds == {index: ROUND_UNREVEALED}
    assert not (folder / "run" / "step-1" / "stats" / "release.json").exists()


def test_a_round_refused_before_any_share_was_revealed_reruns_and_is_charged_once(tmp_path, ssp_run):
    refused_round_reruns_and_is_charged_once(tmp_path, ssp_run)


def test_a_server_that_partitions_the_holders_gets_nothing(tmp_path):
    run = prepared(tmp_path)
    job = federated_job(
        run, max_dropout=0.3
    )  # the sets it shows are within the planned dropout: only the check stops them
    clients = np.unique(storage.read_table(run.centred)["user_id"].to_numpy())
    plan = federated.plan_round(job.stats, 1.0, clients.size, 0.3, 1)
    graph = secagg.neighbours(clients, federated.public_round_seed(ROUND_SECRET), plan.neighbours)
    server = federated.simulated_server("partition", graph)
    assert min(len(server(h, frozenset(graph))) for h in graph if h != server.victim) >= plan.min_clients
    catalog, broadcast = federated.broadcast_of(job)
    round_plan = federated.plan_round(job.stats, 1.0, clients.size, 0.3, catalog.size)
    result = federated.round_sums(
        dataclasses.replace(job, server=server),
        broadcast,
        round_plan,
        round_secret=ROUND_SECRET,
        graph=graph,
        dropped=frozenset(),
        options=None,
    )
    near = {
        server.victim,
        *graph[server.victim],
    }  # the victim's self-mask seed and its neighbours' keys: what the attack needs
    assert result.refusals > 0 and near <= set(result.unrecovered)
    with pytest.raises(
        federated.RoundRefusedError,
        match="revealed nothing, the survivor sets the server showed them failed the consistency check; "
        "round refused, nothing published",
    ):
        federated.run(dataclasses.replace(job, server=server))
    assert not storage.exists(stats_job.resample_path(job.stats.out, 0)) and not storage.exists(
        storage.join(job.stats.out, stats_job.RELEASE_SUMMARY)
    )
    index = next(row["release"] for row in Ledger.open(run.ledger).rows if row["name"] == "step-1/stats/r0")
    assert SeedFile.load(run.private("seed")).rounds == {
        index: ROUND_STARTED
    }  # a round the server cheated in is never rerun
    with pytest.raises(ValueError, match="already ran .* start a new run"):
        federated.run(job)


def test_a_partitioning_server_gets_nothing_through_the_installed_ssp(tmp_path):
    """`--federated-server partition` simulates the attack (the sets it shows are within the planned
    dropout, so only the consistency check stops it): one line, exit 2, nothing published, and the
    round is never run again."""
    assert (
        cli.main(
            [
                "synth",
                "--users",
                "60",
                "--items",
                "25",
                "--ratings-per-user",
                "8",
                "--out",
                str(tmp_path / "data"),
                "-q",
            ]
        )
        == 0
    )
    status, stderr = ssp(tmp_path, *TRAIN, "--federated-max-dropout", "0.3", "--federated-server", "partition")
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "failed the consistency check; round refused, nothing published" in errors[0], stderr[
        -3000:
    ]
    assert not (tmp_path / "run" / "step-1" / "stats" / "release.json").exists()
    assert (
        not list((tmp_path / "run" / "step-1" / "stats").glob("resample-*"))
        if (tmp_path / "run" / "step-1" / "stats").exists()
        else True
    )
    seeds = SeedFile.load(str(tmp_path / "run" / "private" / "seed"))
    assert list(seeds.rounds.values()) == [ROUND_STARTED]  # a round the server cheated in is never rerun


def test_a_copy_of_the_run_folder_cannot_run_a_round_again(finished):
    """A run folder copied before a round (seed file and ledger included): the round ran in one copy
    (`run`, the fixture's); in the other (`copy`), the same release's round is refused by the data
    source's account, which both copies charge, one line, exit 2, nothing published and nothing more spent."""
    status, stderr = ssp(finished, *[arg if arg != "run" else "copy" for arg in TRAIN], "-q")
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "already ran (recorded in the budget account" in errors[0], stderr[-3000:]
    assert not (finished / "copy" / "step-1" / "stats" / "release.json").exists()
    rows = [
        [(row["name"], row["data_fingerprint"]) for row in Ledger.open(str(finished / folder / "ledger.parquet")).rows]
        for folder in ("run", "copy")
    ]
    assert rows[0] == rows[1]  # the copy's ledger row is the original's release, charged once in the account
    account = Ledger.open(str(finished / "copy" / "ledger.parquet")).account()
    assert len(account.document["charges"]) == len(rows[0])
