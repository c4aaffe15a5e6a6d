"""The `ssp` command: one entry point with a subcommand per job, above every other layer (nothing
imports it).

Bad input (missing or damaged files, malformed rows, impossible parameters) and a machine that
cannot take the output (a read-only or full disk, a file-size limit) end with a one-line error naming
the file or setting and exit status 2 (pipelines.base.command, pipelines.base.failures); anything
else is a bug and keeps its traceback.

Privacy: none of its own; every command's releases go through its run's ledger.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import re
import sys

from schemas.errors import UserError

# TensorFlow's native log, before it is imported: 2.15 logs three spurious "Unable to register cuDNN/cuFFT/cuBLAS
# factory" errors at every import. Its real failures reach us as Python exceptions; set 0 to see its log.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The imports below come after the environment set-up above on purpose (TensorFlow reads its log
# level at import): E402 is expected there.
from pipelines.base import command, logs  # noqa: E402
from pipelines.data import ingest, splits, synth  # noqa: E402
from pipelines.engines import shipping  # noqa: E402
from pipelines.engines.engine import add_engine_argument, engine_of  # noqa: E402
from pipelines.releases import counts, release, stats_job  # noqa: E402
from pipelines.training import commands as train_commands  # noqa: E402
from pipelines.training import publish, user_stage  # noqa: E402
from pipelines.training.evaluation import describe  # noqa: E402
from pipelines.training.settings import TrainConfig  # noqa: E402
from pipelines.training.stages import run as run_training  # noqa: E402
from pipelines.training.stats_stage import stats_job_of_run  # noqa: E402
from privacy.ledger import Ledger  # noqa: E402
from schemas import storage  # noqa: E402
from trainer import recommend  # noqa: E402

FOLDER_OUTPUTS = {
    "demo": "out",
    "train": "out",
    "ingest": "out",
    "synth": "out",
    "split": "out",
    "counts": "out",
    "stats": "out",
    "publish": "to",
}


def _run_split(args: argparse.Namespace) -> int:
    data = ingest.load_or_ingest(args.data, storage.join(args.out, "data"), progress=True)
    with engine_of(args.engine) as engine:
        return splits.run(args, data, engine)


def _run_counts(args: argparse.Namespace) -> int:
    with engine_of(args.engine) as engine:
        return counts.run(args, engine)


def _run_demo(args: argparse.Namespace) -> int:
    config = TrainConfig.create(data=args.data, out=args.out, epsilon=args.epsilon, non_private=args.non_private)
    metrics = run_training(config)
    print(describe(metrics))
    return 0


def _run_stats(args: argparse.Namespace) -> int:
    job = stats_job.StatsJob.from_args(args, stats_job_of_run)
    if job is None:  # a run whose statistics cover no item: nothing to release (said on stderr)
        return 0
    with engine_of(args.engine, app="ssp-stats", master=args.master) as engine:
        summary = engine.release_stats(job)
    print(stats_job.describe(summary))
    return 0


def _run_privacy(args: argparse.Namespace) -> int:
    for name, limit in (("--max-epsilon", args.max_epsilon), ("--max-delta", args.max_delta)):
        if limit is not None and not (math.isfinite(limit) and limit >= 0):
            raise UserError(f"{name} must be a finite number >= 0, got {limit}")
    path = args.run if args.run.endswith(".parquet") else storage.join(args.run, "ledger.parquet")
    ledger = Ledger.open(path)
    if not args.run.endswith(".parquet"):  # a run folder: its own seed file witnesses what the ledger must list
        release.check_ledger_complete(ledger, storage.join(args.run, "private", "seed"))
    if args.format == "md":
        if args.run.endswith(".parquet"):
            raise UserError("--format md needs a run folder (the report reads the run's settings), not a ledger file")
        from pipelines.training.run_dir import Run

        print(publish.privacy_report(Run(args.run)), end="")
    else:
        print(ledger.describe())
    spent = ledger.epsilon_spent()
    if args.max_epsilon is not None and not spent <= args.max_epsilon * (1 + publish.TOLERANCE):
        raise UserError(f"{path}: epsilon spent {spent:.6g} exceeds the allowed {args.max_epsilon:g}")
    if args.max_delta is not None and not ledger.budget["delta"] <= args.max_delta:
        raise UserError(f"{path}: the run's delta {ledger.budget['delta']:g} exceeds the allowed {args.max_delta:g}")
    ledger.check_account()  # a run that took its data source past the account's cap is refused
    return 0


def _run_bench(argv: list[str], name: str = "bench") -> int:
    """`ssp bench ...` is `python -m bench ...` (its own parser and --help): the experiment harness
    sits above the pipelines, so it is imported only here, when asked for. A failure is one line,
    exit 2, as for every other command."""
    from bench.__main__ import main as bench_main

    out = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--out"), None)
    return command.run(name, lambda: bench_main(argv), output=out)


def _version() -> str:
    """The installed package's version (pyproject.toml is its one source)."""
    try:
        return importlib.metadata.version("ssp-recsys")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run ./setup.sh)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, reading `-inf`, `-1e-5` and `-.5` as values (argparse's own test of a
    negative number knows only `-1` and `-1.5`, and takes the others for flags): a negative setting
    then gets its range's message, not "expected one argument"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-((\d+\.?\d*|\.\d+)(e[-+]?\d+)?|inf(inity)?|nan)$", re.I)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ssp",
        description="Differentially private recommendation training with public item features (AM-SSP).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="the main job on the bundled MovieLens data: private AM-SSP training (regression protocol) and its "
        "evaluation",
    )
    demo.add_argument(
        "--data", default=ingest.BUNDLED, help="MovieLens or data set folder (default: the bundled ml-latest-small)"
    )
    demo.add_argument(
        "--out",
        default="runs/demo",
        help="run directory: the ledger, the model and metrics.json land there (default: %(default)s)",
    )
    demo.add_argument(
        "--epsilon",
        type=float,
        default=10.0,
        help="user-level epsilon of the whole run (default: %(default)s; delta 1e-5)",
    )
    demo.add_argument(
        "--non-private", action="store_true", help="the same pipeline without noise or clipping, for comparison"
    )
    demo.set_defaults(handler=_run_demo)

    train_cmd = commands.add_parser(
        "train", help="the end-to-end training run (alternating minimization, DP statistics, SSP trainer, evaluation)"
    )
    train_commands.add_arguments(train_cmd)
    train_cmd.set_defaults(handler=train_commands.main)

    ingest_cmd = commands.add_parser(
        "ingest",
        help="read a MovieLens folder, or your own interactions and catalog tables (Parquet or CSV), into the "
        "canonical tables",
    )
    ingest.add_arguments(ingest_cmd)
    ingest_cmd.set_defaults(handler=ingest.run)

    synth_cmd = commands.add_parser(
        "synth", help="generate a synthetic data set (power-law items, planted low-rank ratings)"
    )
    synth.add_arguments(synth_cmd)
    synth_cmd.set_defaults(handler=synth.run)

    split_cmd = commands.add_parser(
        "split", help="split a data set by a benchmark protocol (rmse: 80/10/10 ratings; recall: held-out users)"
    )
    splits.add_arguments(split_cmd)
    add_engine_argument(split_cmd)
    split_cmd.set_defaults(handler=_run_split, data=ingest.BUNDLED)

    counts_cmd = commands.add_parser("counts", help="release the DP item counts (first release of a run)")
    counts.add_arguments(counts_cmd)
    add_engine_argument(counts_cmd)
    counts_cmd.set_defaults(handler=_run_counts)

    stats_cmd = commands.add_parser(
        "stats", help="release the noised A_j, b_j of every item (Spark, or Beam with --engine beam)"
    )
    stats_job.add_arguments(stats_cmd)
    add_engine_argument(stats_cmd)
    stats_cmd.add_argument(
        "--master",
        help="Spark master URL for a job run outside spark-submit (default: local[*], every core of this machine)",
    )
    stats_cmd.set_defaults(handler=_run_stats)

    user_cmd = commands.add_parser("user-update", help="solve every user's embedding against item embeddings (Spark)")
    user_stage.add_arguments(user_cmd)
    user_cmd.set_defaults(handler=user_stage.main)

    item_cmd = commands.add_parser(
        "item-update", help="a run's item update of outer step s (TensorFlow), from its released statistics"
    )
    train_commands.add_stage_arguments(item_cmd, step=True)
    item_cmd.set_defaults(handler=train_commands.item_update_main)

    evaluate_cmd = commands.add_parser(
        "evaluate",
        help="evaluate a finished run (test/valid metrics, epsilon spent) into RUN/metrics.json and RUN/report.html",
    )
    train_commands.add_stage_arguments(evaluate_cmd, step=False)
    train_commands.add_metrics_at(evaluate_cmd)
    evaluate_cmd.set_defaults(handler=train_commands.evaluate_main)

    publish_cmd = commands.add_parser(
        "publish",
        help="copy a finished run's encoder, item embeddings and privacy summary to a destination, "
        "if its ledger is within budget",
    )
    publish.add_arguments(publish_cmd)
    publish_cmd.set_defaults(handler=publish.main)

    commands.add_parser(
        "bench",
        add_help=False,
        help="reproduce the paper's experiments into a report (`ssp bench --help`; same as `python -m bench`)",
    )
    commands.add_parser(
        "audit",
        add_help=False,
        help="empirical privacy audit of the real releases with canary users (`ssp audit --help`; bench.audit)",
    )

    recommend_cmd = commands.add_parser(
        "recommend",
        help="top-k items for users from a published model and their own history, "
        "solved on this machine (Parquet in, Parquet or CSV out)",
    )
    recommend.add_arguments(recommend_cmd)
    recommend_cmd.set_defaults(handler=recommend.run)

    package_cmd = commands.add_parser(
        "spark-package",
        help="build what a Spark cluster's executors need (the project zip, a slim Python "
        "environment) and print the spark-submit line that ships them",
    )
    shipping.add_arguments(package_cmd)
    package_cmd.set_defaults(handler=shipping.run)

    privacy_cmd = commands.add_parser("privacy", help="print a run's privacy ledger and the epsilon spent")
    privacy_cmd.add_argument("run", help="run folder (holding ledger.parquet) or a ledger file")
    privacy_cmd.add_argument(
        "--format",
        choices=("text", "md"),
        default="text",
        help="text: the ledger as a table (default); md: the run's privacy report for a reviewer (its privacy.md)",
    )
    privacy_cmd.add_argument(
        "--max-epsilon", type=float, help="fail (exit status 2) if the ledger has spent more than this epsilon"
    )
    privacy_cmd.add_argument(
        "--max-delta", type=float, help="fail (exit status 2) if the run's delta is larger than this"
    )
    privacy_cmd.set_defaults(handler=_run_privacy)
    for name, subcommand in commands.choices.items():
        if name not in ("bench", "audit"):  # they parse their own flags
            command.add_verbosity(subcommand)
    return parser


