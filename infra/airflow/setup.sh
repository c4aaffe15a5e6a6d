#!/usr/bin/env bash
# Create .venv-airflow: Apache Airflow and the providers the retraining DAG uses, at the exact
# versions of infra/airflow/requirements.lock. A separate environment because Airflow's dependency
# set cannot share the project's lock (numpy 2 and protobuf 6 against TensorFlow 2.15's numpy < 2
# and protobuf < 5). It is used to parse the DAG (tests/infra/test_dag.py), not to run the project.
# The environment (2 GiB, about 5 minutes to install) is built once per machine and lock, in the
# user's cache folder (as pre-commit keeps its hook environments), and .venv-airflow links to it:
# every clone on the machine shares it. SSP_AIRFLOW_CACHE sets another cache folder.
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

want=$(sha256sum infra/airflow/requirements.lock | cut -d' ' -f1)
cache=${SSP_AIRFLOW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssp}
venv=$cache/venv-airflow-${want:0:16}
mkdir -p "$cache"
exec 9>"$venv.lock"  # one creator at a time (parallel test workers, clones side by side)
flock 9
if [ ! -f "$venv/.installed" ]; then
  echo "infra/airflow/setup.sh: creating $venv with Airflow and its providers (a few minutes, once per machine)..." >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r infra/airflow/requirements.lock
  "$venv/bin/python" -m compileall -q -j 0 "$venv"/lib/python3*/site-packages >/dev/null 2>&1 || true  # as ../../setup.sh: bytecode on every core
  echo "$want" > "$venv/.installed"
fi
if [ "$(readlink .venv-airflow 2>/dev/null)" != "$venv" ]; then
  rm -rf .venv-airflow
  ln -s "$venv" .venv-airflow
fi
