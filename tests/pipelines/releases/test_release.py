"""pipelines.releases.release.make_release: concurrent releases, lost ledgers, stale seed files, counts checks."""

from __future__ import annotations

import multiprocessing
import os
import shutil

import pyarrow as pa
import pytest

from pipelines.releases import release
from privacy import accounting
from privacy.ledger import Ledger
from privacy.seeds import SeedFile, SeedReuseError
from schemas import storage

RELEASES_PER_PROCESS = 12


def _release_many(ledger_path: str, prefix: str, barrier) -> None:
    ledger = Ledger.open(ledger_path)
    seeds = release.open_seed_file(None, ledger_path)
    barrier.wait()  # both processes start releasing at once
    for k in range(RELEASES_PER_PROCESS):
        release.make_release(ledger, seeds, f"{prefix}-{k}", accounting.gaussian_event(50.0), {"k": k, "who": prefix})


def test_two_processes_releasing_into_one_ledger_get_distinct_indices_and_every_row(tmp_path):
    path = str(tmp_path / "run" / "ledger.parquet")
    Ledger.create(path, 10.0, 1e-5)
    SeedFile.create(release.default_seed_path(path))  # the run's seed, created once before the writers start
    # fresh interpreters, as two commands would be: a fork of this process copies whatever locks its
    # threads (gRPC's, Arrow's, a JVM gateway's) held at that moment, and a child could wait on one forever
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    writers = [context.Process(target=_release_many, args=(path, name, barrier)) for name in ("a", "b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    rows = Ledger.open(path).rows
    assert sorted(row["release"] for row in rows) == list(range(2 * RELEASES_PER_PROCESS))
    assert sorted(row["name"] for row in rows) == sorted(f"{p}-{k}" for p in "ab" for k in range(RELEASES_PER_PROCESS))
    seeds = SeedFile.load(str(tmp_path / "run" / "private" / "seed"))
    assert seeds.releases == {
        row["release"]: row["data_fingerprint"] for row in rows
    }  # no binding dropped, none shared
    assert seeds.ledgers[Ledger.open(path).identity] == list(range(2 * RELEASES_PER_PROCESS))


def _one_release(tmp_path, name="counts"):
    path = str(tmp_path / "run" / "ledger.parquet")
    ledger = Ledger.open(path) if os.path.exists(path) else Ledger.create(path, 10.0, 1e-5)
    seeds = release.open_seed_file(None, path)
    return ledger, seeds, release.make_release(ledger, seeds, name, accounting.gaussian_event(20.0), {"name": name})


def test_a_deleted_ledger_is_refused_not_restarted(tmp_path):
    _one_release(tmp_path, "counts")
    _one_release(tmp_path, "mean")
    os.remove(tmp_path / "run" / "ledger.parquet")
    fresh = Ledger.create(str(tmp_path / "run" / "ledger.parquet"), 10.0, 1e-5)  # what a careless resume would do
    with pytest.raises(
        ValueError,
        match=r"bound to another privacy ledger, which recorded releases \[0, 1\]: .* was deleted and replaced",
    ):
        release.make_release(
            fresh, release.open_seed_file(None, fresh.path), "step-1/stats/r0", accounting.gaussian_event(20.0), {}
        )
    assert Ledger.open(fresh.path).rows == []


def test_a_rolled_back_ledger_is_refused(tmp_path):
    _one_release(tmp_path, "counts")
    shutil.copy(tmp_path / "run" / "ledger.parquet", tmp_path / "old-ledger")
    _one_release(tmp_path, "mean")
    shutil.copy(tmp_path / "old-ledger", tmp_path / "run" / "ledger.parquet")
    with pytest.raises(ValueError, match=r"does not list releases \[1\]"):
        _one_release(tmp_path, "step-1/stats/r0")


def test_a_stale_seed_file_object_never_drops_a_binding(tmp_path):
    """The fault probe's case: one holder binds release 0, another (read before) binds release 1."""
    path = str(tmp_path / "seed")
    early = SeedFile.create(path)
    late = SeedFile.load(path)
    early.bind(0, "counts-fp")
    late.bind(1, "mean-fp")
    assert SeedFile.load(path).releases == {0: "counts-fp", 1: "mean-fp"}
    with pytest.raises(SeedReuseError, match="release 0"):
        late.bind(0, "other")


def test_seed_run_binding(tmp_path):
    seeds = SeedFile.create(str(tmp_path / "seed"))
    seeds.bind_run("run-a")
    seeds.bind_run("run-a")
    with pytest.raises(SeedReuseError, match="belongs to a run with other data or settings"):
        SeedFile.load(seeds.path).check_run("run-b")
    used = SeedFile.create(str(tmp_path / "used"))
    used.bind(0, "fp")
    with pytest.raises(SeedReuseError, match="outside a training run"):
        used.check_run("run-a")


def test_the_ledger_is_replaced_in_one_step(tmp_path, monkeypatch):
    ledger, _, _ = _one_release(tmp_path, "counts")
    before = open(ledger.path, "rb").read()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        ledger.record("mean", accounting.gaussian_event(20.0), "fp")
    assert open(ledger.path, "rb").read() == before  # the old ledger, whole


def test_counts_must_be_the_release_of_the_same_ledger(tmp_path):
    ledger, seeds, index = _one_release(tmp_path, "counts")
    counts = str(tmp_path / "counts.parquet")
    storage.write_table(pa.table({"item_id": pa.array([1, 2], pa.int64()), "count": [3.0, 4.0]}), counts)
    with pytest.raises(ValueError, match="is not the DP counts release recorded in the ledger"):
        release.check_counts_release(ledger, seeds, counts, seeds.digest_table(counts))
    seeds.record_output(index, seeds.digest_table(counts))
    release.check_counts_release(ledger, seeds, counts, seeds.digest_table(counts))
    storage.write_table(
        pa.table({"item_id": pa.array([1, 2], pa.int64()), "count": [3.0, 5.0]}), counts
    )  # exact counts, say
    with pytest.raises(ValueError, match="is not the DP counts release"):
        release.check_counts_release(ledger, seeds, counts, seeds.digest_table(counts))


def test_a_release_made_with_other_noise_is_not_resumed(tmp_path, monkeypatch):
    """A run interrupted under an older noise construction: resuming it would draw the same release
    index again with the new noise, two independent draws the ledger would count once. Refused."""
    _one_release(tmp_path, "counts")
    monkeypatch.setattr(release, "NOISE_VERSION", release.NOISE_VERSION + 1)
    with pytest.raises(SeedReuseError, match="already used for release 0"):
        _one_release(tmp_path, "counts")
    assert len(Ledger.open(str(tmp_path / "run" / "ledger.parquet")).rows) == 1


def _charge_many(account: str, ledger_path: str, barrier) -> None:
    ledger = Ledger.create(ledger_path, 100.0, 1e-5, account=account)
    seeds = release.open_seed_file(None, ledger_path)
    barrier.wait()
    for k in range(RELEASES_PER_PROCESS):
        release.make_release(ledger, seeds, f"r-{k}", accounting.gaussian_event(50.0), {"k": k})


def test_two_runs_charging_one_budget_account_at_once_lose_no_charge(tmp_path):
    from privacy.lifetime_budget import BudgetAccount

    account = str(tmp_path / "account.json")
    BudgetAccount.open_or_create(account, cap=None, delta=1e-5)
    # fresh interpreters, as two commands would be: a fork of this process copies whatever locks its
    # threads (gRPC's, Arrow's, a JVM gateway's) held at that moment, and a child could wait on one forever
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    runs = [
        context.Process(target=_charge_many, args=(account, str(tmp_path / name / "ledger.parquet"), barrier))
        for name in ("a", "b")
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join(120)
        assert run.exitcode == 0
    assert len(BudgetAccount.open(account).document["charges"]) == 2 * RELEASES_PER_PROCESS


def test_an_account_that_lost_another_runs_charges_is_refused_before_any_release(tmp_path, budget_account_registry):
    """Every run's seed file witnesses how many charges it saw in its data source's account: one
    that lost some (edited, rolled back) is refused, even when this run's own charges are all there."""
    from privacy.lifetime_budget import BudgetAccount

    settings = release.PrivacySettings(noise_multiplier=20.0, source="source-digest")
    ledgers = {name: settings.open_ledger(str(tmp_path / name / "ledger.parquet"), "user") for name in ("a", "b")}
    seeds = {name: release.open_seed_file(None, ledger.path) for name, ledger in ledgers.items()}
    release.make_release(ledgers["a"], seeds["a"], "counts", accounting.gaussian_event(20.0), {"run": "a"})
    release.make_release(ledgers["b"], seeds["b"], "counts", accounting.gaussian_event(20.0), {"run": "b"})
    release.make_release(ledgers["a"], seeds["a"], "mean", accounting.gaussian_event(20.0), {"run": "a"})
    account = ledgers["a"].account()
    assert (
        account.path == ledgers["b"].account().path and len(account.document["charges"]) == 3
    )  # one account for the data source
    account.document["charges"] = [
        c for c in account.document["charges"] if c["ledger"] != ledgers["b"].identity
    ]  # run b's charge edited out
    account._save()
    with pytest.raises(ValueError, match="lists 2 charges, fewer than the 3 this run saw there"):
        release.make_release(ledgers["a"], seeds["a"], "step-1/stats/r0", accounting.gaussian_event(20.0), {"run": "a"})
    assert (
        len(Ledger.open(ledgers["a"].path).rows) == 2 and len(BudgetAccount.open(account.path).document["charges"]) == 2
    )
