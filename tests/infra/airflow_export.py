"""Print the tasks of the DAGs in a folder as JSON, rendered for given run dates (Airflow side).

Runs in the Airflow environment (.venv-airflow, infra/airflow/requirements.lock), which does not
share the project's dependencies, so it only parses: Airflow's DagBag imports the folder, each
task's templates are rendered with Airflow's Jinja environment for a logical date, and the command
each operator would run is extracted as an argv list, exactly as the operator builds it:

- KubernetesPodOperator: cmds + arguments;
- DataprocSubmitJobOperator (PySpark job): spark-submit --py-files URIS MAIN ARGS;
- BeamRunPythonPipelineOperator: PYTHON PY_OPTIONS PY_FILE --runner=R and the pipeline options
  merged and formatted by the Beam provider's own functions (with the Dataflow project, region,
  job name and labels the operator adds at execution).

The project side (tests/infra/test_dag.py) checks those commands against the project's parsers.
Usage: python airflow_export.py OUT.json DAG_FOLDER[:DAG_FOLDER ...] ENGINE[,ENGINE] DATE [DATE ...]
(each engine the DAG's SSP_STATS_ENGINE while its folders are imported: one Airflow start for all)
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pendulum


def _beam_argv(task) -> list[str]:
    """The command BeamRunPythonPipelineOperator.execute would start (Dataflow runner)."""
    from airflow.providers.apache.beam.hooks.beam import beam_options_to_args
    from airflow.providers.google.cloud.hooks.dataflow import DataflowHook
    from airflow.utils.helpers import convert_camel_to_snake
    from airflow.version import version

    task._cast_dataflow_config()
    config = task.dataflow_config
    options = copy.deepcopy(task.default_pipeline_options)
    if task.runner.lower() == "dataflowrunner":
        options["job_name"] = DataflowHook.build_dataflow_job_name(config.job_name, config.append_job_name)
        options["project"] = config.project_id
        options["region"] = config.location
    options.update(task.pipeline_options)
    options.setdefault("labels", {}).update({"airflow-version": "v" + version.replace(".", "-").replace("+", "-")})
    options = {convert_camel_to_snake(key): value for key, value in options.items()}
    options["labels"] = [f"{key}={value}" for key, value in options["labels"].items()]
    return [
        task.py_interpreter,
        *task.py_options,
        task.py_file,
        f"--runner={task.runner}",
        *beam_options_to_args(options),
    ]


def describe(task) -> dict:
    """{operator, argv, ...} of a rendered task."""
    kind = type(task).__name__
    out = {
        "task_id": task.task_id,
        "operator": kind,
        "upstream": sorted(task.upstream_task_ids),
        "retries": task.retries,
    }
    if kind == "KubernetesPodOperator":
        limits = (task.container_resources.limits or {}) if task.container_resources else {}
        out.update(
            argv=[*task.cmds, *task.arguments],
            image=task.image,
            gpu="nvidia.com/gpu" in limits,
            env={variable.name: variable.value for variable in task.env_vars or []},
        )
    elif kind == "DataprocSubmitJobOperator":
        job = task.job["pyspark_job"]
        out.update(
            argv=[
                "spark-submit",
                "--py-files",
                ",".join(job["python_file_uris"]),
                job["main_python_file_uri"],
                *job["args"],
            ],
            cluster=task.job["placement"]["cluster_name"],
            properties=job.get("properties", {}),
        )
    elif kind == "BeamRunPythonPipelineOperator":
        out.update(argv=_beam_argv(task), runner=task.runner)
    else:
        out["argv"] = None  # an operator this exporter does not know: the test fails on it
    return out


def export(folder: str, date: str) -> dict:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=folder)
    result = {"import_errors": {path: str(error) for path, error in bag.import_errors.items()}, "dags": {}}
    logical = pendulum.parse(date)
    for dag_id, dag in bag.dags.items():
        params = {key: dag.params[key] for key in dag.params}
        tasks = []
        for task in dag.tasks:
            context = {
                "ds": logical.to_date_string(),
                "ds_nodash": logical.format("YYYYMMDD"),
                "logical_date": logical,
                "params": params,
                "dag": dag,
                "task": task,
                "run_id": f"scheduled__{logical.isoformat()}",
            }
            task.render_template_fields(context)
            tasks.append(describe(task))
        result["dags"][dag_id] = {
            "schedule": str(dag.schedule),
            "catchup": dag.catchup,
            "max_active_runs": dag.max_active_runs,
            "params": params,
            "tasks": tasks,
        }
    return result


if __name__ == "__main__":
    out, folders, engines, *dates = sys.argv[1:]
    # one folder: {date: export}; several, os.pathsep-separated: {folder: {date: export}}; several
    # engines, comma-separated: {engine: that}
    each = folders.split(os.pathsep)
    exported = {}
    for engine in engines.split(","):
        os.environ["SSP_STATS_ENGINE"] = engine  # read by the DAG file, which each DagBag imports anew
        by_folder = {folder: {date: export(folder, date) for date in dates} for folder in each}
        exported[engine] = by_folder if len(each) > 1 else by_folder[each[0]]
    with open(out, "w") as handle:
        json.dump(exported if "," in engines else exported[engines], handle, default=str)