def _given_flags(argv: list[str]) -> set[str]:
    """The settings given on the command line itself (they override a --config file): the parse of
    `argv` by a parser without defaults."""
    parser = build_parser()
    for commands in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        for sub in commands.choices.values():
            for action in sub._actions:
                action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command", "handler", "config"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["audit"]):  # `ssp audit ...` is `python -m bench audit ...`
        return _run_bench(argv[1:] if argv[0] == "bench" else argv, argv[0])
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.verbosity)
    if getattr(args, "config", None):
        args.explicit = _given_flags(argv)

    def checked_and_run() -> int:
        flag = FOLDER_OUTPUTS.get(args.command)
        if flag and getattr(args, flag, None) is not None:  # before anything is read or written
            if not getattr(args, flag).strip():
                raise UserError(f"--{flag} is empty: give a folder")
            storage.require_folder_target(getattr(args, flag), f"--{flag}")
        return args.handler(args)

    return command.run(
        args.command,
        checked_and_run,
        output=next((getattr(args, name) for name in ("out", "to", "run") if getattr(args, name, None)), None),
    )


def entry() -> None:
    """The installed `ssp` command. A failed command leaves at once, without tearing down what it
    loaded (Arrow's and TensorFlow's thread pools, a JVM gateway): their native destructors, run at
    interpreter exit while a worker thread is still alive, can abort the process ("terminate
    called without an active exception", exit 134) after the error line was printed."""
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
