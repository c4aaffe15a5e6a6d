"""The ledger and the seed cannot be fooled, through the installed `ssp` command (subprocesses).

A fault probe found that a run handed another run's seed file released its DP counts with the
other run's noise before anything was refused, that a prepared run whose ledger was deleted got a
fresh one (and reused release 0's noise key), and that budget was spent before the settings were
checked. The cases run the real `ssp` binary, as an operator would (one exception, under Cost):
refusals exit 2 with one line naming the problem, spend nothing, and leave no new run directory
behind.

Cost: a whole `ssp train` starts a JVM before its prepare stage, so a refusal that comes from the
prepare stage is checked through `ssp train --stage prepare` (the same function, no JVM), and its
twin through the whole `ssp train` is marked slow (`-m slow`); `ssp counts` and `ssp stats` run on
`--engine local` (tests/pipelines prove the engines make the same releases; the installed `ssp stats`
on Beam: tests/pipelines/releases/test_bias_stats.py). The refusal of each invalid setting is checked
through `ssp.cli.main`, the function the command runs, and one of them through the command itself.
The data set, the shared prepared run, the runs that only charge an account before a refusal and the
releases whose numbers are compared (the noise of copied runs, a reproduced release) are made through
`ssp.cli.main` in this process; every refusal goes through the installed command. The tests that
only read a prepared run share one (`prepared`); one that changes it works on a copy, which keeps
the run's seed file, ledger id and budget account, as any copy of a run folder does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from privacy import accounting
from privacy.ledger import Ledger
from privacy.lifetime_budget import BudgetAccount
from privacy.seeds import SeedFile

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
FAST = ["--epsilon", "5", "--outer-steps", "1", "--epochs", "1", "--dim", "4"]
PREPARED = [
    *FAST,
    "--stats-threshold",
    "1",
]  # the shared run's settings (a threshold: its stats rows are a strict subset)


def ssp(*args, check=True):
    result = subprocess.run([SSP, *map(str, args)], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def in_process(*args):
    """`ssp args` through `ssp.cli.main`, the function the command runs: for the runs and data sets
    that set the stage (each process would cost a Python start), not for what is checked."""
    from ssp import cli

    assert cli.main([*map(str, args)]) == 0


def refused(*args, pattern):
    """`ssp args` exits 2 with one error line matching `pattern` and no traceback."""
    result = ssp(*args, check=False)
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and pattern in errors[0], result.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards") / "data"
    in_process("synth", "--users", 150, "--items", 60, "--ratings-per-user", 8, "--out", folder)
    return str(folder)


@pytest.fixture(scope="module")
def smaller(data, tmp_path_factory):
    """`data` without its first user's rows (a neighbouring data set), and that user."""
    import pyarrow.compute as pc

    from schemas import storage

    rows = storage.read_table(os.path.join(data, "interactions.parquet"))
    user = rows["user_id"][0].as_py()
    folder = tmp_path_factory.mktemp("guards-smaller") / "data"
    shutil.copytree(data, folder)
    shutil.rmtree(folder / "interactions.parquet")
    storage.write_table(rows.filter(pc.not_equal(rows["user_id"], user)), str(folder / "interactions.parquet"))
    return str(folder), user


@pytest.fixture(scope="module")
def prepared(data, tmp_path_factory):
    """One run of `data` prepared with PREPARED settings (counts and mean released), for the tests
    that only read it; a test that changes it copies it first."""
    run = tmp_path_factory.mktemp("guards-prepared") / "run"
    in_process("train", "--stage", "prepare", "--data", data, "--out", run, *PREPARED)
    return str(run)


