"""What a Spark cluster's executors need to run the jobs, built by one command:
`ssp spark-package [--out DIR] [--python PATH]` writes

  DIR/ssp_recsys-VERSION.zip     the project's packages, for --py-files (pipelines.engines.spark.project_zip)
  DIR/ssp-executor-env.tar.gz    a slim Python environment, for --archives DIR/ssp-executor-env.tar.gz#env

and prints the spark-submit line that ships both (client deploy mode: the driver is this machine's
Python, with the full install). The environment holds only what the executors' tasks of the stats
job and the user update import (EXECUTOR_DISTRIBUTIONS and their installed, marker-satisfied
requirements, copied file by file from this Python's installation as their RECORDs list them; no
TensorFlow, no Beam, none of Spark's jars) in a venv layout whose bin/python is a symlink to the
nodes' interpreter, as venv-pack makes it: every node must have Python 3.11 at that path. A
subprocess of the built environment imports the executors' modules from it and the zip before
the archive is written.

Privacy: none of its own; it ships code and libraries, no data.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipelines.engines.spark import ROOT, project_zip
from schemas.errors import UserError

PYTHON_VERSION = "3.11"
ENV_ARCHIVE = "ssp-executor-env.tar.gz"
ENV_NAME = "env"  # the folder Spark unpacks the archive into, in each executor's working directory (--archives ...#env)
# What the executors' tasks import, with their requirements: the tasks' own imports (numpy, pyarrow, scipy.sparse in
# privacy.accumulator, attrs in privacy.accounting, cryptography for the noise's keystream, numba's kernels,
# threadpoolctl around the user update's solves), the
# storage of gs:// tables (fsspec, gcsfs) and Spark's Python workers (pyspark, py4j: the workers import the nodes' own
# python/lib/pyspark.zip first where their Spark has one, as Spark's distributions and pip's pyspark 4.3 do).
EXECUTOR_DISTRIBUTIONS = (
    "numpy",
    "pyarrow",
    "scipy",
    "attrs",
    "cryptography",
    "numba",
    "threadpoolctl",
    "fsspec",
    "gcsfs",
    "pyspark",
)
# What the check imports: the jobs' task modules, the kernels they import inside tasks, gs:// storage, Spark's worker.
EXECUTOR_MODULES = (
    "pipelines.engines.spark_stats",
    "pipelines.engines.user_solves",
    "privacy.box_muller",
    "privacy.grouped_gram",
    "trainer.normal_equations",
    "gcsfs",
    "pyspark.worker",
)
PYSPARK_PAYLOAD = ("jars", "bin", "sbin", "python", "examples", "data", "licenses")  # Spark's own: the nodes have it
LEFT_OUT_FOLDERS = (
    "__pycache__",
    "tests",
)  # bytecode as RECORD lists it (_place_bytecode adds this installation's) and test suites
COMPRESSION_LEVEL = 1  # gzip level 6 makes the archive 12% smaller (155 MiB) and takes 3 times as long
SITE_PACKAGES = PurePosixPath("lib", f"python{PYTHON_VERSION}", "site-packages")


@dataclass(frozen=True)
class Shipment:
    project: Path  # the --py-files zip
    env: Path  # the --archives tarball
    node_python: str  # what the environment's bin/python links to
    distributions: tuple[str, ...]  # "name==version" of what the environment holds
    env_bytes: int  # its size unpacked


def version() -> str:
    """The project's version, from pyproject.toml."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]["version"]


def default_python() -> str:
    """This machine's base interpreter (the one this Python's venv was made from)."""
    return os.path.join(sys.base_prefix, "bin", f"python{PYTHON_VERSION}")


def check_interpreter(path: str) -> None:
    """Refuse a --python that is not an absolute path, or that this machine has and is not Python 3.11. A path this
    machine lacks is taken as the nodes' own (it is only linked to)."""
    if not os.path.isabs(path):
        raise UserError(f"--python {path}: give the absolute path of the nodes' Python {PYTHON_VERSION}")
    if not os.path.exists(path):
        return
    try:
        found = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    except OSError as exc:
        raise UserError(f"--python {path}: cannot run it ({exc.strerror})") from None
    if found != PYTHON_VERSION:
        found = f"Python {found}" if found else "not Python"
        raise UserError(f"--python {path}: is {found}, the environment needs Python {PYTHON_VERSION}")


