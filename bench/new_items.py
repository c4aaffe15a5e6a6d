"""What the public features buy for new items: items held out of training, ranked from their features alone.

A share of the catalog (SHARE, chosen by a keyed hash of the item id among the items with at least one
interaction) is held out: a derived data set keeps the whole catalog, every feature, and every
interaction but those of the new items (`hold_out`). Each feature-based method of bench.training.METHODS
(those whose encoder is the public features: the starting point, AM-SSP, AM-DPSGD, and any with the
DP item-Gram start in its overrides) trains on it under the recall protocol, at its defaults, at each
epsilon and seed. A cell then scores the run's held-out test users: their fold-in histories
(the run's test_history, over trained items) folded in against the run's item embeddings as the run's
evaluation does (the popularity column, the fold-in's gravity), and ranks ONLY the new items, each
embedded as a publication serves a new item (`served_vectors`: the exported encoder on its public
features, with its popularity by features in the popularity column); the
targets are those users' original positives on the new items (the run's positive threshold, from the
original data set). New-item Recall@20, Recall@50, NDCG@100 and coverage@20 (trainer.metrics), over the
users with at least one such target, against two baselines on the same users and items:

- popularity by features: each new item scored by the mean DP count (the run's counts release) of the
  trained items that share each of its feature values, averaged over its values (`popularity_by_features`);
- random: a seeded random ranking, and the expected Recall@20 of a uniform one;

and, as a non-private reference, popularity by features from the exact positives per trained item; and the
model again with the embeddings the run gave the new items inside its catalog (their residuals solved
from statistics that, for an item without interactions, are noise).

The fold-in mirrors trainer.evaluate.ranking_report's (`fold_in`; a test holds them equal). Cells are
harness cells; the run directory is deleted once the cell is measured.

Privacy: the runs are the pipeline's own (ledger, accountant, fresh noise); the metrics are evaluations
on held-out private rows (trusted side), as a run's metrics.json. Popularity by features reads only the
counts release and the public features; its exact-count reference is a trusted-side diagnostic.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench import harness, training
from pipelines.data import splits
from pipelines.data.datasets import Dataset, is_dataset, open_dataset, write_dataset
from pipelines.training import evaluation, stages
from pipelines.training.run_dir import Run, config_of
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.tables import validate_item_embeddings
from trainer import evaluate, metrics
from trainer.feature_popularity import popularity_by_features
from trainer.features import FeatureSpace
from trainer.solve import confidence, logistic_solve, ridge_solve, user_bias_ridge

NAME = "new-items"
SHARE = 0.1  # of the items with at least one interaction
HOLDOUT_SEED = 52  # the keyed hash that picks them (one held-out set for every cell)
PURPOSE = "new-item"
K = 20
BLOCK = 1024  # users ranked at a time
# the manifest fields write_dataset computes from the tables (the derived set's own)
_COMPUTED = ("public_features", "items", "ratings", "users", "rated_items", "label_range", "created_at")


def sizes(quick: bool) -> dict:
    """Epsilons, default methods and the base config every cell sets. Quick: short training."""
    if quick:
        return {"epsilons": [5.0], "methods": ["none", "ssp"], "base": {"epochs": 10, "outer_steps": 2}}
    return {"epsilons": [5.0], "methods": ["none", "ssp", "dpsgd"], "base": {}}


def feature_based(name: str) -> bool:
    """Whether a method trains an encoder of the public features (so it can score an item it never saw)."""
    method = training.METHODS[name]
    return method.kind == "train" and method.overrides.get("encoder") == "features"


def new_items(data: Dataset, share: float = SHARE, seed: int = HOLDOUT_SEED) -> np.ndarray:
    """The held-out item ids (sorted): the round(share * n) of the n items with an interaction whose
    keyed hash (splits.row_uniform of the item id) is smallest."""
    if not 0.0 < share < 1.0:
        raise UserError(f"the new items' share must be in (0, 1), got {share}")
    seen = np.unique(
        np.concatenate(
            [np.unique(b.column("item_id").to_numpy()) for b in storage.iter_batches(data.interactions, ["item_id"])]
            or [np.zeros(0, np.int64)]
        )
    )
    chosen = round(share * seen.size)
    if chosen < 1:
        raise UserError(f"{data.path}: {seen.size} items with interactions hold no {share:g} share to hold out")
    order = np.lexsort((seen, splits.row_uniform(seed, PURPOSE, seen)))
    return np.sort(seen[order[:chosen]])


def hold_out(data: Dataset, out: str, share: float = SHARE, seed: int = HOLDOUT_SEED) -> Dataset:
    """The derived data set in `out` (written once): the whole catalog with every feature, every
    interaction but the new items'."""
    if is_dataset(out):
        return open_dataset(out)
    held = pa.array(new_items(data, share, seed))
    manifest = {key: value for key, value in data.manifest.items() if key not in _COMPUTED}
    manifest["new_items"] = {"from": data.path, "share": share, "seed": seed, "held_out": len(held)}
    batches = (
        batch.filter(pc.invert(pc.is_in(batch.column("item_id"), value_set=held)))
        for batch in storage.iter_batches(data.interactions)
    )
    return write_dataset(out, storage.read_table(data.items), batches, manifest)