def test_another_runs_seed_is_refused_before_anything_is_written(data, smaller, prepared, tmp_path):
    first = prepared  # only read: the refusals below write nothing, which is checked
    seed = os.path.join(first, "private", "seed")
    bound = SeedFile.load(seed)
    names = {row["release"]: row["data_fingerprint"] for row in Ledger.open(os.path.join(first, "ledger.parquet")).rows}
    assert bound.releases == names and sorted(names) == [0, 1]  # the counts' binding survived the mean release
    # other settings (epsilon 8 instead of 5: counts with the same noise and two multipliers would give the exact
    # counts)
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        tmp_path / "other",
        *PREPARED[2:],
        "--epsilon",
        "8",
        "--seed-file",
        seed,
        pattern="belongs to a run with other data or settings",
    )
    assert not (tmp_path / "other").exists()
    # other data: the same data set less one user's rows
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        smaller[0],
        "--out",
        tmp_path / "other",
        *PREPARED,
        "--seed-file",
        seed,
        pattern="belongs to a run with other data or settings",
    )
    assert not (tmp_path / "other").exists()
    assert SeedFile.load(seed).releases == bound.releases
    # the same data and settings: the seed file serves the first run's ledger, another run's is refused before anything
    # is written
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        tmp_path / "again",
        *PREPARED,
        "--seed-file",
        seed,
        pattern="is bound to another privacy ledger",
    )
    assert not (tmp_path / "again").exists()
    assert SeedFile.load(seed).releases == bound.releases
    # the same seed in a seed file of its own (a fixed seed: the tests' option) reproduces the releases exactly
    in_process(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        tmp_path / "again",
        *PREPARED,
        "--seed-file",
        SeedFile.create(str(tmp_path / "fixed-seed"), bound.seed).path,
    )
    assert (
        open(os.path.join(first, "counts", "counts.parquet", "part-00000.parquet"), "rb").read()
        == open(tmp_path / "again" / "counts" / "counts.parquet" / "part-00000.parquet", "rb").read()
    )


def copy_of_prepared(prepared, tmp_path) -> str:
    """A copy of the shared prepared run (its seed file, ledger and account included), to change."""
    run = str(tmp_path / "run")
    shutil.copytree(prepared, run)
    return run


def test_a_missing_ledger_is_refused(data, prepared, tmp_path):
    """The prepare stage (which a whole `ssp train` runs first: its twin below) and `ssp privacy`."""
    run = copy_of_prepared(prepared, tmp_path)
    os.remove(os.path.join(run, "ledger.parquet"))
    refused("train", "--stage", "prepare", "--data", data, "--out", run, *PREPARED, pattern="its ledger")
    refused("privacy", run, pattern="privacy ledger not found")
    assert not os.path.exists(os.path.join(run, "ledger.parquet"))
    # a ledger put back empty (or from an earlier point) is refused too: the seed file witnessed releases 0 and 1
    Ledger.create(os.path.join(run, "ledger.parquet"), 5.0, 1e-5)
    refused("privacy", run, pattern="bound to another privacy ledger, which recorded releases [0, 1]")
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        run,
        *PREPARED,
        pattern="bound to another privacy ledger, which recorded releases [0, 1]",
    )


@pytest.mark.slow
def test_a_missing_ledger_is_refused_by_a_whole_training_run(data, prepared, tmp_path):
    """test_a_missing_ledger_is_refused through `ssp train` itself (it starts Spark before its prepare stage)."""
    run = copy_of_prepared(prepared, tmp_path)
    os.remove(os.path.join(run, "ledger.parquet"))
    refused("train", "--data", data, "--out", run, *PREPARED, pattern="its ledger")
    assert not os.path.exists(os.path.join(run, "ledger.parquet"))
    Ledger.create(os.path.join(run, "ledger.parquet"), 5.0, 1e-5)
    refused(
        "train",
        "--data",
        data,
        "--out",
        run,
        *PREPARED,
        pattern="bound to another privacy ledger, which recorded releases [0, 1]",
    )


