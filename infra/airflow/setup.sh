#!/usr/bin/env bash
# Create .venv-airflow: Apache Airflow and the providers the retraining DAG uses, at the exact
# versions of infra/airflow/requirements.lock. A separate environment because Airflow's dependency
# set cannot share the project's lock (numpy 2 and protobuf 6 against TensorFlow 2.15's numpy < 2
# and protobuf < 5). It is used to parse the DAG (tests/infra/test_dag.py), not to run the project.
# Safe to re-run: an up-to-date .venv-airflow is left as it is (about 3 minutes the first time).
set -euo pipefail
cd "$(dirname "$0")/../.."

python=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    python=$candidate; break
  fi
done
if [ -z "$python" ]; then
  echo "infra/airflow/setup.sh: Python 3.11 is required; none found on PATH." >&2
  exit 1
fi

venv=.venv-airflow
exec 9>"$venv.lock"  # one creator at a time (parallel test workers)
flock 9
stamp=$venv/.installed
want=$(sha256sum infra/airflow/requirements.lock | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "infra/airflow/setup.sh: creating $venv with Airflow and its providers (a few minutes)..." >&2
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r infra/airflow/requirements.lock  # bytecode on first import
echo "$want" > "$stamp"
