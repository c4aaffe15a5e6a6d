"""How much personal taste a user-level DP release can carry on a ranking run's data (issue 29's epsilon-1 point).

`python -m bench.taste_signal --run DIR [--epsilon 1] [--delta 1e-5] [--items K] [--rank R]`, DIR an
`ssp train --protocol recall` run folder (its private split and its DP counts; the run's model is not read).

What it measures, on the training users' positives over the K most popular items by DP count (default:
the 10% of the catalog the id models train on):
- the spectrum of G = sum_i x_i x_i^T, x_i user i's indicator row scaled to unit norm. G is the most
  any second-moment release can carry at the user level with one unit of sensitivity (the
  statistics A_j, b_j are projections of it onto the users' vectors). Its top eigenvalue is
  popularity; the next ones are the taste directions a personal ranking needs;
- the spectral norm of the Gaussian noise a release of G at (epsilon, delta) adds (a symmetric matrix
  of N(0, z^2) entries, z calibrated by privacy.accounting as a run's releases are; measured, not the
  2 z sqrt(K) bound), how many taste eigenvalues stand above it, and the epsilon at which the largest
  one would reach it (the norm scales with z);
- test Recall@20, Recall@50, NDCG@100 and coverage@20 of the fold-in (trainer.evaluate.ranking_report,
  the run's defaults: lambda_u 0.1, gravity 1, the popularity column) on G's top R eigenvectors scaled
  by the root of their eigenvalues,
  without noise and with it (the whole budget on G), with it keeping only the directions whose
  released eigenvalue is above 2 z sqrt(K) (the noise's norm, about: a rule from public quantities),
  against DP popularity on the run's counts.

A taste eigenvalue below the noise's norm is lost to any estimate of G's subspace from the release, so
a private ranking then has popularity's information and little else. Diagnostic over a run's private
split: read it only on synthetic or consented data; it releases nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from pipelines.data.splits import top_items


def _positions(path: str, catalog) -> tuple[np.ndarray, np.ndarray]:
    """(users, catalog positions of their items) of a split table; `catalog` a schemas.ids.IdIndex."""
    from schemas import storage

    table = storage.read_table(path, columns=["user_id", "item_id"])
    return table["user_id"].to_numpy(), catalog.positions(table["item_id"].to_numpy(), "item")


def taste_gram(users: np.ndarray, positions: np.ndarray, top: np.ndarray, m: int) -> np.ndarray:
    """G over the `top` catalog positions: each user's indicator row over them, scaled to unit norm."""
    column = np.full(m, -1)
    column[top] = np.arange(top.size)
    keep = column[positions] >= 0
    owners, row = np.unique(users[keep], return_inverse=True)
    x = np.zeros((owners.size, top.size))
    x[row, column[positions[keep]]] = 1.0
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.T @ x


def symmetric_noise(k: int, z: float, rng: np.random.Generator) -> np.ndarray:
    upper = np.triu(rng.normal(0.0, z, (k, k)))
    return upper + np.triu(upper, 1).T


def measure(run: str, epsilon: float, delta: float, items: int | None, rank: int, seed: int) -> dict:
    from privacy.accounting import Group, calibrate, epsilon_of, gaussian_event
    from schemas import storage
    from schemas.ids import IdIndex
    from trainer import evaluate
    from trainer.metrics import RANKING

    counts_table = storage.read_table(os.path.join(run, "counts", "counts.parquet")).sort_by(
        "item_id"
    )  # catalog positions: by id
    catalog_ids, counts = counts_table["item_id"].to_numpy(), counts_table["count"].to_numpy().astype(np.float64)
    catalog = IdIndex(catalog_ids)
    m = catalog_ids.size
    top_ids = (
        top_items(catalog_ids, counts) if items is None else catalog_ids[np.lexsort((catalog_ids, -counts))[:items]]
    )  # ties: the smaller id
    top = np.sort(catalog.positions(top_ids, "item"))
    k = top.size
    split = os.path.join(run, "private", "split")
    gram = taste_gram(*_positions(os.path.join(split, "train.parquet"), catalog), top, m)
    z = calibrate(epsilon, delta, [Group("gram", 1.0, 1)])["gram"]
    rng = np.random.default_rng(seed)
    noise = symmetric_noise(k, z, rng)
    noise_norm = float(np.abs(np.linalg.eigvalsh(noise)).max())
    clean = np.sort(np.linalg.eigvalsh(gram))[::-1]
    history = _positions(os.path.join(split, "test_history.parquet"), catalog)
    targets = _positions(os.path.join(split, "test_targets.parquet"), catalog)
    buckets = np.zeros(m, dtype=np.int64)

    bound = 2.0 * z * np.sqrt(k)  # the noise's spectral norm, about (public: z and K only)

    def ranking(g: np.ndarray, floor: float = -np.inf) -> dict:
        values, vectors = np.linalg.eigh(g)
        best = np.argsort(-values)[:rank]
        best = best[values[best] > floor]
        embedding = np.zeros((m, best.size))
        embedding[top] = vectors[:, best] * np.sqrt(np.maximum(values[best], 0.0))
        return evaluate.ranking_report(
            (*history, np.ones(history[0].size)),
            targets,
            evaluate.with_popularity(embedding, counts),
            0.1,
            item_buckets=buckets,
            gravity=1.0,
            confidence=True,
        )

    test = {
        "gram, no noise": ranking(gram),
        "gram, DP": ranking(gram + noise),
        "gram, DP, directions above 2 z sqrt(K)": ranking(gram + noise, bound),
        "DP popularity": evaluate.popularity_ranking_report(history, targets, counts, buckets),
    }
    return {
        "run": run,
        "epsilon": epsilon,
        "delta": delta,
        "items": k,
        "rank": rank,
        "noise_multiplier": z,
        "top_eigenvalues": [round(float(v), 2) for v in clean[: rank + 1]],
        "noise_spectral_norm": noise_norm,
        "taste_eigenvalues_above_noise": int(np.sum(clean[1:] > noise_norm)),
        "epsilon_where_the_largest_reaches_the_noise": epsilon_of([gaussian_event(z * clean[1] / noise_norm)], delta),
        **{f"test_{key}": {name: report[key] for name, report in test.items()} for key in RANKING},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.taste_signal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="an `ssp train --protocol recall` run folder")
    parser.add_argument(
        "--epsilon", type=float, default=1.0, help="the budget given to the release of G (default 1: all of a run's)"
    )
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--items",
        type=int,
        default=None,
        help="the K most popular items by DP count (default: the 10%% of the catalog the id models train on)",
    )
    parser.add_argument("--rank", type=int, default=16, help="eigenvectors in the fold-in's embedding (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="the noise's seed")
    args = parser.parse_args(argv)
    for name in ("train.parquet", "test_history.parquet", "test_targets.parquet"):
        if not os.path.exists(os.path.join(args.run, "private", "split", name)):
            parser.error(f"{args.run}: no private/split/{name}; give a folder of `ssp train --protocol recall`")
    print(json.dumps(measure(args.run, args.epsilon, args.delta, args.items, args.rank, args.seed), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
