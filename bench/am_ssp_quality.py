"""Privacy-utility of the end-to-end AM-SSP run: the figures the trainer's acceptance asks for.

1. ml-latest-small (bundled), regression protocol, user level, delta 1e-5: the non-private run of
   the pipeline, then epsilon 1, 5 and 20 with `--seeds` seeds each (fresh noise seed and model
   seed per run): mean and std of test RMSE against the RMSE of predicting the run's DP mean.
   With 610 users user-level DP leaves little signal; the requirement is graceful degradation.
2. Synthetic data (100,000 users, 5,000 items, 30 ratings per user): the mean predictor, the
   non-private run of the same pipeline (the private defaults, d=8 and features only, without the
   noise), and epsilon 5 and 1: the share of the gap between the mean predictor and the
   non-private run that AM-SSP closes.

Every run is the real pipeline (`pipelines.training.stages.run`: Spark jobs, ledger, TensorFlow trainer),
sharing one Spark session. Results go to `--out`/results.json and a table on stdout.

    python -m bench.am_ssp_quality --out runs/quality            # both parts (about 15 minutes)
    python -m bench.am_ssp_quality --out runs/quality --skip-synthetic --seeds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from pipelines.data import synth
from pipelines.engines.spark import session
from pipelines.training import settings, stages
from schemas import storage

SMALL_EPSILONS = (1.0, 5.0, 20.0)
SYNTHETIC_EPSILONS = (5.0, 1.0)


def _run(config: settings.TrainConfig, spark) -> dict:
    print(f"am_ssp_quality: {config.out}", file=sys.stderr, flush=True)
    metrics = stages.run(config, spark=spark, progress=False)
    return {
        "test_rmse": metrics["test_rmse"],
        "mean_predictor_rmse": metrics["test_mean_predictor_rmse"],
        "epsilon_spent": metrics["epsilon_spent"],
        "seconds": metrics["seconds"],
    }


def small_data(out: str, seeds: int, base: settings.TrainConfig, spark) -> dict:
    # the non-private top line with its own defaults (d=32 with the item id), as `ssp demo --non-private`
    results = {
        "non_private": _run(
            settings.TrainConfig.create(out=storage.join(out, "small-nonprivate"), non_private=True), spark
        )
    }
    for epsilon in SMALL_EPSILONS:
        runs = [
            _run(
                base.replace(out=storage.join(out, f"small-eps{epsilon:g}-seed{s}"), epsilon=epsilon, model_seed=s),
                spark,
            )
            for s in range(seeds)
        ]
        rmse = [r["test_rmse"] for r in runs]
        mean_rmse = [r["mean_predictor_rmse"] for r in runs]
        results[f"eps{epsilon:g}"] = {
            "test_rmse_mean": statistics.mean(rmse),
            "test_rmse_std": statistics.stdev(rmse) if len(rmse) > 1 else 0.0,
            "mean_predictor_rmse_mean": statistics.mean(mean_rmse),
            "worse_than_mean_predictor_by": statistics.mean(rmse) - statistics.mean(mean_rmse),
            "runs": runs,
        }
    return results


def synthetic(out: str, base: settings.TrainConfig, spark) -> dict:
    data = storage.join(out, "synthetic-data")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        synth.generate(data, users=100_000, items=5_000, ratings_per_user=30, seed=0)
    base = base.replace(data=data)
    # the same pipeline without noise: the private defaults' d and features, only the noise removed
    non_private = _run(base.replace(out=storage.join(out, "synthetic-nonprivate"), non_private=True), spark)
    results = {"non_private": non_private, "mean_predictor_rmse": non_private["mean_predictor_rmse"]}
    gap = non_private["mean_predictor_rmse"] - non_private["test_rmse"]
    for epsilon in SYNTHETIC_EPSILONS:
        run = _run(base.replace(out=storage.join(out, f"synthetic-eps{epsilon:g}"), epsilon=epsilon), spark)
        run["gap_closed"] = (run["mean_predictor_rmse"] - run["test_rmse"]) / gap
        results[f"eps{epsilon:g}"] = run
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.am_ssp_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the runs and results.json")
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per epsilon on the small data (default: %(default)s)"
    )
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--skip-synthetic", action="store_true")
    args = parser.parse_args(argv)
    base = settings.TrainConfig.create()
    results = {"config": {k: v for k, v in base.flags().items() if k not in ("data", "out")}}
    with session("ssp-quality") as spark:
        if not args.skip_small:
            results["ml_latest_small"] = small_data(args.out, args.seeds, base, spark)
        if not args.skip_synthetic:
            results["synthetic"] = synthetic(args.out, base, spark)
    storage.write_json(json.loads(json.dumps(results, default=str)), storage.join(args.out, "results.json"))
    if "ml_latest_small" in results:
        small = results["ml_latest_small"]
        print(f"ml-latest-small, test RMSE: non-private {small['non_private']['test_rmse']:.4f}")
        for epsilon in SMALL_EPSILONS:
            r = small[f"eps{epsilon:g}"]
            print(
                f"  epsilon {epsilon:>4g}: {r['test_rmse_mean']:.4f} +- {r['test_rmse_std']:.4f}  (DP-mean predictor "
                f"{r['mean_predictor_rmse_mean']:.4f}; difference {r['worse_than_mean_predictor_by']:+.4f})"
            )
    if "synthetic" in results:
        syn = results["synthetic"]
        print(
            f"synthetic 100k users, test RMSE: mean predictor {syn['mean_predictor_rmse']:.4f}, non-private "
            f"{syn['non_private']['test_rmse']:.4f}"
        )
        for epsilon in SYNTHETIC_EPSILONS:
            r = syn[f"eps{epsilon:g}"]
            print(f"  epsilon {epsilon:>4g}: {r['test_rmse']:.4f}  (closes {100 * r['gap_closed']:.0f}% of the gap)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