def derived_path(out: str, data: str, share: float = SHARE, seed: int = HOLDOUT_SEED) -> str:
    path = os.path.abspath(data)
    slug = f"{os.path.basename(path.rstrip('/'))}-{zlib.crc32(path.encode()):08x}-new-{share:g}-{seed}"
    return os.path.join(out, "data", slug)


def positives(
    data: Dataset, threshold: float | None, users: np.ndarray | None = None, items: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (user, item) positives of a data set, of `users` on `items` when given: labels above
    `threshold` (the protocol's, splits.positive_threshold_for), every interaction when it is None."""
    found_users, found_items = [], []
    for batch in storage.iter_batches(data.interactions, ["user_id", "item_id", "label"]):
        u, i, label = (batch.column(c).to_numpy() for c in ("user_id", "item_id", "label"))
        keep = np.ones(u.size, dtype=bool) if threshold is None else label > threshold
        if users is not None:
            keep &= np.isin(u, users)
        if items is not None:
            keep &= np.isin(i, items)
        found_users.append(u[keep])
        found_items.append(i[keep])
    pairs = np.unique(
        np.stack([np.concatenate(found_users or [[]]), np.concatenate(found_items or [[]])], axis=1).astype(np.int64),
        axis=0,
    )
    return pairs[:, 0], pairs[:, 1]


def fold_in(config, history: tuple[np.ndarray, np.ndarray, np.ndarray], vectors: np.ndarray):
    """(sorted users, their vectors): the ranking fold-in of trainer.evaluate.ranking_report with the
    run's settings (as pipelines.training.evaluation passes them) on `vectors` (the whole catalog,
    the popularity column included when the run has it)."""
    users, positions, labels = history
    if config.loss == "logistic":
        return logistic_solve(users, vectors[positions], vectors, config.lambda_u)
    gravity = config.fold_in_gravity
    return ridge_solve(
        users,
        vectors[positions],
        labels,
        config.lambda_u,
        scale_by_rows=True,
        gravity=gravity * (vectors.T @ vectors) if gravity > 0 else None,
        bias_ridge=user_bias_ridge(config.protocol, config.biases, config.lambda_bias),
        confidence=config.loss == "square",
    )


def ranking(scores_of, evaluated: np.ndarray, targets: tuple[np.ndarray, np.ndarray], n: int) -> dict:
    """trainer.metrics.ranking_metrics of `scores_of(chunk of users)` (chunk x n scores) against the
    targets (users, positions among the n ranked items), no history masked."""

    def blocks():
        for start in range(0, evaluated.size, BLOCK):
            chunk = evaluated[start : start + BLOCK]
            yield (
                scores_of(chunk),
                np.zeros((chunk.size, n), dtype=bool),
                evaluate.user_item_mask(chunk, *targets, n),
            )

    out = metrics.ranking_metrics(blocks())
    out.pop("sliced")
    return out


def expected_random_recall(targets_per_user: np.ndarray, n: int, k: int = K) -> float:
    """Mean Recall@k of a uniform random ranking of n items: min(k, n) t / (n min(k, t)) for t targets."""
    t = np.asarray(targets_per_user, dtype=np.float64)
    return float(np.mean(min(k, n) * t / (n * np.minimum(k, t))))


def score_run(run: Run, original: Dataset, held: np.ndarray, seed: int) -> dict:
    """A finished run's new-item metrics on its test users: the model's, popularity by features' (DP
    counts; exact counts), a seeded random ranking's, and a uniform ranking's expected Recall@20."""
    manifest = run.prepared()
    config = config_of(run, manifest)
    prepared = manifest["prepared"]
    items = storage.read_table(prepared["items"])
    catalog = FeatureSpace(items["item_id"].to_numpy(), [])
    new = np.isin(catalog.item_ids, held)
    table = validate_item_embeddings(storage.read_table(run.path("item_embeddings.parquet")), dim=config.vector_dim)
    vectors = np.zeros((catalog.size, config.vector_dim))
    vectors[catalog.index_of(table["item_id"].to_numpy())] = list_column_to_matrix(
        table["embedding"], config.vector_dim, "item embedding"
    )
    counts = evaluation.fold_in_counts(run, config, catalog)
    if counts is not None:
        vectors = evaluate.with_popularity(vectors, counts, config.biases)
    history = storage.read_table(storage.join(run.split, "test_history.parquet"))
    alpha = prepared.get("confidence_alpha")
    labels = np.ones(history.num_rows) if alpha is None else confidence(history["label"].to_numpy(), alpha)
    users, solved = fold_in(
        config, (history["user_id"].to_numpy(), catalog.index_of(history["item_id"].to_numpy()), labels), vectors
    )
    threshold = storage.read_json(storage.join(run.split, splits.SPLIT_MANIFEST))["positive_threshold"]
    new_ids = catalog.item_ids[new]
    t_users, t_items = positives(original, threshold, users, new_ids)
    t_positions = np.searchsorted(new_ids, t_items)
    evaluated, per_user = np.unique(t_users, return_counts=True)
    if evaluated.size == 0:
        raise UserError(f"{run.root}: no test user has a positive on a new item: nothing to rank")
    n = int(new.sum())
    new_vectors = vectors[new]
    features = FeatureSpace.from_items(items, use_item_id=False)
    popular = popularity_by_features(features, evaluation.catalog_counts(run, catalog), new)
    exact = np.bincount(catalog.index_of(positives(open_dataset(config.data), threshold)[1]), minlength=catalog.size)
    popular_exact = popularity_by_features(features, exact, new)
    rng = np.random.default_rng(seed)
    spent = Ledger.open(run.ledger).epsilon_spent()
    served = served_vectors(run, config, items, new)
    if counts is not None:  # the popularity column of each new item from its features, not its own DP count
        at = evaluate.popularity_position(vectors.shape[1] - 1, config.biases)
        new_vectors = new_vectors.copy()
        new_vectors[:, at] *= popular / np.maximum(counts[new], 1.0)
        served = np.insert(served, at, new_vectors[:, at], axis=1)
    return {
        "model": ranking(lambda c: solved[np.searchsorted(users, c)] @ served.T, evaluated, (t_users, t_positions), n),
        "model_in_catalog": ranking(
            lambda c: solved[np.searchsorted(users, c)] @ new_vectors.T, evaluated, (t_users, t_positions), n
        ),
        "popularity_by_features": ranking(
            lambda c: np.broadcast_to(popular, (c.size, n)), evaluated, (t_users, t_positions), n
        ),
        "popularity_by_features_exact": ranking(
            lambda c: np.broadcast_to(popular_exact, (c.size, n)), evaluated, (t_users, t_positions), n
        ),
        "random": ranking(lambda c: rng.random((c.size, n)), evaluated, (t_users, t_positions), n),
        "random_expected_recall_at_20": expected_random_recall(per_user, n),
        "new_items": n,
        "targets": int(t_users.size),
        "users": int(evaluated.size),
        "epsilon_spent": spent if math.isfinite(spent) else None,
    }


def served_vectors(run: Run, config, items: pa.Table, new: np.ndarray) -> np.ndarray:
    """The `new` items' embeddings as a publication serves a new item (trainer.recommend's embed_new_items:
    the exported encoder's `embed_features`, the shared encoder on its public features, no residual),
    from the run's last checkpoint (the exported encoder's variables)."""
    from pipelines.training.model import build_encoder, item_vectors
    from trainer import encoder as encoders

    _, model = build_encoder(config, items)
    encoders.restore_checkpoint(model, run.checkpoint(config.outer_steps))
    return item_vectors(config, model.embed_all(shared=True)[new])


def cell_params(data: str, name: str, epsilon: float | None, config: dict, seed: int) -> dict:
    return {
        **training.cell_params(data, "recall", name, epsilon, config, seed),
        "share": SHARE,
        "holdout_seed": HOLDOUT_SEED,
    }


def run_cell(out: str, params: dict) -> dict:
    """Train one cell on the derived data set, score its new items (`score_run`), delete the run."""
    original = open_dataset(training.dataset(out, params["data"]))
    derived = hold_out(original, derived_path(out, params["data"], params["share"], params["holdout_seed"]))
    held = new_items(original, params["share"], params["holdout_seed"])
    root = training.run_root(out, params)
    config = training.train_config(params, derived.path, root)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    with open(os.path.join(out, "runs", "train.log"), "a", encoding="utf-8") as log, contextlib.redirect_stderr(log):
        print(f"== {os.path.basename(root)} {params}", file=log, flush=True)
        began = time.time()
        metrics_of_run = stages.run(config, spark=training.spark(), progress=False)
        value = score_run(Run(root), original, held, params["seed"])
    value.update(test_recall_at_20=metrics_of_run["test_recall_at_20"], seconds=time.time() - began)
    shutil.rmtree(root)
    return value


def _mean_sd(values) -> str:
    mean, sd = training.mean_std(values)
    return f"{mean:.4f} ± {sd:.4f}"


@harness.experiment(
    NAME,
    "new items: a share of the catalog held out of training, ranked from public features alone, against "
    "popularity by features and random",
)
def run(ctx: harness.Context) -> harness.Section:
    size = sizes(ctx.quick)
    epsilons = sorted(ctx.epsilons) if ctx.epsilons else size["epsilons"]
    asked = training.select(ctx.methods or size["methods"])
    names = [n for n in asked if feature_based(n) and training.available(n)]
    skipped = [n for n in asked if n not in names]
    if not names:
        raise UserError(f"none of the methods {asked} trains a features encoder: nothing scores a new item")
    data = training.data_of(ctx.data)
    groups = [(n, e) for n in names for e in (epsilons if training.METHODS[n].private else [None])]
    params = [
        cell_params(data, n, e, training.cell_config(n, size["base"], {}), training.TEST_SEED + s)
        for n, e in groups
        for s in range(ctx.seeds)
    ]
    values = ctx.results.run(NAME, params, lambda p: run_cell(ctx.out, p), ctx.progress, f"{NAME}: cells")
    by_group: dict = {}
    for p, value in zip(params, values, strict=True):
        by_group.setdefault((p["method"], p["epsilon"]), []).append(value)
    first = values[0]
    section = harness.Section("New items: what the public features buy")
    base = f" with {size['base']}" if size["base"] else ""
    section.text(
        f"Data: `{data}`. {first['new_items']} new items ({SHARE:.0%} of the items with an interaction, keyed hash "
        f"seed {HOLDOUT_SEED}) lose every interaction; each method trains on the rest under `--protocol recall` at "
        f"its defaults{base} (delta {training.DELTA:g}, "
        f"{ctx.seeds} seed(s), fresh noise each). Its test users ({first['users']} with a positive on a new item, "
        f"{first['targets']} such positives) are folded in on their histories over the trained items as the run's "
        "evaluation does and rank the new items only. Popularity by features: each new item scored by the mean DP "
        "count of the trained items sharing each of its feature values (the run's counts release). Random: a seeded "
        f"random ranking (a uniform one's expected Recall@{K}: "
        f"{first['random_expected_recall_at_20']:.4f})."
        + (f" Skipped (no features encoder): {', '.join(skipped)}." if skipped else "")
    )
    rows = []
    for (name, epsilon), cells in by_group.items():
        rows.append(
            [
                training.METHODS[name].label,
                "-" if epsilon is None else f"{epsilon:g}",
                _mean_sd([c["model"]["recall_at_20"] for c in cells]),
                _mean_sd([c["model"]["ndcg_at_100"] for c in cells]),
                _mean_sd([c["model_in_catalog"]["recall_at_20"] for c in cells]),
                _mean_sd([c["popularity_by_features"]["recall_at_20"] for c in cells]),
                f"{cells[0]['popularity_by_features_exact']['recall_at_20']:.4f}",
                _mean_sd([c["random"]["recall_at_20"] for c in cells]),
                _mean_sd([c["test_recall_at_20"] for c in cells]),
                len(cells),
            ]
        )
    section.table(
        [
            "method",
            "epsilon",
            f"new-item Recall@{K}",
            "new-item NDCG@100",
            f"the new items' own catalog embeddings, Recall@{K}",
            f"popularity by features, Recall@{K}",
            "the same from exact counts (non-private)",
            f"random, Recall@{K}",
            f"trained items, test Recall@{K}",
            "seeds",
        ],
        rows,
    )
    section.text(
        "Mean ± sample sd over seeds; the baselines on the same runs' users, new items and counts release. The "
        "model embeds each new item as a publication serves one (the exported encoder on its public features, no "
        "residual of its own) and gives it its popularity by features in the fold-in's popularity column; the fourth "
        "column ranks with the embeddings the run gave the new items inside its catalog (the shared encoder plus a "
        "residual from statistics that are noise: they have no interaction), with the same popularity column. The "
        "non-private reference scores popularity by features from the exact positives per trained item of the "
        "derived data set (what the features could say of a new item's popularity without noise). The last column is "
        "the run's own test Recall@20 (every catalog item ranked, targets on trained items only)."
    )
    return section
