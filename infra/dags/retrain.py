"""Scheduled retraining of the AM-SSP recommender: one private training run per schedule interval.

    ingest -> prepare -> [user_update_<s> -> stats_<s> -> item_update_<s>] for s = 1..S
           -> final_user_update -> evaluate -> check_privacy -> publish

Every task runs an entry point of the project with the flags of its CLI (tests/infra/test_dag.py
parses this DAG with Airflow and checks every command against the project's own argparse parsers):

- ingest, prepare, item_update_<s>, evaluate, check_privacy, publish: `ssp ...` in the project's
  container image (infra/docker/Dockerfile: GPU TensorFlow, the locked dependencies, the project
  wheel) by KubernetesPodOperator; the item updates (the TensorFlow trainer) get a GPU. prepare's
  split, DP counts and DP mean run on the run's engine: a local Spark session in the pod (bounded
  memory: it spills to disk), or with SSP_STATS_ENGINE=beam Dataflow jobs launched from the pod
  (their options in $SSP_BEAM_PIPELINE_OPTIONS, from retrain/dataflow-options.yaml).
- user_update_<s>, final_user_update: `pipelines/user_update.py --run RUN --step s` on Dataproc
  (DataprocSubmitJobOperator, job settings in retrain/dataproc-job.yaml, the project zip of
  `ssp spark-package` shipped in python_file_uris).
- stats_<s>: the stats job of the run, `--run RUN --step s` (the rest from the run's manifest), on Dataproc
  (`pipelines/stats.py`, SSP_STATS_ENGINE=spark, the default) or on Dataflow
  (`python -m pipelines.beam_stats` by BeamRunPythonPipelineOperator with the DataflowRunner and the
  options of retrain/dataflow-options.yaml, SSP_STATS_ENGINE=beam).

The schedule: one run per interval (weekly), never two at once (max_active_runs=1: a gs:// run
directory has no lock), no catch-up. The run date is in every path: the run reads the raw logs of
`{params.raw}/{{ ds }}`, works in the run directory `{params.bucket}/runs/{{ ds }}` and publishes to
`{params.bucket}/models/{{ ds }}`. So each scheduled run is a run of its own, with its own ledger
and privacy budget (params epsilon and delta, the whole run's target): `ssp train --stage prepare`
records the budget in the run's ledger, every release is checked against it as it is made,
check_privacy fails the run if the ledger spent more than the schedule grants, and publish checks
the ledger again before it copies anything. Runs on overlapping users compose: every run charges its
releases to one budget account of the data source (params account, kept beside the runs), so the
users' lifetime epsilon over all scheduled runs is composed and capped (params account_cap): a run
that would take it past the cap is refused at its first release over it, and check_privacy and
publish refuse a run the account does not fully list. Every pod finds the data source's account
through the durable account registry `{params.bucket}/budget-accounts` ($SSP_BUDGET_ACCOUNTS; a
pod's own home folder is gone with the pod), which names the source's one account by its name
(params data_source, recorded by ingest): next week's rows, a user more or less, charge the same one.

Deployment settings are read from the scheduler's environment when the DAG is parsed (defaults in
brackets): SSP_GCP_PROJECT, SSP_REGION [europe-west4], SSP_DATAPROC_CLUSTER [ssp-spark],
SSP_ARTIFACTS (gs:// folder of this version's wheel, stats.py and user_update.py: infra/build.sh),
SSP_IMAGE (the trainer image), SSP_BEAM_IMAGE (the Dataflow worker image), SSP_NAMESPACE [ssp],
SSP_LAUNCHER_PYTHON (the Python with the project installed that launches Beam pipelines),
SSP_STATS_ENGINE [spark], SSP_VERSION [pyproject.toml's, when the DAG is parsed from a checkout].
The training settings are TRAINING below.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pendulum
import yaml
from airflow.providers.apache.beam.operators.beam import BeamRunPythonPipelineOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.google.cloud.operators.dataproc import DataprocSubmitJobOperator
from airflow.sdk import DAG, Param, chain
from kubernetes.client import models as k8s


def project_version() -> str:
    """The project version, from pyproject.toml (its one place) when the DAG runs from a checkout."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        raise RuntimeError(
            "set SSP_VERSION to the project version the artifacts were built from (infra/build.sh prints it)"
        )
    return tomllib.loads(pyproject.read_text())["project"]["version"]


