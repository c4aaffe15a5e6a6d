"""kill -9 at random moments of `ssp train`, then resume: the run stays consistent and spends its budget once.

README ("A killed run started again with the same flags resumes after its last completed outer step;
its releases are not spent twice"; "readers never see half a table") promises this for any moment
of the run, so this test draws the moments at random. A tiny synthetic data set is trained once
without interruption (its wall time T and its ledger are the reference). Then the same command is
started in a fresh run directory and its whole process group (the CLI, Spark's JVM and Python
workers) is sent SIGKILL after a delay drawn uniformly from (0, T), three times, each time
restarting the same command; a last start runs to completion. After every kill:

- the ledger, if the kill left one, passes `ssp privacy RUN --max-epsilon E --max-delta D` (the
  seed file's witness list agrees with it, every release is charged to the budget account, and the
  epsilon spent is within the target); a kill before the first release may leave no ledger at all;
- every release whose output is visible (the DP counts, a step's statistics) is in the ledger:
  a release is recorded before it is computed;
- no half-written table or document is visible: every `*.parquet` folder holds a `_SUCCESS` marker
  whose listed part files pyarrow reads with the row count it states (hidden `.NAME.tmp-*` staging
  folders are allowed to be left behind), every model folder is marked complete, and every
  `*.parquet` file and JSON document parses.

The last start must exit 0 and write metrics.json, and its ledger must be the reference's: the same
releases, in the same order, with the same events, so the same epsilon (nothing spent twice); the
data source's budget account is charged once for each of them.

The seed of the kill moments is printed in every failure; `SSP_KILL_SEED=N` reruns with another.

(`ssp privacy` runs through its entry point in this test's process: it checks the ledger; the
process under test is the killed `ssp train`.)

The whole training run (Spark's start included, about 4 T in all) is marked slow (`-m slow`). Its
twin in the default run does the same to the prepare stage alone (`ssp train --stage prepare`, which
makes the DP counts and mean releases, their tables and the ledger without starting Spark, a few
seconds): the same kills of its process group at random moments, the same checks after every kill,
and the same last start compared with an uninterrupted one (its ledger, its spend, the account's
charges); what it checks instead of metrics.json is that the run is prepared and made the stage's
two releases. Its moments are drawn where the stage works (see the test), not in its interpreter's
start, which is a large share of so short a run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.training.publish import TOLERANCE
from pipelines.training.run_dir import Run
from privacy.ledger import Ledger
from privacy.lifetime_budget import BudgetAccount
from ssp import cli

SSP = os.path.join(sys.prefix, "bin", "ssp")
EPSILON, DELTA = 5.0, 1e-5
# The fastest full run that still makes several releases (counts, mean, one statistics release per
# outer step) and has an outer step to resume after: about 40 s on an idle 2-core machine, most of
# it Spark's start and first job; the whole test takes about 4 T.
TRAIN_FLAGS = [
    "--epsilon",
    str(EPSILON),
    "--delta",
    str(DELTA),
    "--outer-steps",
    "2",
    "--epochs",
    "1",
    "--dim",
    "4",
    "--shards",
    "1",
]
KILLS = 3
SEED = int(os.environ.get("SSP_KILL_SEED", "20261127"))
RUN_TIMEOUT = 300  # seconds for a whole run, far above T: only a hung run hits it
PREPARE = ("--stage", "prepare")  # the fast twin's command: the first stage alone


def _tail(log: Path, chars: int = 3000) -> str:
    text = log.read_text(errors="replace") if log.exists() else "(no output)"
    return text[-chars:]


def _start_train(data: Path, run: Path, log: Path, stage: tuple[str, ...] = ()) -> subprocess.Popen:
    """`ssp train` (with `stage`: `--stage prepare`) as its own process group (Spark's JVM is its
    child), its output in `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [SSP, "train", "--data", str(data), "--out", str(run), *TRAIN_FLAGS, *stage],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # a killed run's log keeps its last lines


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and wait until none of its processes is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of group {proc.pid} survived SIGKILL for 30 s")
        time.sleep(0.1)


def _run_to_end(data: Path, run: Path, log: Path, stage: tuple[str, ...] = ()) -> tuple[int, float, float | None]:
    """(exit status, wall seconds, seconds until the run folder appeared: None if it was there before)
    of an uninterrupted `ssp train`."""
    started = time.monotonic()
    existed, appeared = run.exists(), None
    proc = _start_train(data, run, log, stage)
    try:
        while proc.poll() is None:
            if appeared is None and not existed and run.exists():
                appeared = time.monotonic() - started
            if time.monotonic() - started > RUN_TIMEOUT:
                raise subprocess.TimeoutExpired(proc.args, RUN_TIMEOUT)
            time.sleep(0.02)
        status = proc.returncode
    finally:
        _kill_group(proc)
    return status, time.monotonic() - started, appeared


def _staging(name: str) -> bool:
    """A hidden staging folder (`.NAME.tmp-*`) a killed write may leave: not a visible table."""
    return name.startswith(".") and ".tmp-" in name


def _check_table_folder(folder: Path) -> list[str]:
    marker = folder / "_SUCCESS"
    if not marker.is_file():
        return [
            f"{folder}: a table folder without a _SUCCESS marker (half a table is visible); it holds "
            f"{sorted(os.listdir(folder))}"
        ]
    try:
        document = json.loads(marker.read_bytes())
        files, rows = document["files"], document["rows"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{marker}: not a marker {{rows, files}} ({exc!r}): {marker.read_bytes()[:200]!r}"]
    try:
        read = sum(pq.read_table(folder / name).num_rows for name in files)
    except Exception as exc:  # noqa: BLE001 - any read failure is the finding
        return [f"{folder}: a part file its marker lists is unreadable: {exc!r}"]
    return [] if read == rows else [f"{folder}: its marker says {rows} rows, its parts hold {read}"]


def _check_model_folder(folder: Path) -> list[str]:
    marker = folder / "_SUCCESS"
    if not marker.is_file():
        return [f"{folder}: a model folder without a _SUCCESS marker; it holds {sorted(os.listdir(folder))}"]
    missing = [name for name in json.loads(marker.read_bytes())["files"] if not (folder / name).is_file()]
    return [f"{folder}: its marker lists files that are missing: {missing}"] if missing else []


def _visible_damage(run: Path) -> list[str]:
    """What a reader of the run directory would find half written (see the module docstring)."""
    problems = []
    for top, dirs, files in os.walk(run):
        top = Path(top)
        dirs[:] = [d for d in dirs if not _staging(d)]
        if top.name.endswith(".parquet"):  # a table folder: checked whole, its parts are not tables of their own
            problems += _check_table_folder(top)
            dirs[:] = []
            continue
        if top.name in ("checkpoint", "encoder"):  # TensorFlow folders, committed like tables
            problems += _check_model_folder(top)
            dirs[:] = []
            continue
        for name in files:
            path = top / name
            try:
                if name.endswith(".parquet"):
                    pq.read_table(path)
                elif name.endswith(".json") or name == "seed":
                    json.loads(path.read_bytes())
            except Exception as exc:  # noqa: BLE001 - any read failure is the finding
                problems.append(f"{path}: unreadable after the kill: {exc!r}")
    return problems


def _committed(folder: Path) -> bool:
    return (folder / "_SUCCESS").is_file()


def _ledger_problems(run: Path) -> list[str]:
    """The ledger checked by `ssp privacy` with the run's limits, and against the releases whose outputs are visible."""
    ledger_path = run / "ledger.parquet"
    released = {"counts": _committed(run / "counts" / "counts.parquet")}
    released.update(
        {f"{step.name}/stats/r0": _committed(step / "stats" / "resample-0.parquet") for step in run.glob("step-*")}
    )
    if not ledger_path.exists():
        made = [name for name, visible in released.items() if visible]
        return [f"no ledger, but the outputs of releases {made} are visible"] if made else []
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):  # `ssp privacy`, through its entry point in this process
        status = cli.main(["privacy", str(run), "--max-epsilon", str(EPSILON), "--max-delta", str(DELTA)])
    if status != 0:
        return [f"`ssp privacy` exited {status}:\n{stdout.getvalue()}{stderr.getvalue()}"]
    problems = []
    ledger = Ledger.open(str(ledger_path))
    spent, names = ledger.epsilon_spent(), [row["name"] for row in ledger.rows]
    if not spent <= EPSILON * (1 + TOLERANCE):
        problems.append(f"epsilon spent {spent!r} exceeds the target {EPSILON}")
    if [row["release"] for row in ledger.rows] != list(range(len(names))) or len(set(names)) != len(names):
        problems.append(
            f"ledger rows are not one release each: {[(row['release'], row['name']) for row in ledger.rows]}"
        )
    unrecorded = [name for name, visible in released.items() if visible and name not in names]
    if unrecorded:
        problems.append(f"outputs of releases {unrecorded} are visible but the ledger lists only {names}")
    return problems


def _reference(root: Path, stage: tuple[str, ...] = ()) -> tuple[Path, float, float, Ledger]:
    """A tiny synthetic data set, and an uninterrupted run of it: (data, wall time T, the moment its
    run folder appeared, its ledger)."""
    data = root / "data"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            cli.main(["synth", "--users", "200", "--items", "50", "--ratings-per-user", "10", "--out", str(data), "-q"])
            == 0
        )
    log = root / "train.log"
    status, seconds, appeared = _run_to_end(data, root / "runs" / "run", log, stage)
    assert status == 0, f"the uninterrupted run failed ({status}):\n{_tail(log)}"
    return data, seconds, appeared or 0.0, Ledger.open(str(root / "runs" / "run" / "ledger.parquet"))


def _kill_resume_and_check(
    data: Path, delays: list[float], seconds: float, expected: Ledger, folder: Path, stage: tuple[str, ...] = ()
) -> tuple[Path, Ledger, str]:
    """Start the run once per delay and SIGKILL it after that delay, checking the run folder after
    every kill, then once more to the end: the checks of the module docstring, and the last start's
    ledger against the uninterrupted run's (which took `seconds`). Returns (run folder, its ledger,
    the context of the messages)."""
    run = folder / "runs" / "run"
    history = []  # (delay, what happened), for the messages

    def context() -> str:
        stages = f" ({' '.join(stage)})" if stage else ""
        return (
            f"seed {SEED}, uninterrupted run {seconds:.1f} s{stages}, kill delays {[round(d, 2) for d in delays]}, "
            f"so far {history}"
        )

    for attempt, delay in enumerate(delays):
        log = folder / f"attempt-{attempt}.log"
        proc = _start_train(data, run, log, stage)
        try:
            status = proc.wait(timeout=delay)  # it may finish before its kill moment: then it must have succeeded
            history.append((round(delay, 2), f"exited {status} before the kill"))
            assert status == 0, f"attempt {attempt} failed on its own ({context()}):\n{_tail(log)}"
        except subprocess.TimeoutExpired:
            history.append((round(delay, 2), "killed"))
        finally:
            _kill_group(proc)
        problems = _visible_damage(run) + _ledger_problems(run)
        assert not problems, (
            f"after the kill at {delay:.2f} s of attempt {attempt} ({context()}):\n"
            + "\n".join(problems)
            + f"\n--- its output:\n{_tail(log)}"
        )

    log = folder / "final.log"
    status, _, _ = _run_to_end(data, run, log, stage)
    assert status == 0, f"the resumed run failed ({status}; {context()}):\n{_tail(log)}"
    problems = _visible_damage(run) + _ledger_problems(run)
    assert not problems, f"after the resumed run ({context()}):\n" + "\n".join(problems)

    ledger = Ledger.open(str(run / "ledger.parquet"))
    got = [(row["release"], row["name"], row["event"]) for row in ledger.rows]
    want = [(row["release"], row["name"], row["event"]) for row in expected.rows]
    assert got == want, (
        f"the resumed run's releases differ from an uninterrupted run's ({context()}):\n{got}\nexpected\n{want}"
    )
    assert ledger.epsilon_spent() == pytest.approx(expected.epsilon_spent(), rel=1e-9), context()
    assert ledger.epsilon_spent() <= EPSILON * (1 + TOLERANCE), context()
    # the data source's budget account (beside the runs) is charged once per release, kills or not
    account = BudgetAccount.open(str(ledger.budget["account"]))
    charged = [(c["release"], c["name"]) for c in account.document["charges"] if c["ledger"] == ledger.identity]
    assert sorted(charged) == [(row["release"], row["name"]) for row in ledger.rows], (
        f"budget account {account.path} ({context()})"
    )
    return run, ledger, context()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny synthetic data set, and an uninterrupted training run of it: (data, wall time T, when its
    run folder appeared, its ledger)."""
    return _reference(tmp_path_factory.mktemp("kill-resume-reference"))


@pytest.fixture(scope="module")
def prepare_reference(tmp_path_factory):
    """The same data set, and an uninterrupted prepare stage of it: (data, wall time T, when its run
    folder appeared, its ledger)."""
    return _reference(tmp_path_factory.mktemp("kill-resume-prepare-reference"), PREPARE)


@pytest.mark.slow
def test_killed_training_resumes_consistent_and_spends_its_budget_once(reference, tmp_path):
    data, seconds, _, expected = reference
    rng = random.Random(SEED)
    delays = [rng.uniform(0.0, seconds) for _ in range(KILLS)]
    run, ledger, context = _kill_resume_and_check(data, delays, seconds, expected, tmp_path)
    assert (run / "metrics.json").is_file(), f"no metrics.json after the resumed run ({context})"
    assert json.loads((run / "metrics.json").read_text())["releases"] == len(expected.rows), context
    print(context)  # shown with -rP: which moments were tried


def test_killed_prepare_stage_resumes_consistent_and_spends_its_budget_once(prepare_reference, tmp_path):
    """The twin of the test above on the prepare stage alone (no Spark): the DP counts and mean. Its
    first second or two is the interpreter's start, where a kill finds nothing to damage, so the
    moments are drawn in the stage's work: one at random in each of KILLS equal parts of the time
    from the moment the uninterrupted run's folder appeared to its end."""
    data, seconds, appeared, expected = prepare_reference
    rng = random.Random(SEED)
    part = (seconds - appeared) / KILLS
    delays = [appeared + part * (k + rng.random()) for k in range(KILLS)]
    run, ledger, context = _kill_resume_and_check(data, delays, seconds, expected, tmp_path, PREPARE)
    assert Run(str(run)).prepared()["prepared"], (
        f"the resumed prepare stage did not record the run as prepared ({context})"
    )
    assert [row["name"] for row in ledger.rows] == ["counts", "mean"], context  # the stage's releases, each once
    print(context)  # shown with -rP: which moments were tried