def test_removing_a_user_from_the_raw_input_removes_only_their_rows_before_any_release(
    data, smaller, prepared, tmp_path
):
    """Neighbouring data sets, end to end through prepare: the training rows (which the counts and
    the mean are computed from) of D minus one user are exactly those of D minus that user's rows.
    The rows the stats job reads are chosen by the released DP counts alone: given D's release,
    D minus one user gives D's stats rows minus that user's."""
    from pipelines.engines.local import LocalEngine
    from pipelines.releases.counts import dp_units
    from pipelines.releases.mean import CentredOutput
    from pipelines.training import prepare as prepare_stage
    from pipelines.training import run_dir
    from pipelines.training.run_dir import Run
    from schemas import storage

    smaller, user = smaller  # `data` less every row of `user`
    full_run, less_run = (
        prepared,
        tmp_path / "less",
    )  # the full data's run is the shared one (PREPARED: --stats-threshold 1)
    in_process("train", "--stage", "prepare", "--data", smaller, "--out", less_run, *PREPARED)

    def rows(path):
        table = storage.read_table(str(path))
        return set(zip(*(table[c].to_pylist() for c in ("user_id", "item_id", "label", "timestamp")), strict=True))

    full, less = (rows(os.path.join(run, "private", "split", "train.parquet")) for run in (full_run, less_run))
    assert any(r[0] == user for r in full)
    assert less == {r for r in full if r[0] != user}

    released = Run(full_run)
    manifest = json.load(open(released.manifest_path))
    config = run_dir.config_of(released, manifest)
    covered = prepare_stage.stats_catalog(
        config,
        storage.read_table(released.counts),
        None,
        prepare_stage.ledger_multiplier(released.ledger),
        dp_units(released.counts),
    )
    assert 0 < covered.size < 60 and set(storage.read_table(released.stats_items)["item_id"].to_pylist()) == set(
        covered.tolist()
    )
    again = tmp_path / "less-with-full-release.parquet"
    LocalEngine().write_centred(
        str(less_run / "private" / "split" / "train.parquet"),
        [CentredOutput(str(again), covered)],
        manifest["prepared"]["mean"],
        "rmse",
    )
    stats_rows = rows(released.stats_rows)
    assert any(r[0] == user for r in stats_rows) and {r[1] for r in stats_rows} <= set(covered.tolist())
    assert rows(again) == {r for r in stats_rows if r[0] != user}


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--batch-size", "0"),
        ("--epochs", "0"),
        ("--ridge", "-1"),
        ("--lambda-u", "-1"),
        ("--shards", "0"),
        ("--model-seed", "-5"),
        ("--learning-rate", "nan"),
        ("--dim", "0"),
        ("--dpsgd-epochs", "inf"),
        ("--stats-threshold", "-1"),
        ("--stats-threshold", "nan"),
        ("--encoder-init", "pca"),
        ("--anchor", "-1"),
        ("--user-prior", "-1"),
        ("--user-prior", "nan"),
        ("--clip-y", "0"),
        ("--bias-coordinate", "0"),
    ],
)
def test_every_invalid_setting_is_refused_with_nothing_spent(data, tmp_path, capsys, flag, value):
    """Through `ssp.cli.main`, the function the installed command runs (one process start per setting
    would only repeat test_an_invalid_setting_is_refused_by_the_installed_command)."""
    from ssp import cli

    try:
        status = cli.main(["train", "--data", data, "--out", str(tmp_path / "run"), *FAST, flag, value])
    except SystemExit as exit:  # argparse's own refusals (a choice not offered) exit from inside main
        status = exit.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert status == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith("ssp train: error: ") and flag in errors[0], err
    assert not (tmp_path / "run").exists()


def test_an_invalid_setting_is_refused_by_the_installed_command(data, tmp_path):
    refused("train", "--data", data, "--out", tmp_path / "run", *FAST, "--clip-y", "0", pattern="--clip-y")
    assert not (tmp_path / "run").exists()