VERSION = os.environ.get("SSP_VERSION") or project_version()  # the version the artifacts and images are built from
CONFIG = Path(__file__).resolve().parent / "retrain"
PROJECT = os.environ.get("SSP_GCP_PROJECT", "ssp-recsys")
REGION = os.environ.get("SSP_REGION", "europe-west4")
CLUSTER = os.environ.get("SSP_DATAPROC_CLUSTER", "ssp-spark")
ARTIFACTS = os.environ.get("SSP_ARTIFACTS", f"gs://ssp-recsys-artifacts/ssp-recsys/{VERSION}")
# the project wheel under a .zip name: PySpark puts only .zip/.egg/.jar py-files on the executors' path
PY_FILES = f"{ARTIFACTS}/ssp_recsys-{VERSION}.zip"
IMAGE = os.environ.get("SSP_IMAGE", f"{REGION}-docker.pkg.dev/{PROJECT}/ssp/ssp-trainer:{VERSION}")
BEAM_IMAGE = os.environ.get("SSP_BEAM_IMAGE", f"{REGION}-docker.pkg.dev/{PROJECT}/ssp/ssp-beam-worker:{VERSION}")
NAMESPACE = os.environ.get("SSP_NAMESPACE", "ssp")
LAUNCHER_PYTHON = os.environ.get("SSP_LAUNCHER_PYTHON", "/opt/ssp/venv/bin/python")
ENGINE = os.environ.get("SSP_STATS_ENGINE", "spark")
if ENGINE not in ("spark", "beam"):
    raise ValueError(f"SSP_STATS_ENGINE must be spark or beam, got {ENGINE!r}")

# The paths of one scheduled run, rendered per run date (the layout of pipelines/training/run_dir.py)
RUN = "{{ params.bucket }}/runs/{{ ds }}"
DATA = RUN + "/private/data"  # the ingested data set (private)
DEST = "{{ params.bucket }}/models/{{ ds }}"

# `ssp ingest` of the day's raw tables: RAW/DATE/interactions.parquet (the private log) and
# RAW/DATE/items.parquet (the public catalog), with their own column names; the features are declared public.
INGEST = {
    "interactions": "{{ params.raw }}/{{ ds }}/interactions.parquet",
    "catalog": "{{ params.raw }}/{{ ds }}/items.parquet",
    "user-col": "user_id",
    "item-col": "item_id",
    # explicit ratings, on RATING_SCALE; leave it out for implicit feedback (clicks, plays: --protocol recall)
    "label-col": "rating",
    "timestamp-col": "timestamp",
    "title-col": "title",
    "features": "genres:bag,year:value",
    # the name of the data source: every weekly run on it, whatever its rows, charges its one account
    "data-source": "{{ params.data_source }}",
}
RATING_SCALE = ("0.5", "5")

# The product's default recipe (`TrainConfig`): for ratings with biases AM-SSP releases its statistics
# once (1 outer step), and every other setting follows the budget and the data's DP size. The graph
# has a task per outer step, so the step count is pinned here; tests/infra/test_dag.py checks it is
# the default's.
OUTER_STEPS = 1
# `ssp train` settings of every scheduled run (prepare records them in RUN/manifest.json).
TRAINING = {
    "protocol": "rmse",
    # Production mode: the published model trains on every row; evaluate then records the run (epsilon,
    # releases, timings) and that there is no held-out data. A small row-local monitoring share (e.g.
    # 0.02) would keep an RMSE in metrics.json at the cost of those training rows, but nothing in the
    # schedule reads it (publish does not gate on metrics), so the weekly run keeps every row.
    "holdout": 0,
    "engine": ENGINE,
    "outer-steps": OUTER_STEPS,
    "shards": 16,
}
BUDGET = {
    "epsilon": "{{ params.epsilon }}",
    "delta": "{{ params.delta }}",
    "budget-account": "{{ params.account }}",
    "account-cap": "{{ params.account_cap }}",
}

REGISTRY = {
    "SSP_BUDGET_ACCOUNTS": "{{ params.bucket }}/budget-accounts"
}  # the durable account registry (privacy.lifetime_budget)

GPU = k8s.V1ResourceRequirements(
    requests={"cpu": "4", "memory": "32Gi"}, limits={"nvidia.com/gpu": "1", "memory": "32Gi"}
)
CPU = k8s.V1ResourceRequirements(requests={"cpu": "4", "memory": "16Gi"}, limits={"memory": "16Gi"})


