"""`python -m bench EXPERIMENT --out DIR [--quick] [--seeds N]`: run registered experiments.

Each experiment module registers itself with `bench.harness.experiment`; adding one is adding its
module to MODULES. `all` runs every registered experiment in order. Results accumulate in
DIR/results.json (finished cells are reused), figures in DIR/*.png, the report in DIR/report.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from bench import harness

MODULES = ("bench.complexity", "bench.theorem")


def main(argv: list[str] | None = None) -> int:
    for module in MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="python -m bench", description="Reproduce the paper's experiments into a report.")
    commands = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, spec in [*((n, e.help) for n, e in harness.EXPERIMENTS.items()), ("all", "every experiment above, in order")]:
        sub = commands.add_parser(name, help=spec, description=spec)
        sub.add_argument("--out", required=True, help="output folder: results.json, report.md, PNGs (reruns resume from results.json)")
        sub.add_argument("--quick", action="store_true", help="small sizes: seconds to a minute per experiment")
        sub.add_argument("--seeds", type=int, default=3, help="seeds (repeats) per setting (default 3)")
        sub.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    names = list(harness.EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        start = time.perf_counter()
        harness.run_experiment(name, args.out, quick=args.quick, seeds=args.seeds, progress=not args.no_progress)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"report: {args.out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
