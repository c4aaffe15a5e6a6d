"""The retraining DAG (infra/dags/retrain.py), parsed by real Airflow, against the project's real CLI.

Airflow cannot share the project's lock, so it lives in .venv-airflow (infra/airflow/setup.sh
creates it from infra/airflow/requirements.lock once, a few minutes, and reuses it). There,
tests/infra/airflow_export.py imports the DAG folder with Airflow's DagBag and writes every task's
command, rendered for two run dates. Here each command is parsed by the parser of the entry point
it names: `ssp` (ssp.cli.build_parser), `pipelines/stats.py` and `pipelines.beam_stats` (their
own main(), stopped right after parsing), `pipelines/user_update.py` (`ssp user-update`, which it
runs); a flag must be spelled exactly as the parser defines it (argparse would accept an
abbreviation). Then the commands are checked to form one run: the stats job gets the inputs,
settings and budget `ssp train` would give it (`stats_stage.stats_job_for`), the run date is in every
path, and the ledger is checked before publish.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from pipelines import beam_stats, stats  # the entry scripts
from pipelines.releases import stats_job
from pipelines.training import commands
from pipelines.training.run_dir import Run
from ssp import cli

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "infra" / "dags"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
DATES = ("2026-01-05", "2026-03-02")
ENGINES = {"spark": "DataprocSubmitJobOperator", "beam": "BeamRunPythonPipelineOperator"}


@pytest.fixture(scope="session")
def airflow_python() -> Path:
    """.venv-airflow's Python (created by infra/airflow/setup.sh on first use)."""
    result = subprocess.run(
        ["bash", str(ROOT / "infra" / "airflow" / "setup.sh")], capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return ROOT / ".venv-airflow" / "bin" / "python"


def export(
    airflow_python: Path,
    folder: Path | list[Path],
    engine: str,
    tmp: Path,
    deployed_version: str | None = VERSION,
    dates: tuple[str, ...] = DATES,
) -> dict:
    """{date: {"import_errors", "dags": {dag_id: {..., "tasks": [...]}}}} of the DAGs in `folder` with
    SSP_STATS_ENGINE `engine`; of a list of folders, {str(folder): that}; of engines "spark,beam", {engine:
    that}: from one Airflow process. A DAG copied out of the checkout is deployed as a scheduler gets it:
    told its version (SSP_VERSION)."""
    folders = folder if isinstance(folder, list) else [folder]
    out = tmp / f"export-{engine.replace(',', '-')}.json"
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp / "airflow-home"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env.pop("PYTHONPATH", None)
    env.pop("SSP_VERSION", None)
    if DAGS not in folders and deployed_version:
        env["SSP_VERSION"] = deployed_version
    result = subprocess.run(
        [
            str(airflow_python),
            str(ROOT / "tests" / "infra" / "airflow_export.py"),
            str(out),
            os.pathsep.join(map(str, folders)),
            engine,
            *dates,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def exported(airflow_python, tmp_path_factory) -> dict:
    """The real DAG, exported for each stats engine by one Airflow process."""
    return export(airflow_python, DAGS, ",".join(ENGINES), tmp_path_factory.mktemp("exported"))


# ---------------------------------------------------------------------------------------------
# Parsing a command with the project's own parsers


class Parsed(Exception):
    """Raised by the stubbed StatsJob.from_args: parsing is done, nothing runs."""

    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def _parse(parse, argv: list[str]) -> tuple[argparse.Namespace | None, str | None]:
    """(namespace, None), or (None, argparse's error line)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return parse(argv), None
    except SystemExit:
        return None, (stderr.getvalue().strip().splitlines() or ["argparse error"])[-1]


def _stats_main(main, argv: list[str]) -> argparse.Namespace:
    """Run a stats entry point's main() up to its parsed flags (StatsJob.from_args); nothing is computed."""

    def stop(args, job_of_run=None):
        raise Parsed(args)

    saved_from_args, saved_report = vars(stats_job.StatsJob)["from_args"], stats_job.run_and_report
    stats_job.StatsJob.from_args = staticmethod(stop)
    stats_job.run_and_report = lambda compute: compute()
    try:
        main(argv)
    except Parsed as done:
        return done.namespace
    finally:
        stats_job.StatsJob.from_args, stats_job.run_and_report = saved_from_args, saved_report
    raise AssertionError("the stats entry point returned without parsing its flags")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _subparser(name: str) -> argparse.ArgumentParser:
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


def _stats_options() -> set[str]:
    parser = argparse.ArgumentParser()
    stats_job.add_arguments(parser)
    return _options(parser) | {"--master"}


def _inexact(argv: list[str], known: set[str], all_known: bool) -> list[str]:
    """Flags not spelled as the parser defines them (abbreviations; unknown ones when all_known)."""
    bad = []
    for token in argv:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            if flag not in known and (all_known or any(option.startswith(flag) for option in known)):
                bad.append(flag)
    return bad


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(entry point, parsed flags) of a task's command; AssertionError naming the problem."""
    if argv[0] == "ssp":
        bad = _inexact(argv[2:], _options(_subparser(argv[1])), all_known=True)
        assert not bad, f"`ssp {argv[1]}`: flags not spelled as the CLI defines them: {bad}"
        args, error = _parse(cli.build_parser().parse_args, argv[1:])
        assert error is None, f"`ssp {argv[1]}`: {error}"
        return f"ssp {argv[1]}", args
    if argv[0] == "spark-submit":
        assert argv[1] == "--py-files", argv[:3]
        script, args = Path(argv[3]).name, argv[4:]
        if script == "user_update.py":  # the script runs `ssp user-update`
            return parse_command(["ssp", "user-update", *args])
        assert script == "stats.py", f"spark-submit of an unknown entry point {argv[3]}"
        bad = _inexact(args, _stats_options(), all_known=True)
        assert not bad, f"`pipelines/stats.py`: flags not spelled as stats_job.add_arguments defines them: {bad}"
        parsed, error = _parse(lambda a: _stats_main(stats.main, a), args)
        assert error is None, f"`spark-submit pipelines/stats.py`: {error}"
        return "stats", parsed
    assert argv[1:3] == ["-m", "pipelines.beam_stats"], f"unknown command {argv[:3]}"
    bad = _inexact(argv[3:], _stats_options(), all_known=False)
    assert not bad, (
        f"`pipelines.engines.beam_release`: flags not spelled as stats_job.add_arguments defines them: {bad}"
    )
    parsed, error = _parse(lambda a: _stats_main(beam_stats.main, a), argv[3:])
    assert error is None, f"`python -m pipelines.beam_stats`: {error}"
    return "stats", parsed


# ---------------------------------------------------------------------------------------------
# The DAG as one scheduled run


def prepare_beam_options(env: dict) -> set[str]:
    """The runner the prepare stage's Beam pipelines get from the pod's environment ({} when none),
    checked as `ssp train` reads them (pipelines.engines.prepare_beam.options_from_environment)."""
    import os

    from pipelines.engines.prepare_beam import OPTIONS_ENV, options_from_environment

    if OPTIONS_ENV not in env:
        return set()
    before = os.environ.get(OPTIONS_ENV)
    os.environ[OPTIONS_ENV] = env[OPTIONS_ENV]
    try:
        options = options_from_environment().get_all_options()
    finally:
        os.environ.pop(OPTIONS_ENV) if before is None else os.environ.update({OPTIONS_ENV: before})
    assert (
        options["sdk_container_image"] and options["temp_location"].startswith("gs://") and "{{" not in env[OPTIONS_ENV]
    ), env
    return {options["runner"]}


def dag_problems(export_of_date: dict, date: str, engine: str) -> list[str]:
    """Every way the DAG's commands disagree with the CLI or with one run of `ssp train`."""
    if export_of_date["import_errors"]:
        return [f"import error: {export_of_date['import_errors']}"]
    (dag,) = export_of_date["dags"].values()
    params, tasks = dag["params"], {task["task_id"]: task for task in dag["tasks"]}
    problems, parsed = [], {}
    for task_id, task in tasks.items():
        if task["argv"] is None:
            problems.append(f"{task_id}: operator {task['operator']} runs no known command")
            continue
        try:
            parsed[task_id] = parse_command(task["argv"])
        except AssertionError as error:
            problems.append(f"{task_id}: {error}")
    if problems:
        return problems

    def check(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    ingest, prepare = parsed["ingest"][1], parsed["prepare"][1]
    check(
        parsed["prepare"][0] == "ssp train" and prepare.stage == "prepare", "prepare: not `ssp train --stage prepare`"
    )
    config = commands.config_from_args(prepare)
    run = Run(config.out)
    check(
        f"/runs/{date}" in run.root and date in ingest.interactions and date in ingest.catalog,
        f"the run date {date} is not in the run's paths ({run.root}, {ingest.interactions}, {ingest.catalog})",
    )
    check(ingest.out == config.data, f"prepare reads {config.data}, ingest writes {ingest.out}")
    check(
        (config.epsilon, config.delta) == (params["epsilon"], params["delta"]),
        f"the run's budget {(config.epsilon, config.delta)} is not the DAG's params",
    )
    check(
        not config.non_private and config.engine == engine,
        f"prepare: engine {config.engine} (DAG: {engine}), non-private {config.non_private}",
    )
    check(
        (config.budget_account, config.account_cap) == (params["account"], params["account_cap"]),
        f"prepare: the budget account {(config.budget_account, config.account_cap)} is not the DAG's params",
    )
    default_steps = config.replace(outer_steps=None).outer_steps
    check(
        config.outer_steps == default_steps,
        f"prepare: {config.outer_steps} outer steps, the default recipe's are {default_steps}",
    )
    check(
        config.holdout == 0,
        f"prepare: the scheduled run must train on every row (--holdout 0, the production mode), got --holdout "
        f"{config.holdout}",
    )
    check(
        prepare_beam_options(tasks["prepare"].get("env", {})) == ({"DataflowRunner"} if engine == "beam" else set()),
        f"prepare: the Beam engine's split, counts and mean must run on Dataflow, the Spark one in the pod (env "
        f"{tasks['prepare'].get('env')})",
    )
    order = ["ingest", "prepare"]
    for s in range(1, config.outer_steps + 1):
        order += [f"user_update_{s}", f"stats_{s}", f"item_update_{s}"]
        user, job, item = (
            parsed.get(f"{name}_{s}", (None, None))[1] for name in ("user_update", "stats", "item_update")
        )
        check(
            user is not None and (user.run, user.step, user.final) == (run.root, s, False),
            f"user_update_{s}: not `user-update --run {run.root} --step {s}`",
        )
        check(
            item is not None and (item.run, item.step) == (run.root, s) and tasks[f"item_update_{s}"]["gpu"],
            f"item_update_{s}: not `item-update --run RUN --step {s}` on a GPU",
        )
        check(
            tasks.get(f"stats_{s}", {}).get("operator") == ENGINES[engine], f"stats_{s}: not run by {ENGINES[engine]}"
        )
        # the stage form: the run's own job from its manifest (tests/pipelines/training/test_stages.py checks it equals
        # stats_stage.stats_job_for)
        check(
            job is not None and (job.run, job.step) == (run.root, s) and _no_job_flags(job),
            f"stats_{s}: not `stats --run {run.root} --step {s}` alone",
        )
    order += ["final_user_update", "evaluate", "check_privacy", "publish"]
    final, evaluate, privacy, publish = (parsed.get(name, (None, None))[1] for name in order[-4:])
    check(
        final is not None and (final.run, final.step, final.final) == (run.root, None, True),
        "final_user_update: not `user-update --run RUN --final`",
    )
    check(evaluate is not None and evaluate.run == run.root, "evaluate: not `ssp evaluate --run RUN`")
    check(
        privacy is not None
        and parsed["check_privacy"][0] == "ssp privacy"
        and privacy.run == run.root
        and (privacy.max_epsilon, privacy.max_delta) == (params["epsilon"], params["delta"]),
        "check_privacy: not `ssp privacy RUN --max-epsilon E --max-delta D` with the DAG's budget",
    )
    check(
        publish is not None and publish.run == run.root and date in publish.to and not publish.to.startswith(run.root),
        f"publish: not `ssp publish --run RUN --to DEST/<date>` ({publish and publish.to})",
    )
    check(sorted(tasks) == sorted(order), f"tasks {sorted(set(tasks) ^ set(order))} are missing or unexpected")
    for before, after in itertools.pairwise(order):
        check(tasks.get(after, {}).get("upstream") == [before], f"{after} must run right after {before}")
    return problems


def _no_job_flags(args: argparse.Namespace) -> bool:
    """Whether a stats job's flags name nothing but the run and the step."""
    return all(getattr(args, name, None) is None for name in (*stats_job.JOB_FLAGS, *stats_job.BUDGET_FLAGS))


@pytest.mark.parametrize("engine", ENGINES)
def test_every_task_runs_a_real_entry_point_of_one_run(exported, engine):
    for date in DATES:
        assert dag_problems(exported[engine][date], date, engine) == []
    (dag,) = exported[engine][DATES[0]]["dags"].values()
    assert dag["schedule"] == "@weekly" and dag["max_active_runs"] == 1 and not dag["catchup"]


def test_run_date_is_templated_into_every_path(exported):
    for engine in ENGINES:
        first, second = (
            {task["task_id"]: task["argv"] for task in exported[engine][date]["dags"]["ssp_retrain"]["tasks"]}
            for date in DATES
        )
        for task_id, argv in first.items():
            # every path is the run date's, except the data source's budget account: one for all runs (they compose
            # there)
            paths = [
                token.split("=", 1)[-1]
                for token in argv
                if "gs://ssp-recsys-data/" in token and "/budget-accounts/" not in token
            ]
            assert paths and all(DATES[0] in path for path in paths), (task_id, paths)
            unique = [
                token for token in argv if not token.startswith("--job_name=")
            ]  # Dataflow job names get a random suffix
            assert [token for token in second[task_id] if not token.startswith("--job_name=")] == [
                token.replace(DATES[0], DATES[1]) for token in unique
            ], task_id


def test_spark_tasks_ship_the_project_and_use_the_cluster_python(exported):
    install = (ROOT / "infra" / "dataproc" / "install-deps.sh").read_text()
    for task in exported["spark"][DATES[0]]["dags"]["ssp_retrain"]["tasks"]:
        if task["operator"] == "DataprocSubmitJobOperator":
            assert task["argv"][2].endswith(f"/ssp_recsys-{VERSION}.zip")
            python = task["properties"]["spark.pyspark.python"]
            assert python.startswith("/opt/ssp/venv/") and "-m venv /opt/ssp/venv" in install


# ---------------------------------------------------------------------------------------------
# Drift: a DAG whose command no longer matches the CLI is caught

DRIFTS = {
    "a renamed flag": ('"item-update", "--run", RUN', '"item-update", "--run-dir", RUN', "item_update_1", "--run-dir"),
    "an abbreviated flag": (
        '"--max-epsilon", "{{ params.epsilon }}"',
        '"--max-eps", "{{ params.epsilon }}"',
        "check_privacy",
        "--max-eps",
    ),
    "a stats flag the job does not have": (
        '{"run": RUN, "step": step}',
        '{"run-dir": RUN, "step": step}',
        "stats_1",
        "--run-dir",
    ),
    "a stats job given another step": (
        '{"run": RUN, "step": step}',
        '{"run": RUN, "step": step + 1}',
        "stats_1",
        "--step 1",
    ),
    "a stats job given settings by hand": (
        '{"run": RUN, "step": step}',
        '{"run": RUN, "step": step, "dim": 8}',
        "stats_1",
        "alone",
    ),
}


@pytest.fixture(scope="module")
def drifted(airflow_python, tmp_path_factory) -> dict:
    """{drift: the export on DATES[0] of a copy of the DAG folder with that drift}, every copy exported by
    one Airflow process (one start of Airflow for all the drifts, not one each)."""
    tmp = tmp_path_factory.mktemp("drifted")
    folders = {}
    for k, (drift, (old, new, _, _)) in enumerate(DRIFTS.items()):
        folder = tmp / f"drift-{k}" / "dags"
        shutil.copytree(DAGS, folder)
        source = (folder / "retrain.py").read_text()
        assert old in source, drift
        (folder / "retrain.py").write_text(source.replace(old, new))
        folders[drift] = folder
    exported = export(airflow_python, list(folders.values()), "spark", tmp, dates=(DATES[0],))
    return {drift: exported[str(folder)][DATES[0]] for drift, folder in folders.items()}


@pytest.mark.parametrize("drift", DRIFTS)
def test_a_drifted_command_is_detected(drifted, drift):
    _, _, task_id, named = DRIFTS[drift]
    problems = dag_problems(drifted[drift], DATES[0], "spark")
    assert any(problem.startswith(f"{task_id}:") and named in problem for problem in problems), problems


def test_a_dag_that_does_not_import_is_reported(airflow_python, tmp_path):
    folder = tmp_path / "dags"
    shutil.copytree(DAGS, folder)
    (folder / "retrain" / "dataproc-job.yaml").unlink()
    problems = dag_problems(export(airflow_python, folder, "spark", tmp_path)[DATES[0]], DATES[0], "spark")
    assert len(problems) == 1 and problems[0].startswith("import error") and "dataproc-job.yaml" in problems[0]


def test_a_dag_deployed_without_its_version_says_so(airflow_python, tmp_path):
    folder = tmp_path / "dags"
    shutil.copytree(DAGS, folder)
    result = export(airflow_python, folder, "spark", tmp_path, deployed_version=None)[DATES[0]]
    assert "set SSP_VERSION" in json.dumps(result["import_errors"])


# ---------------------------------------------------------------------------------------------
# The other deployment configs that name commands


def test_kubernetes_spark_application_is_the_dags_stats_job(exported):
    document = yaml.safe_load((ROOT / "infra" / "k8s" / "spark-stats.yaml").read_text())
    spec = document["spec"]
    assert document["kind"] == "SparkApplication" and spec["mainApplicationFile"].endswith("/stats.py")
    tasks = {task["task_id"]: task for task in exported["spark"][DATES[0]]["dags"]["ssp_retrain"]["tasks"]}
    prepare = parse_command(tasks["prepare"]["argv"])[1]
    argv = [token.replace("${RUN}", prepare.out).replace("${STEP}", "2") for token in spec["arguments"]]
    _, args = parse_command(["spark-submit", "--py-files", "image", spec["mainApplicationFile"], *argv])
    assert (args.run, args.step) == (prepare.out, 2) and _no_job_flags(
        args
    )  # the DAG's stats_2, the rest from the run's manifest


def test_the_version_is_written_in_pyproject_only():
    """The DAG, the images and the cluster configs take the project version from pyproject.toml (the
    DAG reads it, the configs are rendered with it), so a release bumps one line."""
    carriers = [
        path
        for path in (ROOT / "infra").rglob("*")
        if path.is_file()
        and path.name != "requirements.lock"
        and re.search(rf"(?<![\d.]){re.escape(VERSION)}(?![\d.])", path.read_text(errors="replace"))
    ]
    assert carriers == []
    assert (
        "${VERSION}" in (ROOT / "infra" / "k8s" / "spark-stats.yaml").read_text()
        and "${VERSION}" in (ROOT / "infra" / "dataproc" / "cluster.yaml").read_text()
    )
