"""`python -m bench EXPERIMENT --out DIR [--quick] [--seeds N] [--data ML_DIR] [--protocol P] [--methods ...]
[--epsilons ...] [--tune-on DIR]`.

Each experiment module registers itself with `bench.harness.experiment`; adding one is adding its
module to MODULES. `all` runs every registered experiment in order. Results accumulate in
DIR/results.json (finished cells are reused), figures in DIR/*.png, the report in DIR/report.md.
The training experiments run on --data (any MovieLens folder or data set folder; default: the
bundled ml-latest-small) under --protocol, for the --methods of bench.training.METHODS; use one
DIR per data set and protocol (their sections describe the latest invocation). privacy-utility
tunes on --tune-on's validation split when given (transfer mode; default: --data's own) and runs
the --epsilons given (default: its own list); both select cells, so it can run in parts into one DIR.
`python -m bench audit ...` is the privacy audit (`ssp audit`, bench.audit), with its own flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from bench import harness, training

MODULES = (
    "bench.privacy_utility",
    "bench.time_to_quality",
    "bench.resampling",
    "bench.long_tail",
    "bench.complexity",
    "bench.theorem",
    "bench.perf",
    "bench.scale",
    "bench.federated_quality",
    "bench.convex",
    "bench.new_items",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["audit"]:  # the privacy audit (`ssp audit`) has its own flags and exit status
        from bench import audit

        return audit.main(argv[1:])
    for module in MODULES:
        importlib.import_module(module)
    # the report's (and `all`'s) order is MODULES', whatever imported the modules first
    rank = {module: position for position, module in enumerate(MODULES)}
    ordered = sorted(harness.EXPERIMENTS.items(), key=lambda item: rank.get(item[1].run.__module__, len(rank)))
    harness.EXPERIMENTS.clear()
    harness.EXPERIMENTS.update(ordered)
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Reproduce the paper's experiments into a report."
    )
    commands = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, spec in [
        *((n, e.help) for n, e in harness.EXPERIMENTS.items()),
        ("all", "every experiment above, in order"),
    ]:
        sub = commands.add_parser(name, help=spec, description=spec)
        sub.add_argument(
            "--out",
            required=True,
            help="output folder: results.json, report.md, PNGs (reruns resume from results.json)",
        )
        sub.add_argument("--quick", action="store_true", help="small sizes: seconds to a minute per experiment")
        sub.add_argument("--seeds", type=int, default=3, help="seeds (repeats) per setting (default 3)")
        sub.add_argument("--no-progress", action="store_true", help="no progress bars")
        sub.add_argument(
            "--data",
            help="MovieLens folder (any layout) or data set folder of the training experiments "
            "(default: the bundled ml-latest-small)",
        )
        sub.add_argument(
            "--protocol",
            choices=("rmse", "recall"),
            default="rmse",
            help="benchmark protocol of the training experiments (default: rmse)",
        )
        sub.add_argument(
            "--methods",
            nargs="+",
            choices=list(training.METHODS),
            metavar="METHOD",
            help=f"methods of the training experiments, of {', '.join(training.METHODS)} "
            "(default: all that pipelines.training offers)",
        )
        sub.add_argument(
            "--epsilons",
            nargs="+",
            type=float,
            metavar="EPSILON",
            help="privacy-utility: the epsilons to run (default: 1 5 10 20; --quick: 1 10); "
            "with --methods, runs the experiment in parts",
        )
        sub.add_argument(
            "--tune-on",
            metavar="DATA",
            help="privacy-utility: tune every method on this data set's validation split (e.g. an "
            "`ssp synth --like movielens` set) and run the chosen settings on --data's test split (transfer mode; "
            "default: tune on --data)",
        )
        sub.add_argument(
            "--trials",
            type=int,
            help="privacy-utility: trials per (method, epsilon) study (default 12; --quick: 2); 1: every method at "
            "its defaults (defaults against defaults: use its own --out)",
        )
    args = parser.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        parser.error(f"--trials must be at least 1, got {args.trials}")
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.epsilons and not all(0 < e < float("inf") for e in args.epsilons):
        parser.error(f"--epsilons must be finite and > 0, got {args.epsilons}")
    names = list(harness.EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        start = time.perf_counter()
        harness.run_experiment(
            name,
            args.out,
            quick=args.quick,
            seeds=args.seeds,
            progress=not args.no_progress,
            data=args.data,
            protocol=args.protocol,
            methods=args.methods,
            epsilons=args.epsilons,
            tune_on=args.tune_on,
            trials=args.trials,
        )
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"report: {args.out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