def test_a_stats_threshold_that_cannot_apply_is_refused_or_named(data, tmp_path):
    """An id encoder with a threshold is refused before anything is written. A threshold no item's
    DP count clears does not fail the run after its counts were spent: the prepare stage says so in
    one warning line (no traceback), what was spent stays in the run's ledger, and the statistics
    cover no item and no row (the run keeps its starting point: tests/pipelines/training/test_stages.py)."""
    from pipelines.training.run_dir import Run
    from schemas import storage

    refused(
        "train",
        "--data",
        data,
        "--out",
        tmp_path / "id",
        *FAST,
        "--encoder",
        "id",
        "--item-update",
        "als",
        "--stats-threshold",
        1,
        pattern="--stats-threshold needs the features encoder",
    )
    assert not (tmp_path / "id").exists()
    result = ssp(
        "train", "--stage", "prepare", "--data", data, "--out", tmp_path / "high", *FAST, "--stats-threshold", 1e9
    )
    named = [line for line in result.stderr.splitlines() if "the statistics would cover nothing" in line]
    assert len(named) == 1 and "keeps its starting point" in named[0] and "Traceback" not in result.stderr, (
        result.stderr[-3000:]
    )
    run = Run(str(tmp_path / "high"))
    assert [row["name"] for row in Ledger.open(run.ledger).rows] == ["counts", "mean"]
    assert json.load(open(run.manifest_path))["prepared"]["stats_cover"] == 0
    assert storage.read_table(run.stats_items).num_rows == 0 and storage.read_table(run.stats_rows).num_rows == 0


def featureless_catalog(tmp_path):
    """A small MovieLens folder ingested with one feature family, then with none; the latter data set."""
    folder = tmp_path / "movies"
    folder.mkdir()
    (folder / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n"
        + "".join(f"{u},{i},{1 + (u * i) % 5},0\n" for u in range(1, 30) for i in range(1, 9))
    )
    (folder / "movies.csv").write_text(
        "movieId,title,genres\n" + "".join(f"{i},Movie {i} (2000),Drama\n" for i in range(1, 9))
    )
    in_process("ingest", "--source", folder, "--out", tmp_path / "data", "--public-features", "year")
    import pyarrow.parquet as pq

    assert pq.read_schema(
        next((tmp_path / "data" / "items.parquet").glob("*.parquet"))
    ).metadata  # ingested with one family
    # a data set whose only declared family is dropped: build it by ingesting with an empty declaration
    in_process(
        "ingest", "--source", folder, "--out", tmp_path / "bare", "--public-features", ""
    )  # an empty declaration is a catalog without features
    return tmp_path / "bare"


def test_a_catalog_without_public_features_is_refused_before_any_release(tmp_path):
    """By the prepare stage, which makes the first release (a whole run: the twin below)."""
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        featureless_catalog(tmp_path),
        "--out",
        tmp_path / "run",
        *FAST,
        pattern="declares no public feature family",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_catalog_without_public_features_stops_a_whole_training_run(tmp_path):
    """The same refusal through `ssp train` itself (Spark started before its prepare stage)."""
    refused(
        "train",
        "--data",
        featureless_catalog(tmp_path),
        "--out",
        tmp_path / "run",
        *FAST,
        pattern="declares no public feature family",
    )
    assert not (tmp_path / "run").exists()


def test_the_budget_account_composes_runs_and_refuses_past_its_cap(data, tmp_path, budget_account_registry):
    account = str(tmp_path / "accounts" / "users.json")
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        tmp_path / "tiny",
        *FAST,
        "--budget-account",
        account,
        "--account-cap",
        "0.3",
        pattern="over the cap 0.3",
    )
    assert not (tmp_path / "tiny").exists() and BudgetAccount.open(account).document["charges"] == []
    os.remove(
        account
    )  # an account with another policy for these users: an operator's decision, made outside the product
    for entry in budget_account_registry.glob("*.json"):
        entry.unlink()
    # a cap that two prepared runs fit under and three do not (prepare releases the counts and the mean)
    from pipelines.training.settings import TrainConfig

    plan = TrainConfig.create(data=data, epsilon=5.0, outer_steps=1, epochs=1, dim=4).privacy()
    multipliers, kind = plan.multipliers(), plan.accountant
    per_run = [accounting.gaussian_event(multipliers["counts"]), accounting.gaussian_event(multipliers["mean"], 2)]
    cap = round(
        (accounting.epsilon_of(per_run * 2, 1e-5, kind) + accounting.epsilon_of(per_run * 3, 1e-5, kind)) / 2, 3
    )
    for run in ("a", "b"):
        in_process(
            "train",
            "--stage",
            "prepare",
            "--data",
            data,
            "--out",
            tmp_path / run,
            *FAST,
            "--budget-account",
            account,
            "--account-cap",
            cap,
        )
    events = [event for run in ("a", "b") for event in Ledger.open(str(tmp_path / run / "ledger.parquet")).events()]
    held = BudgetAccount.open(account)
    reference = (
        pld_privacy_accountant.PLDAccountant(value_discretization_interval=accounting.PLD_DISCRETIZATION)
        if held.document["accountant"] == "pld"
        else rdp_privacy_accountant.RdpAccountant()
    )
    for event in events:
        reference.compose(event)
    assert held.epsilon() == pytest.approx(
        reference.get_epsilon(1e-5), rel=1e-5
    )  # PLD: the grid's order of composition
    shown = ssp("privacy", tmp_path / "a").stdout
    assert f"budget account {account}: epsilon {held.epsilon():.4g}" in shown
    # a third run would take the users past the cap: refused at its first release, nothing spent
    refused(
        "train",
        "--stage",
        "prepare",
        "--data",
        data,
        "--out",
        tmp_path / "c",
        *FAST,
        "--budget-account",
        account,
        pattern=f"over the cap {cap:g}",
    )
    assert not (tmp_path / "c").exists() and len(BudgetAccount.open(account).document["charges"]) == len(events)
    assert math.isfinite(held.epsilon()) and held.epsilon() <= cap * (1 + 1e-9)
    assert json.load(open(account))["cap"] == cap
    assert accounting.epsilon_of(events, 1e-5, held.document["accountant"]) == pytest.approx(held.epsilon())


