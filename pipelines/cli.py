"""The `ssp` command: one entry point with a subcommand per job.

Bad input (missing files, malformed rows, impossible parameters) ends with a one-line error naming
the problem and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from pipelines import ingest, splits, synth
from pipelines.movielens import IngestError
from schemas import SchemaError, storage

USER_ERRORS = (IngestError, SchemaError, storage.MissingTableError, ValueError)


def _run_split(args: argparse.Namespace) -> int:
    data = ingest.load_or_ingest(args.data, storage.join(args.out, "data"), progress=True)
    return splits.run(args, data)


def _run_demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    data = ingest.load_or_ingest(args.data, storage.join(args.out, "data"), progress=True)
    print(ingest.describe(data))
    print(f"done in {time.perf_counter() - started:.1f} s; outputs under {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssp",
        description="Differentially private recommendation training with public item features (AM-SSP).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="the main job on the bundled MovieLens data: ingest it and print a summary")
    demo.add_argument("--data", default=ingest.BUNDLED, help="MovieLens or data set folder (default: the bundled ml-latest-small)")
    demo.add_argument("--out", default="runs/demo", help="output folder (default: %(default)s)")
    demo.set_defaults(handler=_run_demo)

    ingest_cmd = commands.add_parser("ingest", help="read a MovieLens folder into the canonical tables")
    ingest.add_arguments(ingest_cmd)
    ingest_cmd.set_defaults(handler=ingest.run)

    synth_cmd = commands.add_parser("synth", help="generate a synthetic data set (power-law items, planted low-rank ratings)")
    synth.add_arguments(synth_cmd)
    synth_cmd.set_defaults(handler=synth.run)

    split_cmd = commands.add_parser("split", help="split a data set by a benchmark protocol (rmse: 80/10/10 ratings; recall: held-out users)")
    splits.add_arguments(split_cmd)
    split_cmd.set_defaults(handler=_run_split, data=ingest.BUNDLED)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except USER_ERRORS as exc:
        print(f"ssp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ssp {args.command}: interrupted; nothing partial was published", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
