"""The installed `ssp` binary against a hostile but realistic user and machine, as a subprocess.

Every case must end with exit status 2 and one error line that names the file or setting; no
traceback, no Java stack, no native abort at exit (some failures only show when the process exits,
so the cases that once aborted there are repeated). Nothing new may be left behind (no folder, lock,
staging or partial table) and earlier outputs stay whole. Full and read-only disks are made for real
(a small tmpfs, a read-only bind mount) where this machine allows it, and skipped with the reason
where it does not; the file-size limit is `ulimit -f` (RLIMIT_FSIZE) in the child.

Each `ssp` process costs ~1.5 s to start and one that starts Spark several seconds more, so Spark and
Beam run only in the cases about their own errors: elsewhere `--engine local`, a stage command that
reads the run before its engine starts (`ssp stats --run`), inputs written here rather than computed
by a Spark job, and the whole-run cases on Spark in the slow set (`-m slow`) with a fast twin. What
only sets the stage of a case (the shared data set and run, an earlier data set a case must keep
whole) is made through `ssp.cli.main` in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.data.ingest import BUNDLED
from privacy import lifetime_budget
from privacy.ledger import Ledger

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
# The JVM of a command that starts Spark is tuned for a short life, as these commands' are: the client
# compiler only and the serial collector (about a third off its start; unless SPARK_SUBMIT_OPTS is set).
# Spark's error texts, and how the command ends, do not depend on them.
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def child_env() -> dict:
    """The environment of an `ssp` child: this test's (its budget-account registry), with SHORT_LIVED_JVM."""
    return {**os.environ, "SPARK_SUBMIT_OPTS": os.environ.get("SPARK_SUBMIT_OPTS") or SHORT_LIVED_JVM}


def ssp(*args, fsize: int | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the installed `ssp`; `fsize` bytes is the child's file-size limit (ulimit -f)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [SSP, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        preexec_fn=limit if fsize is not None else None,
    )


def assert_refused(result: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, and one error line, the last, naming each of `names` (the run's progress
    lines may come before it); returns the line."""
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ssp ") and ": error: " in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    for name in names:
        assert str(name) in errors[0], (name, errors[0])
    return errors[0]


def java_stack_lines(result: subprocess.CompletedProcess) -> int:
    return sum(line.startswith("\tat ") for line in result.stderr.splitlines())


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (hidden ones included) with the digest of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def kib_on_tmpfs(folder: Path) -> int:
    """What the files under `folder` take on a tmpfs: whole 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4 for p in folder.rglob("*") if p.is_file())