def test_a_copied_run_folder_gives_different_noise_to_neighbouring_data(tmp_path):
    """The review's attack: copy a run folder (seed file included) before a release, make that
    release in both copies on data that differ by one user. Same noise would make the difference of
    the two releases that user's exact contribution; the noise is keyed by the release's inputs, so
    the two draws are independent, and the same inputs still reproduce the release exactly (free)."""
    import numpy as np

    from schemas import storage
    from tests.pipelines.stats_inputs import write_inputs

    catalog = [10, 20, 30, 40]
    rows = [(1, 10, 4.0), (1, 20, 3.0), (2, 20, 5.0), (2, 30, 1.0), (3, 10, 2.0), (3, 30, 4.0)]
    embeddings = {1: [0.6, 0.2], 2: [-0.3, 0.5], 3: [0.1, -0.7]}
    paths = write_inputs(tmp_path / "in", rows, embeddings, {j: 1.0 for j in catalog}, catalog)
    neighbour = write_inputs(
        tmp_path / "neighbour", [row for row in rows if row[0] != 3], embeddings, {j: 1.0 for j in catalog}, catalog
    )
    budget = ["--noise-multiplier", "1", "--outer-steps", "1", "--mean-share", "0", "--gram-share", "0"]
    run = tmp_path / "run"
    in_process(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        run / "counts",
        "--ledger",
        run / "ledger.parquet",
        *budget,
        "--engine",
        "local",
    )
    shutil.copytree(run, tmp_path / "copy")  # a backup, `cp -r run run-try2`, a snapshot: before release 1

    def stats(folder, inputs, out="stats"):
        in_process(
            "stats",
            "--interactions",
            inputs["interactions"],
            "--user-embeddings",
            inputs["user_embeddings"],
            "--items",
            inputs["items"],
            "--counts",
            folder / "counts" / "counts.parquet",
            "--out",
            folder / out,
            "--ledger",
            folder / "ledger.parquet",
            "--dim",
            2,
            "--clip-u",
            1,
            "--clip-y",
            5,
            *budget,
            "--engine",
            "local",
        )
        table = storage.read_table(str(folder / out / "resample-0.parquet")).sort_by("item_id")
        return np.array(table["a_upper"].to_pylist()), np.array(table["b"].to_pylist())

    a, b = stats(run, paths)
    a_copy, b_copy = stats(tmp_path / "copy", neighbour)  # user 3 removed: it rated items 10 and 30
    untouched = [catalog.index(20), catalog.index(40)]
    assert (
        Ledger.open(str(run / "ledger.parquet")).rows[1]["release"]
        == Ledger.open(str(tmp_path / "copy" / "ledger.parquet")).rows[1]["release"]
        == 1
    )
    assert np.all(np.abs(a[untouched] - a_copy[untouched]) > 1e-6) and np.all(
        np.abs(b[untouched] - b_copy[untouched]) > 1e-6
    )  # independent draws
    a_again, b_again = stats(run, paths, out="stats-again")  # the same inputs in the original: the same release, free
    assert np.array_equal(a_again, a) and np.array_equal(b_again, b)
    assert len(Ledger.open(str(run / "ledger.parquet")).rows) == 2


