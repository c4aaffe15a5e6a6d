#!/usr/bin/env bash
# Build what a deployment ships, and with --push upload it:
#   dist/ssp_recsys-VERSION-py3-none-any.whl  the project, installed in the images
#   dist/ssp_recsys-VERSION.zip                the project's packages, which Spark ships to executors
#                                             (--py-files / python_file_uris: PySpark puts only .zip,
#                                             .egg and .jar files on the executors' sys.path)
#   dist/ssp-executor-env.tar.gz               the executors' slim Python environment (--archives ...#env),
#                                             for clusters whose nodes lack the dependencies; its
#                                             bin/python links to $NODE_PYTHON (default: this machine's)
#   (both by pipelines/engines/shipping.py, which prints the spark-submit line that uses them)
#   the three images of infra/docker/Dockerfile (trainer, beam-worker, spark)
# With --push ARTIFACTS REGISTRY it uploads the .zip, the Spark entry scripts (spark-submit's main
# files), requirements.lock and the Dataproc initialization action to ARTIFACTS/ssp-recsys/VERSION/
# (the DAG's SSP_ARTIFACTS) and pushes the images to REGISTRY (e.g. europe-west4-docker.pkg.dev/P/ssp).
# Usage: [NODE_PYTHON=/path/on/the/nodes/python3.11] infra/build.sh [--push gs://BUCKET REGISTRY]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
version=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
wheel=dist/ssp_recsys-$version-py3-none-any.whl

rm -rf dist build
"$python" -m pip wheel --quiet --no-deps --no-build-isolation . -w dist
"$python" -m ssp.cli spark-package --out dist ${NODE_PYTHON:+--python "$NODE_PYTHON"}
for target in trainer beam-worker spark; do
  docker build -f infra/docker/Dockerfile --target "$target" --build-arg WHEEL="$wheel" -t "ssp-$target:$version" .
done
echo "built $wheel and images ssp-{trainer,beam-worker,spark}:$version" >&2

if [ "${1:-}" = "--push" ]; then
  artifacts="$2/ssp-recsys/$version" registry=$3
  gsutil cp "dist/ssp_recsys-$version.zip" pipelines/stats.py pipelines/user_update.py requirements.lock infra/dataproc/install-deps.sh "$artifacts/"
  for target in trainer beam-worker spark; do
    docker tag "ssp-$target:$version" "$registry/ssp-$target:$version"
    docker push "$registry/ssp-$target:$version"
  done
  echo "pushed to $artifacts and $registry" >&2
fi
