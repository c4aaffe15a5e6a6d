#!/usr/bin/env bash
# Dataproc initialization action (infra/dataproc/cluster.yaml): the project's locked dependencies in
# /opt/ssp/venv on every node, the Python of the DAG's Spark jobs (spark.pyspark.python in
# infra/dags/retrain/dataproc-job.yaml). The project itself arrives with each job, as the wheel in
# the job's python_file_uris; Spark brings pyspark, and TensorFlow belongs to the trainer image.
set -euo pipefail
lock=$(/usr/share/google/get_metadata_value attributes/ssp-requirements)
python=/opt/conda/default/bin/python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the lock needs Python 3.11, found " + sys.version'
gsutil cp "$lock" /tmp/ssp-requirements.lock
grep -v -E '^(pyspark|tensorflow|tensorflow-[a-z-]+|tf-keras|keras|tensorboard|tensorboard-[a-z-]+)==' /tmp/ssp-requirements.lock > /tmp/ssp-spark.txt
"$python" -m venv /opt/ssp/venv
/opt/ssp/venv/bin/pip install --quiet --no-cache-dir --no-deps -r /tmp/ssp-spark.txt