def distributions(names: tuple[str, ...] = EXECUTOR_DISTRIBUTIONS) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` and, recursively, their requirements that are installed and whose markers
    hold (with the extras asked for), sorted by name."""
    found: dict[str, importlib.metadata.Distribution] = {}
    walked: dict[str, set[str]] = {}
    todo = [(name, frozenset(), True) for name in names]
    while todo:
        name, extras, named = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if named:
                raise UserError(f"{name} is not installed in {sys.prefix}: the executors need it") from None
            continue
        key = canonicalize_name(dist.metadata["Name"])
        if key in walked and extras <= walked[key]:
            continue
        found[key] = dist
        walked.setdefault(key, set()).update(extras)
        for requirement in map(Requirement, dist.requires or []):
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                todo.append((requirement.name, frozenset(requirement.extras), False))
    return [found[key] for key in sorted(found)]


def kept_files(dist: importlib.metadata.Distribution) -> list[PurePosixPath]:
    """The files of `dist` the environment gets, relative to site-packages: its installed files (RECORD) there, less
    bytecode, test suites and, for pyspark, Spark's own payload."""
    if dist.files is None:
        raise UserError(f"{dist.metadata['Name']}: its installed files are not recorded (no RECORD); reinstall it")
    kept = []
    for file in map(PurePosixPath, dist.files):
        if file.parts[0] == ".." or any(part in LEFT_OUT_FOLDERS for part in file.parts):
            continue  # scripts, headers and data outside site-packages; the folders left out
        if file.parts[0] == "pyspark" and len(file.parts) > 1 and file.parts[1] in PYSPARK_PAYLOAD:
            continue
        kept.append(file)
    return kept


def link_interpreter(folder: Path, python: str) -> None:
    """Make the environment at `folder` run `python`: bin/python3.11 links to it, pyvenv.cfg names its folder."""
    link = folder / "bin" / f"python{PYTHON_VERSION}"
    link.unlink(missing_ok=True)
    link.symlink_to(python)
    settings = {"home": os.path.dirname(python), "include-system-site-packages": "false", "version": PYTHON_VERSION}
    (folder / "pyvenv.cfg").write_text("".join(f"{key} = {value}\n" for key, value in settings.items()))


def place(source: Path, target: Path) -> None:
    """A hard link to `source` at `target` (nothing writes to the environment's files), a copy across filesystems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def build_env(folder: Path, python: str) -> tuple[list[str], int]:
    """A venv layout at `folder` (as `python3.11 -m venv --without-pip` makes it, less the activate scripts) holding
    the executors' distributions, its bin/python a symlink to `python`; ("name==version", ...) and its bytes."""
    site = folder / SITE_PACKAGES
    site.mkdir(parents=True)
    (folder / "lib64").symlink_to("lib")  # where a Python built with platlibdir lib64 looks
    (folder / "bin").mkdir()
    for name in ("python", "python3"):
        (folder / "bin" / name).symlink_to(f"python{PYTHON_VERSION}")
    link_interpreter(folder, python)
    names, size = [], 0
    for dist in distributions():
        names.append(f"{dist.metadata['Name']}=={dist.version}")
        for file in kept_files(dist):
            source, target = Path(dist.locate_file(file)), site / file
            if source.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                place(source, target)
                size += target.stat().st_size
                size += _place_bytecode(source, target)
    return names, size


def _place_bytecode(source: Path, target: Path) -> int:
    """The bytecode this installation compiled for a module (setup.sh compiles every one), beside its copy: the
    executors' Python workers then start without compiling (nodes often forbid writing bytecode); its bytes."""
    if source.suffix != ".py":
        return 0
    compiled = Path(importlib.util.cache_from_source(str(source)))
    if not compiled.is_file():
        return 0
    placed = Path(importlib.util.cache_from_source(str(target)))
    placed.parent.mkdir(exist_ok=True)
    place(compiled, placed)
    return placed.stat().st_size


def check_env(folder: Path, project: Path) -> None:
    """Import EXECUTOR_MODULES with the environment's Python, from it and the project zip only (-I: no PYTHONPATH,
    no user site-packages; the venv: none of the base interpreter's), writing no bytecode into it (-B)."""
    code = (
        f"import importlib, sys\nsys.path.insert(0, {str(project)!r})\nfor name in {EXECUTOR_MODULES!r}:\n"
        "    importlib.import_module(name)"
    )
    result = subprocess.run(
        [str(folder / "bin" / "python"), "-I", "-B", "-c", code], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise UserError(f"the executor environment cannot import the jobs' task modules: {last}")


def build(out: str | Path = "dist", node_python: str | None = None) -> Shipment:
    """Write the project zip and the executor environment's archive to `out` (see the module docstring)."""
    node_python = node_python or default_python()
    check_interpreter(node_python)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    project = Path(project_zip(str(out / f"ssp_recsys-{version()}.zip")))
    env = out / ENV_ARCHIVE
    with tempfile.TemporaryDirectory(prefix="ssp-env-") as scratch:
        folder = Path(scratch) / ENV_NAME
        local_python = node_python if os.path.exists(node_python) else default_python()  # what the check runs here
        names, size = build_env(folder, local_python)
        check_env(folder, project)
        if local_python != node_python:
            link_interpreter(folder, node_python)
        partial = env.with_name(env.name + ".partial")
        with tarfile.open(partial, "w:gz", compresslevel=COMPRESSION_LEVEL) as archive:
            for child in sorted(os.listdir(folder)):  # the layout at the archive's root: Spark unpacks it into ./env
                archive.add(folder / child, arcname=child)
        os.replace(partial, env)
    return Shipment(project, env, node_python, tuple(names), size)


def spark_submit_line(
    shipment: Shipment,
    master: str = "spark://HOST:PORT",
    script: str = "stats.py",
    args: tuple[str, ...] = ("--run", "RUN", "--step", "S"),
) -> list[str]:
    """The spark-submit command that runs `script` on the cluster with what `shipment` ships: the executors run the
    shipped environment's Python; the driver (client mode) this Python."""
    return [
        "spark-submit",
        "--master",
        master,
        "--py-files",
        str(shipment.project),
        "--archives",
        f"{shipment.env}#{ENV_NAME}",
        "--conf",
        f"spark.pyspark.python=./{ENV_NAME}/bin/python",
        "--conf",
        f"spark.pyspark.driver.python={sys.executable}",
        script,
        *args,
    ]


def report(shipment: Shipment) -> str:
    """What was written, with sizes, and the spark-submit line."""
    mb = 1 << 20
    checked = "" if os.path.exists(shipment.node_python) else f" (not on this machine: checked with {default_python()})"
    return "\n".join(
        (
            f"{shipment.project}: {shipment.project.stat().st_size / mb:.1f} MiB, the project's packages (--py-files)",
            f"{shipment.env}: {shipment.env.stat().st_size / mb:.1f} MiB ({shipment.env_bytes / mb:.0f} MiB "
            "unpacked), the "
            f"executors' Python (--archives): {len(shipment.distributions)} distributions, "
            + ", ".join(shipment.distributions),
            f"its bin/python is a symlink to {shipment.node_python}, as venv-pack makes it: every node needs that "
            f"interpreter{checked}",
            "run a job with (client mode: the driver is this machine's Python):",
            shlex.join(spark_submit_line(shipment)),
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ssp spark-package`'s flags."""
    parser.add_argument("--out", default="dist", help="folder to write them to (default: %(default)s)")
    parser.add_argument(
        "--python",
        default=None,
        help=f"absolute path of the nodes' Python {PYTHON_VERSION}, which the environment's bin/python "
        "links to (default: this machine's base interpreter)",
    )


def run(args: argparse.Namespace) -> int:
    """`ssp spark-package`: build, then print what was built and the spark-submit line."""
    print(report(build(args.out, args.python or default_python())))
    return 0
