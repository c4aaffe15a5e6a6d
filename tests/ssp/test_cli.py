"""The `ssp` command as a user runs it: help on every subcommand, exit codes, errors in one line."""

import os
import subprocess
import sys
import time

import pytest

from pipelines.data.ingest import BUNDLED
from ssp import cli

SUBCOMMANDS = ["demo", "train", "ingest", "synth", "split", "counts", "stats", "user-update"]
STAGE_COMMANDS = ["item-update", "evaluate", "publish"]  # a stage of a prepared run: --run RUN


def ssp(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ssp.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_help_lists_every_subcommand():
    result = ssp("--help")
    assert result.returncode == 0
    for name in SUBCOMMANDS + STAGE_COMMANDS + ["privacy"]:
        assert name in result.stdout


@pytest.mark.parametrize("name", STAGE_COMMANDS)
def test_stage_command_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([name, "--help"])
    assert info.value.code == 0
    assert "--run" in capsys.readouterr().out


def test_stage_commands_refuse_a_folder_without_a_run(tmp_path):
    result = ssp("evaluate", "--run", str(tmp_path))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"ssp evaluate: error: {tmp_path} holds no run (no manifest.json)")
    )
    result = ssp("user-update", "--run", str(tmp_path), "--step", "1", "--final")
    assert result.returncode == 2 and result.stderr.strip().endswith(
        "with --run give exactly one of --step S and --final"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["evaluate"],
        ["item-update", "--step", "1"],
        ["publish", "--to", "{tmp}/published"],
        ["user-update", "--step", "1"],
    ],
)
def test_a_stage_of_a_missing_run_is_refused_without_creating_it(tmp_path, args):
    """Through the installed `ssp`: a --run that does not exist is refused in one line, exit 2, and
    neither it (nor a lock in it) nor the publication folder is created."""
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    run = tmp_path / "no-run"
    result = subprocess.run(
        [installed, args[0], "--run", str(run), *[a.format(tmp=tmp_path) for a in args[1:]]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == [
        f"ssp {args[0]}: error: {run} holds no run (no manifest.json); start it with `ssp train --stage prepare --out "
        f"{run} ...`"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", [[], ["--stage", "prepare"]])
def test_train_refuses_a_folder_that_holds_something_else_and_writes_nothing_in_it(tmp_path, stage):
    """Through the installed `ssp`: --out pointing at a data set folder is refused in one line, exit
    2, before the run lock would leave a file in it."""
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    folder = tmp_path / "data-set"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"source": "synthetic", "users": 3}')
    result = subprocess.run(
        [installed, "train", "--data", BUNDLED, "--out", str(folder), *stage],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == [
        f"ssp train: error: --out {folder} holds something other than a training run ({folder}/manifest.json has no "
        f"settings); use a new --out"
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([name, "--help"])
    assert info.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_bad_input_is_one_line_error_with_status_2(tmp_path):
    result = ssp("ingest", "--source", str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"ssp ingest: error: {tmp_path / 'missing'}: no such folder"
    assert not (tmp_path / "out").exists()


def test_split_accepts_a_movielens_folder(spark, tmp_path, capsys):
    """On the default engine, Spark: the test session's (`spark`), which the command uses as it finds it."""
    assert cli.main(["split", "--protocol", "rmse", "--out", str(tmp_path / "split")]) == 0
    out = capsys.readouterr().out
    assert (
        "train  rows=80688" in out and "valid  rows=10091" in out and "test   rows=10057" in out
    )  # the keyed-hash 80/10/10 (seed 1234)
    assert (tmp_path / "split" / "data" / "manifest.json").exists()


def test_bench_is_the_experiment_harness(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "all", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--protocol" in out and "--data" in out
    assert "bench" in ssp("--help").stdout


def test_train_needs_its_data_named_as_a_folder_before_any_engine_starts(tmp_path):
    """Through the installed `ssp`: no --data (only `ssp demo` trains on the bundled set) and a CSV
    log given as --data are each one line, exit 2, within the time of a process start (no JVM), and
    leave no run folder."""
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    (tmp_path / "log.csv").write_text("user_id,item_id,label\n1,2,4\n")
    for data, named in (
        ([], "--data is required"),
        (["--data", str(tmp_path / "log.csv")], "is a file: training reads a data set folder"),
    ):
        started = time.perf_counter()
        result = subprocess.run(
            [installed, "train", *data, "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr and "spark" not in result.stderr.lower(), (
            result.stderr[-2000:]
        )
        assert result.stderr.strip().splitlines()[-1].startswith("ssp train: error: ") and named in result.stderr
        assert time.perf_counter() - started < 30 and not (tmp_path / "run").exists()
    assert "ssp ingest --interactions" in result.stderr


@pytest.mark.parametrize("unit", ["example", "user"])
def test_train_has_no_unit_flag(tmp_path, unit, capsys):
    """Training is user level only: an embedding solved from all of a user's ratings makes a
    one-rating guarantee unsound, so `ssp train --unit example` is an argparse error (status 2)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--unit", unit, "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    assert f"unrecognized arguments: --unit {unit}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_stats_help_says_when_example_level_is_sound(capsys):
    with pytest.raises(SystemExit):
        cli.main(["stats", "--help"])
    assert "example is sound only when --user-embeddings are given and fixed" in " ".join(
        capsys.readouterr().out.split()
    )


def test_every_flag_of_every_command_has_a_help_sentence():
    """A help text that only repeats the flag's name ("clip u", "wbar") tells a user nothing: each
    flag needs a sentence of at least three words beyond its default."""
    import argparse
    import re

    commands = next(action for action in cli.build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    poor = []
    for command, parser in commands.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = re.sub(r"\s*\(default:[^)]*\)\s*$", "", action.help or "").strip().lower()
            name_words = action.option_strings[-1].lstrip("-").replace("-", " ").removeprefix("no ")
            if len(text.split()) < 3 or text == name_words:
                poor.append(f"{command} {action.option_strings[-1]}: {action.help!r}")
    assert poor == [], "\n".join(poor)


def test_a_flag_shared_by_several_commands_has_one_default():
    """`--lambda-u 1.0` in one command and 0.1 in another surprised users. A default of None means
    "required, or taken from the run" (not another default); `--out` and `--seed` name different
    things per command (an output, a generator's or a split's seed)."""
    import argparse

    commands = next(action for action in cli.build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    defaults = {}
    for command, parser in commands.choices.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and action.default is not None and flag not in ("--help", "--out", "--seed"):
                    defaults.setdefault(flag, {})[command] = action.default
    differing = {
        flag: by_command
        for flag, by_command in defaults.items()
        if len({repr(value) for value in by_command.values()}) > 1
    }
    assert differing == {}
    assert (
        defaults["--outer-steps"] == {"counts": 2, "stats": 2} and len(defaults["--mean-share"]) == 3
    )  # train's: 2, or 1 for the per-item mean (per method)


def test_version_is_the_packages():
    import tomllib
    from pathlib import Path

    declared = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]
    result = ssp("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"ssp {declared}"


def test_a_failing_bench_is_one_line_through_the_installed_command(tmp_path):
    """`ssp bench` follows the one-line rule of every other command: a missing --data is exit 2 and
    one error line naming it, no traceback."""
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    result = subprocess.run(
        [
            installed,
            "bench",
            "privacy-utility",
            "--quick",
            "--no-progress",
            "--out",
            str(tmp_path / "bench"),
            "--data",
            str(tmp_path / "nowhere"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == f"ssp bench: error: {tmp_path / 'nowhere'}: no such folder"


@pytest.mark.parametrize(
    "endpoint, named",
    [
        ("http://nohost.invalid:4443", "cannot reach nohost.invalid (DNS: "),
        ("http://127.0.0.1:9", "cannot reach 127.0.0.1:9 within 3 s"),
    ],
)
def test_an_unreachable_gcs_endpoint_is_one_line_in_seconds(tmp_path, endpoint, named):
    """Without the network (a name that does not resolve, a port nobody answers on) a gs:// path is
    one line naming the path, the host and the cause, at once: no gcsfs retries for minutes, no
    retry tracebacks on stderr."""
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    env = {**os.environ, "STORAGE_EMULATOR_HOST": endpoint, "SSP_GCS_TIMEOUT": "3"}
    started = time.perf_counter()
    result = subprocess.run(
        [installed, "ingest", "--out", "gs://bucket/data"], capture_output=True, text=True, timeout=300, env=env
    )
    assert time.perf_counter() - started < 30
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ssp ingest: error: gs://bucket/data: {named}"), lines


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--epsilon", "-inf"], "epsilon must be > 0, got -inf"),
        (["--delta", "-1e-5"], "delta must be in (0, 1), got -1e-05"),
        (["--dim", "-3"], "--dim must be a positive integer, got -3"),
        (["--epsilon", "1e308"], "epsilon 1e+308 is over 100, where the noise no longer protects anyone"),
        (["--data-source", "../shop"], "--data-source must be a name of letters, digits, '.', '_' and '-'"),
    ],
)
def test_a_negative_or_absurd_setting_gets_its_ranges_message_from_the_installed_command(flags, message):
    """Negative numbers in any spelling are values, not flags (argparse alone says "expected one
    argument" for -inf or -1e-5), and an epsilon that protects no one is refused before anything."""
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ssp"), "train", "--plan", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(f"ssp train: error: {message}")


@pytest.mark.parametrize("entry", [["-m", "bench", "--help"], ["-m", "pipelines.beam_stats", "--help"]])
def test_entry_points_print_no_python_support_notice(entry):
    """google-api-core's FutureWarning about this Python's end of support (at every import, under
    Beam and gcsfs) is not shown to a command's user."""
    result = subprocess.run([sys.executable, *entry], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout
    assert "FutureWarning" not in result.stderr, result.stderr[-2000:]