def flags(settings: dict) -> list[str]:
    """{"clip-u": 1.0} -> ["--clip-u", "1.0"]."""
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def ssp(task_id: str, *args: str, gpu: bool = False, env: dict[str, str] | None = None) -> KubernetesPodOperator:
    """`ssp ARGS` in the project image on Kubernetes (with environment variables `env`)."""
    return KubernetesPodOperator(
        task_id=task_id,
        name=f"ssp-{task_id.replace('_', '-')}",
        namespace=NAMESPACE,
        image=IMAGE,
        cmds=["ssp"],
        arguments=list(args),
        service_account_name="ssp-trainer",  # workload identity: read/write the data bucket
        container_resources=GPU if gpu else CPU,
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"} if gpu else None,
        tolerations=[k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")] if gpu else None,
        env_vars=[k8s.V1EnvVar(name=name, value=value) for name, value in {**REGISTRY, **(env or {})}.items()],
        get_logs=True,
        on_finish_action="delete_pod",
    )


def spark_job(task_id: str, script: str, args: list[str]) -> DataprocSubmitJobOperator:
    """`spark-submit --py-files ssp_recsys-VERSION.zip SCRIPT ARGS` on the Dataproc cluster."""
    job = copy.deepcopy(yaml.safe_load((CONFIG / "dataproc-job.yaml").read_text()))
    job["placement"] = {"cluster_name": CLUSTER}
    job["pyspark_job"].update(main_python_file_uri=f"{ARTIFACTS}/{script}", python_file_uris=[PY_FILES], args=args)
    return DataprocSubmitJobOperator(task_id=task_id, project_id=PROJECT, region=REGION, job=job)


def stats_flags(step: int) -> dict:
    """The stats job of outer step `step`: the run's own (its tables, settings and budget plan come from
    RUN/manifest.json, as `ssp train` would run it)."""
    return {"run": RUN, "step": step}


def dataflow_options() -> dict:
    """The Beam pipeline options of the Dataflow jobs (retrain/dataflow-options.yaml and the worker image)."""
    return {**yaml.safe_load((CONFIG / "dataflow-options.yaml").read_text()), "sdk_container_image": BEAM_IMAGE}


def prepare_env() -> dict[str, str]:
    """With SSP_STATS_ENGINE=beam the prepare stage's split, counts and mean run on Dataflow too:
    their pipeline options, as flags in $SSP_BEAM_PIPELINE_OPTIONS (pipelines/engines/prepare_beam.py). With
    Spark, the pod's local Spark session does it in bounded memory (it spills to disk)."""
    if ENGINE != "beam":
        return {}
    options = {
        "runner": "DataflowRunner",
        "project": PROJECT,
        "region": REGION,
        "job_name": "ssp-prepare-{{ ds_nodash }}",
        **dataflow_options(),
    }
    flags = []
    for key, value in options.items():
        flags += (
            [f"--{key}={item}" for item in value]
            if isinstance(value, list)
            else [f"--{key}" if value is True else f"--{key}={value}"]
        )
    return {"SSP_BEAM_PIPELINE_OPTIONS": " ".join(flags)}


def stats_task(step: int):
    if ENGINE == "spark":
        return spark_job(f"stats_{step}", "stats.py", flags(stats_flags(step)))
    return BeamRunPythonPipelineOperator(
        task_id=f"stats_{step}",
        runner="DataflowRunner",
        py_file="pipelines.beam_stats",
        py_options=["-m"],
        py_interpreter=LAUNCHER_PYTHON,
        default_pipeline_options=dataflow_options(),
        pipeline_options=stats_flags(step),
        dataflow_config={
            "job_name": f"ssp-stats-{step}",
            "project_id": PROJECT,
            "location": REGION,
            "wait_until_finished": True,
        },
    )


with DAG(
    dag_id="ssp_retrain",
    description="Private AM-SSP retraining: one run, one privacy budget, per schedule interval",
    schedule="@weekly",
    start_date=pendulum.datetime(2026, 1, 5, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10)},
    params={
        "bucket": Param("gs://ssp-recsys-data", type="string", description="storage root of runs and published models"),
        "raw": Param(
            "gs://ssp-recsys-data/raw",
            type="string",
            description="raw tables, one folder per run date holding interactions.parquet and items.parquet "
            "(columns: INGEST)",
        ),
        "epsilon": Param(
            1.0, type="number", exclusiveMinimum=0, description="epsilon of one run (the whole run's target)"
        ),
        "delta": Param(1e-6, type="number", exclusiveMinimum=0, exclusiveMaximum=1, description="delta of one run"),
        "data_source": Param(
            "movielens",
            type="string",
            pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
            description="the name of the data source the raw tables come from: every run on it, week after week, "
            "composes into its one budget account",
        ),
        "account": Param(
            "gs://ssp-recsys-data/budget-accounts/movielens.json",
            type="string",
            description="the data source's budget account: every run's releases are charged there",
        ),
        "account_cap": Param(
            20.0,
            type="number",
            exclusiveMinimum=0,
            description="lifetime epsilon cap of the data source's users (set when the account is created)",
        ),
    },
    tags=["ssp", "privacy"],
) as dag:
    ingest = ssp("ingest", "ingest", *flags(INGEST), "--rating-scale", *RATING_SCALE, "--out", DATA)
    prepare = ssp(
        "prepare",
        "train",
        "--stage",
        "prepare",
        "--data",
        DATA,
        "--out",
        RUN,
        *flags(BUDGET),
        *flags(TRAINING),
        env=prepare_env(),
    )
    steps = []
    for s in range(1, OUTER_STEPS + 1):
        steps += [
            spark_job(f"user_update_{s}", "user_update.py", ["--run", RUN, "--step", str(s)]),
            stats_task(s),
            ssp(f"item_update_{s}", "item-update", "--run", RUN, "--step", str(s), gpu=True),
        ]
    final_users = spark_job("final_user_update", "user_update.py", ["--run", RUN, "--final"])
    evaluate = ssp("evaluate", "evaluate", "--run", RUN)
    check_privacy = ssp(
        "check_privacy", "privacy", RUN, "--max-epsilon", "{{ params.epsilon }}", "--max-delta", "{{ params.delta }}"
    )
    publish = ssp("publish", "publish", "--run", RUN, "--to", DEST)
    chain(ingest, prepare, *steps, final_users, evaluate, check_privacy, publish)