def leftovers(folder: Path) -> list[str]:
    """Staging folders, temporary files and locks anywhere under `folder`."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp-" in p.name or p.name.endswith(".lock")
    )


def movielens_copy(folder: Path, ratings_rows: int | None = None) -> Path:
    """The bundled ml-latest-small, copied to be damaged (optionally its first `ratings_rows` ratings only)."""
    shutil.copytree(BUNDLED, folder)
    if ratings_rows is not None:
        lines = (folder / "ratings.csv").read_text().splitlines(keepends=True)
        (folder / "ratings.csv").write_text("".join(lines[: ratings_rows + 1]))
    return folder


def in_process(*args) -> None:
    """`ssp args` through `ssp.cli.main`, the function the command runs, for what sets the stage of a
    case (an `ssp` process costs ~1.5 s): the data sets and runs below, an earlier data set."""
    from ssp import cli

    assert cli.main([*map(str, args)]) == 0


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "ds"
    in_process("ingest", "--out", out)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, dataset) -> Path:
    """A run whose first stage is done (split, DP counts and mean released), for the stage commands."""
    run = tmp_path_factory.mktemp("hostile-run") / "run"
    in_process("train", "--data", dataset, "--out", run, "--epsilon", 5, "--stage", "prepare")
    return run


def test_the_plan_is_the_runs_before_anything_is_read_or_spent(tmp_path, dataset, prepared):
    """`ssp train --plan` with the prepared run's flags prints the noise multipliers its ledger
    recorded and the N/S it logged, writes nothing and charges no account; bad settings are refused
    in one line as the run refuses them."""
    registry = Path(lifetime_budget.accounts_home())
    accounts = sorted(p.name for p in registry.rglob("*"))
    result = ssp("train", "--data", dataset, "--out", tmp_path / "run", "--epsilon", 5, "--plan")
    assert result.returncode == 0 and not (tmp_path / "run").exists(), result.stderr[-3000:]
    budget = Ledger.open(str(prepared / "ledger.parquet")).budget
    for name in ("counts", "mean", "stats"):
        assert f"| {name} | " in result.stdout and f" | {budget['multipliers'][name]:.4g} | " in result.stdout, (
            name,
            result.stdout,
        )
    assert "m = 9742 catalog items" in result.stdout and "N/S = " in result.stdout
    assert result.stdout.startswith("plan (nothing read but the catalog's size, nothing spent)")
    alone = ssp("train", "--epsilon", 5, "--plan")
    assert alone.returncode == 0 and alone.stdout.startswith("plan (no data set read (no --data: no catalog size)")
    assert "catalog items" not in alone.stdout
    assert sorted(p.name for p in registry.rglob("*")) == accounts  # no account made or charged
    assert_refused(ssp("train", "--plan", "--epsilon", -1), "epsilon")


def copy_of(path: Path, target: Path) -> Path:
    shutil.copytree(path, target)
    return target


# --- outputs that cannot be written --------------------------------------------------------------


def test_output_paths_that_are_files_are_refused_and_left_as_they_were(tmp_path, dataset, prepared):
    occupied = tmp_path / "occupied"
    occupied.write_text("keep me")
    for args, flag in (
        (["ingest", "--out", occupied], "--out"),
        (["train", "--data", dataset, "--out", occupied], "--out"),
        (["publish", "--run", prepared, "--to", occupied], "--to"),
        (["split", "--data", dataset, "--protocol", "rmse", "--out", occupied], "--out"),
        (
            [
                "counts",
                "--interactions",
                dataset / "interactions.parquet",
                "--items",
                dataset / "items.parquet",
                "--out",
                occupied,
                "--epsilon",
                1,
            ],
            "--out",
        ),
    ):
        assert_refused(ssp(*args), flag, occupied, "is a file")
        assert occupied.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]


def _mount(*args: str) -> subprocess.CompletedProcess:
    """`mount ARGS`; a machine without the command answers like one that does not permit it."""
    try:
        return subprocess.run(["mount", *args], capture_output=True, text=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(["mount"], 127, "", "no mount command")


REQUIRE_MOUNTS = "SSP_TESTS_REQUIRE_MOUNTS"  # set to 1 where the full-disk and read-only tests must run


def _cannot_mount(what: str, done: subprocess.CompletedProcess) -> None:
    """A machine that may not mount (not root, or a container without CAP_SYS_ADMIN) cannot run a test
    on a real full disk or read-only file system: it is skipped with the reason (`-ra` lists it), or
    fails where $SSP_TESTS_REQUIRE_MOUNTS=1 says this machine must run it (root here: it mounts)."""
    reason = f"cannot {what} here ({done.stderr.strip() or 'not permitted'}): run as root to test it"
    if os.environ.get(REQUIRE_MOUNTS) == "1":
        pytest.fail(f"{reason}, as ${REQUIRE_MOUNTS}=1 requires")
    pytest.skip(reason)


@pytest.fixture
def small_disk(tmp_path):
    """A factory of small tmpfs folders (a full disk for real); skipped where mounting is not allowed."""
    mounted = []

    def make(size_kib: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder))
        if done.returncode:
            _cannot_mount("mount a small tmpfs to fill a disk for real", done)
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def read_only(tmp_path):
    """A folder on a read-only mount (a read-only bind of a tmp folder); skipped where not allowed."""
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "before").write_text("x")
    done = _mount("--bind", "-o", "ro", str(folder), str(folder))
    if done.returncode:
        _cannot_mount("make a read-only bind mount", done)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_read_only_output_is_refused_in_one_line(read_only, dataset):
    assert_refused(ssp("ingest", "--out", read_only / "ds"), "Read-only file system", read_only / "ds")
    assert_refused(
        ssp("train", "--data", dataset, "--out", read_only / "run", "--epsilon", 5),
        "Read-only file system",
        read_only / "run",
    )
    assert sorted(p.name for p in read_only.iterdir()) == ["before"]


def test_a_failed_reingest_on_a_full_disk_keeps_the_earlier_data_set_whole(small_disk, dataset, tmp_path):
    small = movielens_copy(tmp_path / "small", ratings_rows=3000)
    in_process("ingest", "--source", small, "--out", tmp_path / "probe")
    disk = small_disk(
        kib_on_tmpfs(tmp_path / "probe") + kib_on_tmpfs(dataset) // 2
    )  # room for a data set of a few thousand ratings and half the bundled one, not for both
    in_process("ingest", "--source", small, "--out", disk / "ds")
    before = snapshot(disk / "ds")
    assert_refused(
        ssp("ingest", "--out", disk / "ds"), "No space left on device", disk / "ds"
    )  # the whole bundled set does not fit
    assert snapshot(disk / "ds") == before and leftovers(disk) == []
    assert (
        ssp(
            "split", "--data", disk / "ds", "--protocol", "rmse", "--out", tmp_path / "split", "--engine", "local"
        ).returncode
        == 0
    )  # still a data set


def test_a_full_disk_during_training_is_one_line_and_the_ledger_stays_readable(small_disk, dataset):
    disk = small_disk(2500)  # the run's first tables fit, the ingested copy and the rest do not
    result = ssp("train", "--data", dataset, "--out", disk / "run", "--epsilon", 5)
    assert_refused(result, "No space left on device")
    if (
        disk / "run" / "ledger.parquet"
    ).exists():  # refused after a release: the run and its ledger stay, and they are consistent
        assert ssp("privacy", disk / "run", "--max-epsilon", 5).returncode == 0
    else:
        assert not (disk / "run").exists()


def test_a_file_size_limit_is_one_line_and_the_earlier_data_set_stays_whole(tmp_path):
    out = tmp_path / "ds"
    small = movielens_copy(tmp_path / "small", ratings_rows=2000)
    in_process("ingest", "--source", small, "--out", out)
    before = snapshot(out)
    assert_refused(ssp("ingest", "--out", out, fsize=200_000), "File too large")
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.spark  # an `ssp` that starts Spark (the default engine)
def test_a_file_size_limit_inside_a_spark_job_is_one_line(tmp_path, prepared):
    run = copy_of(prepared, tmp_path / "run")
    result = ssp(
        "user-update", "--run", run, "--step", 1, fsize=20_000
    )  # too small for the broadcast of the item embeddings
    assert_refused(result, "File too large")
    assert java_stack_lines(result) == 0
    assert not (run / "private" / "step-1" / "user_embeddings.parquet").exists()


# --- damaged inputs ------------------------------------------------------------------------------


@pytest.mark.spark  # an `ssp` that starts Spark (the default engine)
def test_a_truncated_part_read_by_spark_is_one_line_naming_it(tmp_path, prepared):
    run = copy_of(prepared, tmp_path / "run")
    part = next((run / "private" / "train_centred.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:5000])
    result = ssp("user-update", "--run", run, "--step", 1)
    assert_refused(result, part.name)
    assert java_stack_lines(result) == 0
    assert (
        "incubator modules" not in result.stderr
    )  # the JDK's notice on every Spark 4 start: dropped (pipelines.engines.spark)


@pytest.mark.parametrize(
    "engine, problem", [("local", "cannot be read as Parquet"), ("spark", "cannot be read as Parquet")]
)
def test_a_truncated_part_is_one_line_naming_it(tmp_path, dataset, engine, problem):
    """Read by Arrow in this process, or by the Spark driver's look at each file's footer (whether
    its files hold whole users) before Spark reads them: either way one line naming the part. (A
    part Spark's own reader finds truncated: test_a_truncated_part_read_by_spark_is_one_line_naming_it.)"""
    data = copy_of(dataset, tmp_path / "ds")
    part = next((data / "interactions.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:100_000])
    assert_refused(
        ssp("split", "--data", data, "--protocol", "rmse", "--out", tmp_path / "split", "--engine", engine),
        part,
        problem,
    )
    assert not (tmp_path / "split").exists()


@pytest.mark.parametrize(
    "marker, problem",
    [
        (
            {"rows": 1, "files": ["part-00000.parquet", "part-00007.parquet"]},
            "lists part-00007.parquet, which is missing",
        ),
        ("not json {", "is not the list of its files"),
    ],
    ids=["missing part", "not JSON"],
)
def test_a_damaged_success_marker_is_refused_naming_the_table(tmp_path, dataset, marker, problem):
    data = copy_of(dataset, tmp_path / "ds")
    (data / "interactions.parquet" / "_SUCCESS").write_text(marker if isinstance(marker, str) else json.dumps(marker))
    assert_refused(
        ssp("train", "--data", data, "--out", tmp_path / "run", "--epsilon", 5), data / "interactions.parquet", problem
    )
    assert not (tmp_path / "run").exists()


def test_a_seed_file_that_is_not_json_is_named_and_does_not_poison_the_run_folder(tmp_path, dataset):
    seed = tmp_path / "seed.json"
    seed.write_text("{not json")
    run = tmp_path / "run"
    assert_refused(
        ssp("train", "--data", dataset, "--out", run, "--seed-file", seed, "--epsilon", 5, "--stage", "prepare"), seed
    )
    assert not run.exists()
    run.mkdir()  # a folder made beforehand (by a scheduler) is left empty, not holding a half run
    assert_refused(
        ssp("train", "--data", dataset, "--out", run, "--seed-file", seed, "--epsilon", 5, "--stage", "prepare"), seed
    )
    assert list(run.iterdir()) == []


def test_wrong_headers_exit_cleanly_every_time(tmp_path):
    """Once, 5 runs in 10 printed the right line and then aborted at exit (status 134)."""
    source = movielens_copy(tmp_path / "src", ratings_rows=50)
    lines = (source / "ratings.csv").read_text().splitlines(keepends=True)
    (source / "ratings.csv").write_text("userId,movieId,rating,stamp\n" + "".join(lines[1:]))
    for _ in range(6):
        assert_refused(ssp("ingest", "--source", source, "--out", tmp_path / "ds"), source / "ratings.csv", "line 1")
    assert not (tmp_path / "ds").exists()


def test_one_stray_latin1_byte_is_refused_at_its_line(tmp_path):
    source = movielens_copy(tmp_path / "src", ratings_rows=50)
    raw = (source / "movies.csv").read_bytes().split(b"\n")
    raw[7] = raw[7].replace(b"(", b"\xe9(", 1)
    (source / "movies.csv").write_bytes(b"\n".join(raw))
    assert_refused(ssp("ingest", "--source", source, "--out", tmp_path / "ds"), source / "movies.csv", "line 8", "0xe9")
    assert not (tmp_path / "ds").exists()


def test_a_200k_character_field_is_refused_at_its_line(tmp_path):
    source = movielens_copy(tmp_path / "src", ratings_rows=50)
    lines = (source / "movies.csv").read_text().split("\n")
    lines[5] = f'5,"{"x" * 200_000} (1995)",Comedy'
    (source / "movies.csv").write_text("\n".join(lines))
    assert_refused(ssp("ingest", "--source", source, "--out", tmp_path / "ds"), source / "movies.csv", "line 6")
    assert not (tmp_path / "ds").exists()


# --- ratings on another scale --------------------------------------------------------------------


def test_ratings_outside_the_scale_are_refused_at_ingest_and_another_scale_is_declared(tmp_path):
    source = movielens_copy(tmp_path / "src", ratings_rows=400)
    lines = (source / "ratings.csv").read_text().splitlines(keepends=True)
    user, movie, _, stamp = lines[300].strip().split(",")
    lines[300] = f"{user},{movie},10,{stamp}\n"
    (source / "ratings.csv").write_text("".join(lines))
    assert_refused(
        ssp("ingest", "--source", source, "--out", tmp_path / "ds"),
        source / "ratings.csv",
        "line 301",
        "0.5..5",
        "--rating-scale",
    )
    tenfold = [lines[0]] + [
        ",".join([*line.split(",")[:2], f"{float(line.split(',')[2]) * 100:g}", line.split(",")[3]])
        for line in lines[1:]
    ]
    (source / "ratings.csv").write_text("".join(tenfold))  # a data set rated 50..500 (the 10 became 1000: cut it)
    (source / "ratings.csv").write_text("".join(line for line in tenfold if ",1000," not in line))
    result = ssp("ingest", "--source", source, "--out", tmp_path / "ds", "--rating-scale", 50, 500)
    assert result.returncode == 0 and "scale 50 .. 500" in result.stdout, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert (
        manifest["rating_scale"] == [50, 500] and 50 <= manifest["label_range"][0] <= manifest["label_range"][1] <= 500
    )
    run = tmp_path / "run"
    result = ssp("train", "--data", tmp_path / "ds", "--out", run, "--epsilon", 5, "--rating-max", 5)
    assert_refused(result, "--rating-min/--rating-max 50..5", "50..500")
    assert not run.exists()


def test_a_data_set_without_a_declared_scale_is_checked_against_the_runs_range(tmp_path, dataset):
    data = copy_of(dataset, tmp_path / "ds")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest.pop("rating_scale", None)
    manifest["label_range"] = [50.0, 500.0]  # what write_dataset records of a table rated 50..500 by another tool
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(
        ssp("train", "--data", data, "--out", tmp_path / "run", "--epsilon", 5),
        "50..500",
        "0.5..5",
        "--rating-min/--rating-max",
    )
    assert not (tmp_path / "run").exists()


# --- what earlier failures left behind ------------------------------------------------------------


def test_a_successful_write_removes_the_staging_that_killed_writes_left(tmp_path):
    source = movielens_copy(tmp_path / "src", ratings_rows=500)
    out = tmp_path / "ds"
    in_process("ingest", "--source", source, "--out", out)
    (out / ".interactions.parquet.tmp-0123").mkdir()
    (out / ".interactions.parquet.tmp-0123" / "part-00000.parquet").write_bytes(b"half")
    (out / "manifest.json.tmp-4567").write_text("{")
    assert ssp("ingest", "--source", source, "--out", out).returncode == 0
    assert leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == [
        ".ssp-private",  # the data set folder is its owner's alone (it holds the interactions)
        "interactions.parquet",
        "items.parquet",
        "manifest.json",
    ]


def test_a_truncated_part_read_by_beam_is_one_line_naming_it(tmp_path, prepared):
    """The stats job on Beam, over the run's rows with a truncated part. Its user embeddings are any
    valid table of those users (written here: a Spark user update would only add a JVM's start)."""
    import numpy as np
    import pyarrow as pa

    from schemas import storage
    from schemas.tables import USER_EMBEDDINGS

    run = copy_of(prepared, tmp_path / "run")
    users = np.unique(
        storage.read_table(str(run / "private" / "stats_rows.parquet"), columns=["user_id"])["user_id"].to_numpy()
    )
    storage.write_table(
        pa.table({"user_id": users, "embedding": [[0.1] * 8] * users.size}, schema=USER_EMBEDDINGS),
        str(run / "private" / "step-1" / "user_embeddings.parquet"),
    )
    rows = copy_of(run / "private" / "stats_rows.parquet", tmp_path / "rows.parquet")
    part = next(rows.glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:3000])
    result = ssp(
        "stats",
        "--engine",
        "beam",
        "--interactions",
        rows,
        "--user-embeddings",
        run / "private" / "step-1" / "user_embeddings.parquet",
        "--items",
        run / "train_items.parquet",
        "--counts",
        run / "counts" / "counts.parquet",
        "--out",
        tmp_path / "stats",
        "--dim",
        8,
        "--clip-u",
        1,
        "--clip-y",
        2,
        "--noise-multiplier",
        1,
        "--ledger",
        tmp_path / "ledger.parquet",
    )
    assert_refused(result, part, "cannot be read as Parquet")
    assert not (tmp_path / "stats").exists() and not (tmp_path / "ledger.parquet").exists()


def test_a_failed_ingest_into_a_new_folder_leaves_no_folder(tmp_path):
    assert_refused(ssp("ingest", "--out", tmp_path / "new", fsize=200_000), "File too large")
    assert not (tmp_path / "new").exists()


def test_ingest_into_a_run_or_any_other_folder_is_refused_and_a_data_set_is_replaced(tmp_path, dataset, prepared):
    """`ssp ingest --out` a run folder would write the private log beside the run's private/ and
    replace its manifest: refused before any work, as is a folder of other files; an earlier data set
    is replaced whole (tested with the synthetic generator, the quickest writer)."""
    run = copy_of(prepared, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for out in (run, other):
        assert_refused(ssp("ingest", "--out", out), "--out", out, "holds something other than a data set")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and sorted(
        p.name for p in other.iterdir()
    ) == ["notes.txt"]
    assert_refused(
        ssp("synth", "--like", "movielens", "--users", 50, "--out", run), "holds something other than a data set"
    )
    replaced = copy_of(dataset, tmp_path / "ds")
    assert ssp("synth", "--like", "movielens", "--users", 50, "--out", replaced).returncode == 0
    assert json.loads((replaced / "manifest.json").read_text())["users"] == 50


def test_a_bad_feature_column_is_one_line_naming_the_row_and_leaves_no_data_set(tmp_path):
    """A CSV value column holding several values (declare it a bag), and a number column holding
    text: one line naming the file, the row and the column; nothing written."""
    (tmp_path / "clicks.csv").write_text("customer,sku\n1,10\n2,20\n")
    for catalog, spec, named in (
        ("sku,tags\n10,red\n20,red|blue\n", "tags:value", ("row 2", "'tags'", "tags:bag")),
        ("sku,price\n10,9.99\n20,ask us\n", "price:number", ("row 2", "'price'", "'ask us'", "not a number")),
    ):
        (tmp_path / "catalog.csv").write_text(catalog)
        assert_refused(
            ssp(
                "ingest",
                "--interactions",
                tmp_path / "clicks.csv",
                "--catalog",
                tmp_path / "catalog.csv",
                "--user-col",
                "customer",
                "--item-col",
                "sku",
                "--features",
                spec,
                "--out",
                tmp_path / "data",
            ),
            tmp_path / "catalog.csv",
            *named,
        )
        assert not (tmp_path / "data").exists()


def test_a_bad_play_count_is_one_line_naming_the_row_and_leaves_no_data_set(tmp_path):
    (tmp_path / "plays.csv").write_text("listener,sku,plays\n1,10,3\n2,20,0\n")
    (tmp_path / "catalog.csv").write_text("sku\n10\n20\n")
    flags = ["--catalog", tmp_path / "catalog.csv", "--item-col", "sku", "--features", "", "--out", tmp_path / "data"]
    result = ssp(
        "ingest", "--interactions", tmp_path / "plays.csv", "--user-col", "listener", "--count-col", "plays", *flags
    )
    assert_refused(result, tmp_path / "plays.csv", "row 2", "'plays'", "a count must be a number >= 1")
    assert not (tmp_path / "data").exists()


def test_an_empty_output_path_is_refused(tmp_path):
    assert_refused(ssp("ingest", "--out", ""), "--out is empty")


def test_publishing_inside_the_run_directory_is_refused(tmp_path, prepared):
    run = copy_of(prepared, tmp_path / "run")
    for dest in (run / "private" / "pub", run / "pub"):
        assert_refused(ssp("publish", "--run", run, "--to", dest), "inside the run directory")
        assert not dest.exists()


MANIFEST_DAMAGES = {
    "no config": (lambda m: m.pop("config"), "has no settings"),
    "null setting": (lambda m: m["config"].update(epochs=None), "epochs must be int"),
    "wrong type": (lambda m: m["config"].update(dim="four"), "dim must be int"),
    "out of range": (lambda m: m["config"].update(dim=0), "--dim"),
    "steps not a list": (lambda m: m.update(steps_done="x"), "steps_done"),
}
# Every stage command reads the manifest through the same checks (run_dir.Run.read_manifest, .prepared).
# `ssp user-update --run` reads steps_done before it starts Spark (the run's lock), the settings only
# once its session has started: those cases run with `-m slow`, and by default `ssp stats --run`, which
# reads them before its engine starts, is refused for each of them.
MANIFEST_CASES = [
    pytest.param(
        "user-update",
        damage,
        named,
        id=f"user-update: {name}",
        marks=() if name == "steps not a list" else pytest.mark.slow,
    )
    for name, (damage, named) in MANIFEST_DAMAGES.items()
]
MANIFEST_CASES += [
    pytest.param("stats", damage, named, id=f"stats: {name}")
    for name, (damage, named) in MANIFEST_DAMAGES.items()
    if name != "steps not a list"
]


@pytest.mark.parametrize("command, damage, named", MANIFEST_CASES)
def test_a_damaged_run_manifest_is_refused_naming_it(tmp_path, prepared, command, damage, named):
    run = copy_of(prepared, tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    damage(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(ssp(command, "--run", run, "--step", 1), run / "manifest.json", named)
    assert not (run / "private" / "step-1").exists() and not (run / "step-1").exists()


def stopped(args: list, after: str, log: Path, interrupt: bool = False) -> subprocess.CompletedProcess:
    """`ssp ARGS`, sent SIGTERM (a scheduler stopping the task), or SIGINT (Ctrl-C) with `interrupt`,
    once `after` shows in its stderr; it must end with one line, exit 143 (130) and no traceback.
    Returns its result (stderr from `log`)."""
    import signal
    import time

    with open(log, "w") as err:
        child = subprocess.Popen(
            [SSP, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err, text=True, env=child_env()
        )
        deadline = time.monotonic() + 300
        while after not in log.read_text() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGINT if interrupt else signal.SIGTERM)
        child.wait(timeout=300)
    result = subprocess.CompletedProcess(child.args, child.returncode, "", log.read_text())
    assert (
        child.returncode == (130 if interrupt else 143)
        and "Traceback" not in result.stderr
        and "py4j" not in result.stderr
    ), result.stderr[-3000:]
    word = "interrupted" if interrupt else "terminated"
    assert result.stderr.strip().splitlines()[-1].startswith(f"ssp {args[0]}: {word}; nothing partial was published"), (
        result.stderr[-3000:]
    )
    return result


@pytest.mark.spark  # an `ssp` that starts Spark (the default engine)
def test_ctrl_c_in_a_spark_job_is_the_promised_line_alone(tmp_path, prepared):
    """Ctrl-C while the statistics' Spark job runs (a gateway call in flight): the one line, no py4j
    or Java trace; the same command resumes."""
    run = copy_of(prepared, tmp_path / "run")
    args = [
        "train",
        "--data",
        json.loads((run / "manifest.json").read_text())["config"]["data"],
        "--out",
        run,
        "--epsilon",
        5,
    ]  # the prepared run's settings
    result = stopped(args, "user update:", tmp_path / "stderr", interrupt=True)
    assert java_stack_lines(result) == 0


@pytest.mark.slow  # two Spark sessions and a whole training (~50 s): its fast twin is the case below
def test_sigterm_unwinds_like_ctrl_c_and_the_run_resumes(tmp_path, dataset):
    """A scheduler stopping the task: one line, exit 143, no traceback; the same command resumes.
    Stopped in its Spark stages (once prepared)."""
    args = ["train", "--data", dataset, "--out", tmp_path / "run", "--epsilon", 5, "--outer-steps", 1, "--dim", 4]
    stopped(args, "prepared", tmp_path / "stderr")
    assert ssp(*args).returncode == 0


def test_sigterm_in_the_first_stage_unwinds_like_ctrl_c_and_the_run_resumes(tmp_path):
    """The fast twin of the case above, without Spark: `ssp train --stage prepare` (a scheduler's
    first task) on the bundled MovieLens folder, stopped once it has ingested the ratings (seconds of
    work are left: the split, the releases, the initial encoder; the ingest's progress bar has ended
    its line); the same command resumes and prepares the run."""
    run = tmp_path / "run"
    args = [
        "train",
        "--stage",
        "prepare",
        "--data",
        BUNDLED,
        "--out",
        run,
        "--epsilon",
        5,
        "--outer-steps",
        1,
        "--dim",
        4,
    ]
    stopped(args, "ratings/s]\n", tmp_path / "stderr")
    assert ssp(*args).returncode == 0
    assert "prepared" in json.loads((run / "manifest.json").read_text())


def test_the_own_data_paths_refuse_bad_input_in_one_line(tmp_path):
    """`ssp ingest` of generic tables and `ssp recommend`, through the installed binary: a missing
    column, a table that is not there, a folder that is not a publication. Nothing is written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"customer": [1, 2], "product": [10, 10]}), tmp_path / "clicks.parquet")
    pq.write_table(pa.table({"product": [10], "brand": ["acme"]}), tmp_path / "products.parquet")
    flags = [
        "--interactions",
        tmp_path / "clicks.parquet",
        "--catalog",
        tmp_path / "products.parquet",
        "--features",
        "brand:value",
        "--out",
        tmp_path / "data",
    ]
    assert_refused(
        ssp("ingest", *flags), "products.parquet", "'item_id'", "product, brand"
    )  # --item-col not given: the default column is missing
    named = ["--user-col", "customer", "--item-col", "product"]
    assert_refused(ssp("ingest", *flags[:1], tmp_path / "nowhere.parquet", *flags[2:], *named), "nowhere.parquet")
    assert (
        ssp("ingest", *flags, *named).returncode == 0 and (tmp_path / "data" / "manifest.json").exists()
    )  # the same tables, columns named
    shutil.rmtree(tmp_path / "data")
    assert not (tmp_path / "data").exists()
    (tmp_path / "history.csv").write_text("user_id,item_id\n1,10\n")
    assert_refused(
        ssp("recommend", "--model", tmp_path, "--history", tmp_path / "history.csv"), "is not a complete publication"
    )
    from tests.trainer.test_recommend import publication

    model = publication(tmp_path / "published")
    assert_refused(
        ssp("recommend", "--model", model, "--history", tmp_path / "missing.csv"), "missing.csv", "does not exist"
    )
    assert_refused(
        ssp("recommend", "--model", model, "--history", tmp_path / "history.csv"), "needs a label column"
    )  # a model of ratings
    assert_refused(
        ssp("recommend", "--model", model, "--history", tmp_path / "clicks.parquet"),
        "clicks.parquet has no 'user_id' column (columns: customer, product)",
        "--user-col",
    )


def test_an_ingest_killed_before_its_manifest_is_resumed_not_refused(tmp_path):
    """A data set folder a killed write left (its tables or their staging, no manifest yet) is a
    data set's leftovers: the next ingest into it replaces them; a folder with other files is refused."""
    out = tmp_path / "ds"
    (out / ".interactions.parquet.tmp-0123").mkdir(parents=True)
    (out / "items.parquet").mkdir()
    (out / ".ssp-private").touch()  # the mark every data set write makes first (storage.make_private_folder)
    assert (
        ssp("ingest", "--out", out).returncode == 0 and json.loads((out / "manifest.json").read_text())["ratings"] > 0
    )
    (tmp_path / "other" / "notes.txt").parent.mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert_refused(ssp("ingest", "--out", tmp_path / "other"), "holds something other than a data set")


def test_an_internal_error_inside_a_stage_is_a_bug_with_its_traceback_reachable(tmp_path):
    """A failure that is no refusal of the project's (a planted KeyError inside the prepare stage):
    one line that calls it a bug and says where its traceback is, exit status 3 (a refusal's is 2);
    with -v the traceback itself. Nothing is left: it failed before any release."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import pipelines.training.prepare as stage\n\n\ndef broken(*args, **kwargs):\n"
        "    raise KeyError('planted')\n\n\nstage.rating_range = broken\n"
    )
    env = {**child_env(), "PYTHONPATH": str(hook)}
    args = [
        SSP,
        "train",
        "--stage",
        "prepare",
        "--data",
        BUNDLED,
        "--out",
        str(tmp_path / "run"),
        "--epsilon",
        "5",
        "--outer-steps",
        "1",
        "--dim",
        "4",
    ]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    prefix = (
        "ssp train: internal error (a bug, not a problem with the input): KeyError: 'planted'; its traceback is in "
    )
    assert last.startswith(prefix) and last.endswith(" (-v prints it)"), last
    saved = open(last[len(prefix) : -len(" (-v prints it)")]).read()
    assert "Traceback (most recent call last)" in saved and "in broken" in saved and "KeyError: 'planted'" in saved
    assert not (tmp_path / "run").exists()
    verbose = subprocess.run([*args, "-v"], env=env, capture_output=True, text=True, timeout=300)
    assert (
        verbose.returncode == 3
        and "Traceback (most recent call last)" in verbose.stderr
        and "in broken" in verbose.stderr
    )
    assert verbose.stderr.strip().splitlines()[-1].endswith("KeyError: 'planted'; its traceback is above")
