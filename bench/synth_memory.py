"""Peak memory and wall time of the synthetic data generator at 10^7 ratings.

Runs `pipelines.data.synth.generate` in a fresh child interpreter (so the figure is the generator's own,
imports included, and not this script's) and reports the child's wall time and peak resident set
size (the child's own VmHWM, bench.child). The generator streams interactions chunk by chunk, so its peak
must not grow with the row count; the target is under 1 GiB.

    python -m bench.synth_memory                     # 333,334 users x 30 ratings, 20,000 items
    python -m bench.synth_memory --users 1000000 --out /tmp/synth-1m

Exit status 0 when the peak is within --limit-mib, 1 when above it, 2 when the child failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from bench.child import run_measured

_CHILD = """
from pipelines.data.synth import generate
dataset = generate(**json.loads(sys.argv[1]))
result = {"ratings": dataset.manifest["ratings"], "users": dataset.manifest["users"]}
"""


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(
    out: str, users: int, items: int, ratings_per_user: int, *, alpha: float, seed: int, rank: int, progress: bool
) -> dict:
    """Generate into `out` in a child process; its wall time, peak RSS and output size."""
    kwargs = {
        "out": out,
        "users": users,
        "items": items,
        "ratings_per_user": ratings_per_user,
        "alpha": alpha,
        "seed": seed,
        "rank": rank,
        "progress": progress,
    }
    report = run_measured(_CHILD, kwargs)
    return {**report, "wall_s": report["wall_seconds"], "bytes_written": _folder_bytes(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.synth_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--users", type=int, default=333_334, help="users (default %(default)s: 10^7 ratings with K=30)"
    )
    parser.add_argument("--items", type=int, default=20_000, help="catalog items (default %(default)s)")
    parser.add_argument("--ratings-per-user", type=int, default=30, help="ratings per user K (default %(default)s)")
    parser.add_argument("--alpha", type=float, default=1.0, help="popularity exponent (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument("--rank", type=int, default=8, help="planted model rank (default %(default)s)")
    parser.add_argument("--out", help="data set folder to write and keep (default: a temporary folder, deleted)")
    parser.add_argument("--limit-mib", type=float, default=1024.0, help="peak RSS target in MiB (default %(default)s)")
    parser.add_argument("--progress", action="store_true", help="show the generator's progress bar")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="synth-bench-") as scratch:
        out = args.out or os.path.join(scratch, "data")
        try:
            result = measure(
                out,
                args.users,
                args.items,
                args.ratings_per_user,
                alpha=args.alpha,
                seed=args.seed,
                rank=args.rank,
                progress=args.progress,
            )
        except RuntimeError as exc:
            print(f"synth_memory: {exc}", file=sys.stderr)
            return 2
    ok = result["peak_rss_mib"] <= args.limit_mib
    print(
        f"synth: {result['ratings']:,} ratings ({result['users']:,} users x {args.ratings_per_user}, {args.items:,} "
        "items), "
        f"{result['bytes_written'] / 2**20:.0f} MiB on disk\n"
        f"wall time {result['wall_s']:.1f} s ({result['ratings'] / result['wall_s'] / 1e6:.2f} M ratings/s), "
        f"child peak RSS {result['peak_rss_mib']:.0f} MiB "
        f"({'within' if ok else 'OVER'} the {args.limit_mib:.0f} MiB target)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
