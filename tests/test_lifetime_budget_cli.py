"""The lifetime budget of a named data source, through the installed `ssp`, as an operator runs it:
next week's rows (some added, some removed, one user gone) charge the same account and are refused
at its cap; the same rows under a second name are refused; a run folder copied with `cp -r` whose
copy makes a release on other inputs is charged for it. The refusals, and the original run's release
beside its copy's, run as subprocesses; the ingests, the first runs and the user updates that only set
the stage, and the copy's release, run through `ssp.cli.main`, the function the command runs (each
process would cost a Python start)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from privacy.lifetime_budget import BudgetAccount, accounts_home
from schemas import storage
from ssp import cli
from tests.test_hostile_cli import assert_refused, ssp

USERS, ITEMS = 80, 30


def week(folder: Path, name: str, users: range, seed: int) -> Path:
    """A week's interactions (CSV) of `users` over the one catalog, written beside it."""
    rng = np.random.default_rng(seed)
    rows = [(u, int(i), float(rng.integers(1, 6))) for u in users for i in rng.choice(ITEMS, 8, replace=False)]
    path = folder / f"{name}.csv"
    path.write_text("user,item,stars\n" + "".join(f"{u},{i},{r:g}\n" for u, i, r in rows))
    if not (folder / "items.parquet").exists():
        genres = [f"g{i % 4}" for i in range(ITEMS)]
        pq.write_table(pa.table({"item": list(range(ITEMS)), "genre": genres}), folder / "items.parquet")
    return path


def ingested(folder: Path, log: Path, source: str) -> Path:
    out = folder / f"data-{log.stem}-{source}"
    command = [
        "ingest",
        "--interactions",
        log,
        "--catalog",
        folder / "items.parquet",
        "--features",
        "genre:value",
        "--user-col",
        "user",
        "--item-col",
        "item",
        "--label-col",
        "stars",
        "--rating-scale",
        1,
        5,
        "--data-source",
        source,
        "--out",
        out,
    ]
    assert cli.main([*map(str, command)]) == 0
    return out


PREPARE = ("train", "--stage", "prepare", "--engine", "local", "--dim", 4)


def prepare(data: Path, run: Path, *flags) -> object:
    """The prepare stage through the installed `ssp` (for the refusals)."""
    return ssp(*PREPARE, "--data", data, "--out", run, *flags)


def prepared(data: Path, run: Path, *flags) -> None:
    """The prepare stage through `ssp.cli.main` (a run whose releases set the stage)."""
    assert cli.main([*map(str, (*PREPARE, "--data", data, "--out", run, *flags))]) == 0


def account_of(source: str) -> BudgetAccount:
    return BudgetAccount.open(json.loads((Path(accounts_home()) / f"{source}.json").read_text())["account"])


def test_a_named_source_composes_every_weeks_rows_and_refuses_at_its_cap(tmp_path):
    first = ingested(tmp_path, week(tmp_path, "week1", range(USERS), seed=1), "shop")
    # next week: user 0 gone, user USERS new, every other user's rows drawn again
    second = ingested(tmp_path, week(tmp_path, "week2", range(1, USERS + 1), seed=2), "shop")
    shares = ("--count-share", 0.5, "--mean-share", 0.45)  # the prepare stage spends most of each run's epsilon
    prepared(first, tmp_path / "run1", "--epsilon", 1, *shares, "--account-cap", 1.2)
    spent = account_of("shop").epsilon()
    assert 0.8 < spent < 1.2
    refused = prepare(second, tmp_path / "run2", "--epsilon", 1, *shares)
    assert_refused(refused, "over the cap 1.2", "nothing was released")
    assert account_of("shop").epsilon() == spent  # refused before anything was charged
    again = ingested(tmp_path, tmp_path / "week2.csv", "shop-2")  # the same rows under a second name
    assert_refused(prepare(again, tmp_path / "run3", "--epsilon", 1), "already accounted to data source 'shop'")
    assert not (Path(accounts_home()) / "shop-2.json").exists()
    contradicted = prepare(first, tmp_path / "run4", "--epsilon", 1, "--data-source", "web")
    assert_refused(contradicted, "--data-source web contradicts the data set", "ingested as data source 'shop'")
    assert account_of("shop").epsilon() == spent and not (tmp_path / "run4" / "ledger.parquet").exists()


def test_a_copied_run_folders_release_on_other_inputs_is_charged(tmp_path):
    data = ingested(tmp_path, week(tmp_path, "week1", range(USERS), seed=1), "shop")
    original = tmp_path / "original"
    prepared(data, original, "--epsilon", 2, "--stats-threshold", 0)  # every item covered, whatever the counts' noise
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)  # cp -r, as an operator would
    for run in (original, copy):
        assert cli.main(["user-update", "--run", str(run), "--step", "1", "--engine", "local"]) == 0
    rows = storage.read_table(str(copy / "private" / "stats_rows.parquet"))  # the copy's inputs: one user fewer
    gone = pc.min(rows["user_id"]).as_py()
    storage.write_table(rows.filter(pc.not_equal(rows["user_id"], gone)), str(copy / "private" / "stats_rows.parquet"))
    charges = len(account_of("shop").document["charges"])
    result = ssp("stats", "--run", original, "--step", 1, "--engine", "local")
    assert result.returncode == 0, result.stderr
    assert cli.main(["stats", "--run", str(copy), "--step", "1", "--engine", "local"]) == 0
    after = account_of("shop").document["charges"]
    assert len(after) == charges + 2  # the copy's release was on other inputs: charged as a second release
