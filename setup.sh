#!/usr/bin/env bash
# Set up the project on a fresh machine: check Python 3.11 and Java 17, create .venv, install the
# locked dependency set (requirements.lock) and the project itself (editable); with --tests also the
# tests' system package (Debian's chromium, as root). Safe to re-run: an up-to-date .venv is left as it is.
set -euo pipefail
cd "$(dirname "$0")"

python=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    python=$candidate; break
  fi
done
if [ -z "$python" ]; then
  echo "setup: Python 3.11 is required (TF-Privacy 0.9 declares Python < 3.12 and imports TensorFlow's removed estimator; what 3.12 takes: CONTRIBUTING.md); none found on PATH." >&2
  exit 1
fi

java_major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1 || true)
if [ -z "$java_major" ] || [ "$java_major" -lt 17 ]; then
  echo "setup: Java 17 or newer is required by Spark (pyspark 4.3) but ${java_major:+only Java $java_major was }${java_major:-no java was }found." >&2
  echo "       On Debian/Ubuntu: apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME and PATH to a JDK 17." >&2
  exit 1
fi

if [ "${1:-}" = "--tests" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then  # the report page's test opens it headless
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the tests (about a minute)..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: the tests open RUN/report.html in a headless Chromium: install chromium (apt-get install chromium, as root)." >&2
    exit 1
  fi
fi

stamp=.venv/.installed
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: creating .venv with $("$python" --version) and the locked dependencies (about a minute)..." >&2
"$python" -m venv .venv
# --no-cache-dir: pip's cache would keep a second copy of every wheel (about 2.7 GB) beside the venv.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-compile -r requirements.lock
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
# Bytecode for every installed module, on every core (pip compiles one file at a time): about 20 s here.
# Without it, where PYTHONDONTWRITEBYTECODE is set (as in many images) every process compiles
# TensorFlow again: 15 s to import it instead of 5, in each of the tests' hundreds of processes.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true  # a few packages ship files that never compile
echo "$want" > "$stamp"
echo "setup: done; the 'ssp' command is .venv/bin/ssp" >&2
