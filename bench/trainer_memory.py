"""Peak memory of the SSP trainer on stats for many items: it must not grow with the item count.

Writes a synthetic catalog (genres and year features) and a stats table of random PSD A_j and b_j
for `--items` items (default 500,000, d = 64: about 8.6 GB of Parquet), streamed, then runs one
epoch of `trainer.ssp.train` in a fresh child interpreter and reports its peak resident set size
(the child's own VmHWM) next to the same run on a catalog 10x smaller, measured in the same
invocation. The trainer streams item minibatches through a bounded shuffle buffer, so the two peaks
should be close and under 2 GiB. The encoder uses the public features without the item-id family
(whose table, a model parameter, does grow with the catalog).

    python -m bench.trainer_memory                 # 500,000 items, d = 64
    python -m bench.trainer_memory --items 50000 --dim 32
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from bench.child import run_measured

_CHILD = """
import time
from schemas import storage
from trainer import ssp
from trainer.encoder import ItemEncoder
from trainer.features import FeatureSpace
args = json.loads(sys.argv[1])
items = storage.read_table(args["items"])
space = FeatureSpace.from_items(items, use_item_id=False)
del items
encoder = ItemEncoder(space, args["dim"])
started = time.perf_counter()
losses = ssp.train(
    encoder, [args["stats"]], ssp.SSPConfig(epochs=1, batch_size=512, psd_projection=False), progress=False
)
result = {"seconds": time.perf_counter() - started, "loss": losses[-1]}
"""


def write_inputs(folder: str, items: int, dim: int, seed: int = 0) -> tuple[str, str]:
    """A catalog with genres and year, and a stats table of random PSD statistics, streamed."""
    import numpy as np
    import pyarrow as pa

    from pipelines.releases.stats_core import stats_table
    from privacy.accumulator import packed_size
    from schemas import storage
    from schemas.tables import STATS, items_schema

    rng = np.random.default_rng(seed)
    ids = np.arange(1, items + 1, dtype=np.int64)
    genres = [[f"g{g}" for g in rng.choice(20, rng.integers(1, 4), replace=False)] for _ in range(items)]
    catalog = pa.table(
        {
            "item_id": ids,
            "title": pa.nulls(items, pa.string()),
            "genres": genres,
            "year": rng.integers(1950, 2024, items),
        },
        schema=items_schema({"genres": "multivalent", "year": "univalent"}),
    )
    storage.write_table(catalog, os.path.join(folder, "items.parquet"))
    meta = {"d": dim, "noise_multiplier": 1.0, "clip_u": 1.0, "clip_y": 1.0, "wbar": 1.0, "release": 0, "resample": 0}
    rows, cols = np.triu_indices(dim)
    path = os.path.join(folder, "stats.parquet")
    with storage.TableWriter(
        path, STATS.with_metadata({k.encode(): str(v).encode() for k, v in meta.items()})
    ) as writer:
        for start in range(0, items, 20_000):
            n = min(20_000, items - start)
            factors = rng.normal(size=(n, dim, 4))
            a = np.einsum("nik,njk->nij", factors, factors)[:, rows, cols]
            assert a.shape[1] == packed_size(dim)
            writer.write(stats_table(ids[start : start + n], a, rng.normal(size=(n, dim)), meta).to_batches()[0])
    return os.path.join(folder, "items.parquet"), path


def measure(folder: str, items: int, dim: int) -> dict:
    """Peak RSS and time of one training epoch in a child interpreter."""
    catalog, stats = write_inputs(folder, items, dim)
    report = run_measured(_CHILD, {"items": catalog, "stats": stats, "dim": dim})
    return {
        "items": items,
        "dim": dim,
        "peak_rss_mib": report["peak_rss_mib"],
        "train_seconds": report["seconds"],
        "wall_seconds": report["wall_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=500_000, help="items in the large catalog (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension d (default: %(default)s)")
    parser.add_argument("--limit-mib", type=float, default=2048, help="target peak (default: %(default)s MiB)")
    parser.add_argument("--keep", help="keep the generated inputs in this folder")
    args = parser.parse_args(argv)
    results = []
    for items in (max(1, args.items // 10), args.items):
        folder = tempfile.mkdtemp(prefix="ssp-trainer-mem-", dir=args.keep)
        try:
            print(f"trainer_memory: {items:,} items, d={args.dim} ...", file=sys.stderr, flush=True)
            results.append(measure(folder, items, args.dim))
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    small, large = results
    for r in results:
        print(
            f"{r['items']:>9,} items, d={r['dim']}: peak RSS {r['peak_rss_mib']:.0f} MiB, one epoch "
            f"{r['train_seconds']:.1f} s"
        )
    ratio = large["peak_rss_mib"] / small["peak_rss_mib"]
    ok = large["peak_rss_mib"] < args.limit_mib
    print(
        f"peak grows {ratio:.2f}x for {large['items'] / small['items']:.0f}x the items; {'within' if ok else 'OVER'} "
        f"the {args.limit_mib:.0f} MiB target"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