def test_a_release_without_noise_is_refused_on_a_capped_account(tmp_path):
    from tests.pipelines.stats_inputs import write_inputs

    paths = write_inputs(tmp_path / "in", [(1, 10, 4.0), (2, 10, 3.0)], {1: [0.5, 0.5], 2: [0.1, 0.2]}, {10: 2.0}, [10])
    account = tmp_path / "accounts" / "shop.json"
    in_process(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "first",
        "--epsilon",
        "1",
        "--budget-account",
        account,
        "--account-cap",
        "10",
        "--engine",
        "local",
    )
    charges = json.load(open(account))["charges"]
    refused(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "exact",
        "--noise-multiplier",
        "0",
        "--budget-account",
        account,
        "--engine",
        "local",
        pattern="--noise-multiplier 0 (no noise, infinite epsilon) cannot be charged to the capped budget account",
    )
    assert not (tmp_path / "exact").exists() and json.load(open(account))["charges"] == charges


def test_a_data_source_keeps_one_account_whatever_happens_to_paths(tmp_path, budget_account_registry):
    """The account is found by the content of the interactions, through the registry: a copied or
    symlinked data folder charges the same account; a deleted, renamed or replaced account, or a
    second one for the same data, is refused before any release, exit 2, nothing written."""
    from tests.pipelines.stats_inputs import write_inputs

    paths = write_inputs(
        tmp_path / "in",
        [(1, 10, 4.0), (2, 10, 3.0), (2, 20, 1.0)],
        {1: [0.5, 0.5], 2: [0.1, 0.2]},
        {10: 2.0, 20: 1.0},
        [10, 20],
    )
    shutil.copytree(tmp_path / "in", tmp_path / "copy")
    os.symlink(tmp_path / "in", tmp_path / "link")

    def counts(folder, out, *flags):
        in_process(
            "counts",
            "--interactions",
            os.path.join(folder, "interactions.parquet"),
            "--items",
            os.path.join(folder, "items.parquet"),
            "--out",
            out,
            "--epsilon",
            "1",
            "--engine",
            "local",
            *flags,
        )

    counts(tmp_path / "in", tmp_path / "a")
    counts(tmp_path / "copy", tmp_path / "b")
    counts(tmp_path / "link", tmp_path / "c")
    (entry,) = [p for p in budget_account_registry.glob("*.json") if not p.name.endswith(".account.json")]
    account = json.load(open(entry))["account"]
    assert (
        len(BudgetAccount.open(account).document["charges"]) == 3
    )  # one account for the three paths to the same users
    refused(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "d",
        "--epsilon",
        "1",
        "--engine",
        "local",
        "--budget-account",
        tmp_path / "fresh.json",
        pattern="this data source already has its budget account",
    )
    shutil.move(account, account + ".renamed")  # renamed (or deleted)
    refused(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "d",
        "--epsilon",
        "1",
        "--engine",
        "local",
        pattern="is missing: deleted, renamed or moved",
    )
    BudgetAccount.open_or_create(str(tmp_path / "other.json"))
    os.symlink(tmp_path / "other.json", account)  # replaced by (a link to) another, empty account
    refused(
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "d",
        "--epsilon",
        "1",
        "--engine",
        "local",
        pattern="it was replaced",
    )
    assert not (tmp_path / "d").exists()
    os.remove(account)
    shutil.move(account + ".renamed", account)  # restored: the data source's runs go on
    counts(tmp_path / "in", tmp_path / "d")
    assert len(BudgetAccount.open(account).document["charges"]) == 4
