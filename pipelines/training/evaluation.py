"""The evaluate stage: RMSE (regression) or the ranking metrics (Recall@20, Recall@50, NDCG@100,
coverage of the top 20; fold-in users) on held-out rows, sliced by popularity, into RUN/metrics.json
and the run's privacy report.

Privacy: reads held-out private rows and the final (private) user embeddings; metrics.json holds
aggregates for the operator, not a DP release, and stays with the run.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from pipelines.training.prepare import prepared_rating_range
from pipelines.training.run_dir import Run, catalog_counts, config_of, require_steps
from pipelines.training.settings import TrainConfig
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import fill_by_file, list_column_to_matrix
from schemas.errors import UserError
from schemas.tables import require_unique_users, validate_item_embeddings, validated_user_batch
from trainer.metrics import AT_K, RANKING, at_k_keys
from trainer.solve import confidence, user_bias_ridge

BATCH_ROWS = 1 << 18  # rows per batch read: at 65,536 the work per batch (a catalog-sized count) dominates


def evaluate(run: Run, metrics_at: tuple[int, ...] = ()) -> dict:
    """Last stage: valid and test metrics of the finished run (trusted side: held-out private
    ratings and the final user embeddings), with the ledger's epsilon and the steps' curves
    (trainer.curves); a ranking's metrics also at each cut-off of `metrics_at`; writes RUN/metrics.json."""
    from trainer import curves
    from trainer.features import FeatureSpace

    began = time.time()
    manifest = run.prepared()
    config = config_of(run, manifest)
    require_steps(run, manifest, config.outer_steps + 1)
    prepared = manifest["prepared"]
    if config.protocol == "rmse" and config.holdout > 0 and not storage.exists(run.user_embeddings(None)):
        raise UserError(f"{run.root}: no final user embeddings; run `ssp user-update --run {run.root} --final` first")
    space = FeatureSpace(
        storage.read_table(prepared["items"], columns=["item_id"])["item_id"].to_numpy(), []
    )  # the catalog only
    final_items = validate_item_embeddings(
        storage.read_table(run.path("item_embeddings.parquet")), dim=config.vector_dim
    )
    if final_items.num_rows != space.size:
        raise UserError(
            f"{run.path('item_embeddings.parquet')}: {final_items.num_rows} item embeddings for a catalog of "
            f"{space.size} items"
        )
    item_vectors = np.zeros((space.size, config.vector_dim))
    item_vectors[space.index_of(final_items["item_id"].to_numpy())] = list_column_to_matrix(
        final_items["embedding"], config.vector_dim, "item embedding"
    )
    popularity = (
        catalog_counts(run, space) if config.protocol == "recall" else None
    )  # read once: the fold-in's column and the baseline
    metrics = _evaluate(
        config,
        space,
        split_dir=run.split,
        train_rows=storage.join(run.split, "train.parquet"),
        item_vectors=item_vectors,
        final_users=run.user_embeddings(None),
        mean=prepared["mean"],
        unit=config.unit_of_privacy(),
        ratings=prepared_rating_range(prepared),
        counts=popularity if config.popularity_column else None,
        popularity=popularity,
        confidence_alpha=prepared.get("confidence_alpha"),
        at=metrics_at,
    )
    ledger = Ledger.open(run.ledger)
    done_at = manifest.get("step_done_at", {})
    marks = [prepared["at"]] + [done_at.get(str(s)) for s in range(1, config.outer_steps + 1)]
    metrics.update(
        epsilon_spent=ledger.epsilon_spent(),
        delta=config.delta,
        epsilon_budget=ledger.budget["epsilon"],
        # the run's own time: prepare to the last step, and this evaluation (not the hours a rerun may come later)
        releases=len(ledger.rows),
        seconds=(marks[-1] or began) - prepared["started_at"] + time.time() - began,
        step_seconds={
            s: marks[s] - marks[s - 1]
            for s in range(1, len(marks))
            if marks[s] is not None and marks[s - 1] is not None
        },
        outputs={
            "run": run.root,
            "ledger": run.ledger,
            "encoder": run.path("encoder"),
            "item_embeddings": run.path("item_embeddings.parquet"),
        },
    )
    final = {
        name: value
        for name, value in metrics.items()
        if name.startswith(("test_", "valid_")) and isinstance(value, float)
    }
    metrics["curves"] = curves.gather(
        [run.step(s) for s in range(1, config.outer_steps + 1)], run.path("tensorboard", "run"), final
    )
    storage.write_json(metrics, run.path("metrics.json"))
    if not config.non_private:  # the report of what the run released (a non-private run has no guarantee to report)
        from pipelines.training.publish import privacy_report

        storage.StagedFile(privacy_report(run).encode(), run.path("privacy.md")).publish()
    manifest["status"] = "done"
    run.write_manifest(manifest)
    _write_report(run, manifest, config, metrics, space, item_vectors, popularity)  # the run is whole before it
    return metrics


def _write_report(
    run: Run, manifest: dict, config: TrainConfig, metrics: dict, space, item_vectors, popularity
) -> None:
    """RUN/report.html (pipelines.training.run_report), from the metrics just computed."""
    from pipelines.data.datasets import open_dataset
    from pipelines.training import run_report
    from pipelines.training.publish import catalog_titles, public_settings

    prepared = manifest["prepared"]
    examples = (
        []
        if "no_heldout_data" in metrics
        else example_recommendations(
            config,
            space,
            split_dir=run.split,
            item_vectors=item_vectors,
            counts=popularity if config.popularity_column else None,
            final_users=run.user_embeddings(None),
            mean=prepared["mean"],
            ratings=prepared_rating_range(prepared),
            confidence_alpha=prepared.get("confidence_alpha"),
        )
    )
    titles = catalog_titles(run)
    dataset = open_dataset(prepared["data"])
    keys = storage.read_table(dataset.item_keys) if dataset.item_keys is not None else None
    if dataset.user_keys is not None and examples:  # the examples' users by their own ids (private, as the page)
        named = _rows_of(dataset.user_keys, np.array([e["user"] for e in examples]), ("user_id", "user_key"))
        own = dict(zip(named["user_id"].tolist(), named["user_key"].tolist(), strict=True))
        examples = [{**e, "user": own.get(e["user"], e["user"])} for e in examples]
    page = run_report.render(
        run.root.rstrip("/").rsplit("/", 1)[-1],
        metrics,
        Ledger.open(run.ledger),
        public_settings(run, manifest, ("dpsgd_clip",)),
        examples,
        dict(zip(titles["item_id"].to_pylist(), titles["title"].to_pylist(), strict=True)),
        None if keys is None else dict(zip(keys["item_id"].to_pylist(), keys["item_key"].to_pylist(), strict=True)),
    )
    storage.StagedFile(page.encode(), run.path("report.html")).publish()


def example_recommendations(
    config: TrainConfig,
    space,
    *,
    split_dir: str,
    item_vectors: np.ndarray,
    counts: np.ndarray | None,
    final_users: str,
    mean: float,
    ratings: tuple[float, float],
    confidence_alpha: float | None,
    users: int = 3,
    k: int = 10,
) -> list[dict]:
    """The top k of the first `users` test users (by id), as the evaluation scores them, each with its
    history (item, label; highest label first) and its recommendations (item, score, its held-out
    label or None): a ranking's users folded in on their test history, a ratings user's final
    embedding scored against every item it has no training rating of."""
    from trainer import evaluate

    def shown(mine, scores, held) -> dict:
        mine = mine.sort_values("label", ascending=False, kind="stable")
        scores = scores.copy()
        scores[space.index_of(mine["item_id"].to_numpy())] = -np.inf  # the history is never recommended
        order = np.argsort(-scores, kind="stable")[:k]
        order = order[np.isfinite(scores[order])]  # fewer than k items outside the history: those only
        return {
            "history": list(zip(mine.item_id.tolist(), mine.label.tolist(), strict=True)),
            "recommended": [
                (int(space.item_ids[j]), float(scores[j]), held.get(int(space.item_ids[j]))) for j in order
            ],
        }

    def path(name: str) -> str:
        return storage.join(split_dir, f"{name}.parquet")

    if config.protocol == "rmse":
        chosen = np.intersect1d(_user_ids(path("test")), _user_ids(final_users))[:users]
        table = _rows_of(final_users, chosen, None).sort_values("user_id")
        vectors = np.stack(table["embedding"].to_numpy()) if len(table) else np.zeros((0, config.vector_dim))
        test, train = (_rows_of(path(name), chosen) for name in ("test", "train"))
        return [
            {
                "user": int(user),
                **shown(
                    train[train.user_id == user],
                    np.clip(vector @ item_vectors.T + mean, *ratings),
                    dict(zip(*(test[test.user_id == user][c].tolist() for c in ("item_id", "label")), strict=True)),
                ),
            }
            for user, vector in zip(chosen, vectors, strict=True)
        ]
    chosen = np.intersect1d(_user_ids(path("test_history")), _user_ids(path("test_targets")))[:users]
    rows, targets = (_rows_of(path(name), chosen) for name in ("test_history", "test_targets"))
    vectors = item_vectors if counts is None else evaluate.with_popularity(item_vectors, counts, config.biases)
    solved_users, solved = evaluate.fold_in(
        (
            rows["user_id"].to_numpy(),
            space.index_of(rows["item_id"].to_numpy()),
            _history_weights(rows["label"].to_numpy(), confidence_alpha),
        ),
        vectors,
        config.lambda_u,
        **_fold_in_settings(config),
    )
    return [
        {
            "user": int(user),
            **shown(
                rows[rows.user_id == user],
                solved[np.searchsorted(solved_users, user)] @ vectors.T,
                {int(item): 1.0 for item in targets[targets.user_id == user]["item_id"]},
            ),
        }
        for user in chosen
    ]


def _fold_in_settings(config: TrainConfig) -> dict:
    """How a held-out ranking user is folded in (trainer.evaluate.fold_in's settings), by the metrics
    and the report's examples alike."""
    return {
        "gravity": config.fold_in_gravity,
        "loss": config.loss,
        "bias_ridge": user_bias_ridge(config.protocol, config.biases, config.lambda_bias),
        "confidence": config.loss == "square",
    }


def _history_weights(labels: np.ndarray, confidence_alpha: float | None) -> np.ndarray:
    """A fold-in history's row weights: each row's confidence (implicit feedback), else 1."""
    return np.ones(labels.size) if confidence_alpha is None else confidence(labels, confidence_alpha)


def _batches(path: str, columns: list[str] | None = None):
    """A table's rows in batches of BATCH_ROWS, each read in a thread while the last is used."""
    return storage.read_ahead(storage.iter_batches(path, columns, BATCH_ROWS))


def _user_table(path: str, dim: int):
    """The final user embeddings as (an IdIndex of their ids, their vectors in that order), read a
    file per core into arrays sized from the files' footers (schemas.arrays.fill_by_file: filling
    gigabytes is mostly the first touch of new pages, which the threads share out), each batch
    validated as `schemas.tables.validate_user_embeddings` validates the whole, and no id twice."""
    from schemas.ids import IdIndex

    rows = storage.row_count(path)
    ids, vectors = np.empty(rows, np.int64), np.empty((rows, dim))

    def fill(part: slice, batch: pa.RecordBatch) -> None:
        table = validated_user_batch(batch, dim, part.start)
        ids[part] = table["user_id"].to_numpy()
        list_column_to_matrix(table["embedding"], dim, "user embedding", out=vectors[part])

    fill_by_file(path, fill, "user embedding", batch_size=BATCH_ROWS)
    require_unique_users(ids)
    return IdIndex(ids), vectors


def _user_ids(path: str) -> np.ndarray:
    """The distinct user ids of a table, streamed."""
    parts = [np.unique(batch.column("user_id").to_numpy()) for batch in _batches(path, ["user_id"])]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _rows_of(path: str, users: np.ndarray, columns: tuple[str, ...] | None = ("user_id", "item_id", "label")):
    """The rows of `users` in a table (`columns`, None: all), streamed (memory: theirs and one
    batch) from the row groups that may hold them, as a DataFrame."""
    import pyarrow.compute as pc

    wanted = pa.array(users, pa.int64())
    batches = storage.iter_batches_holding(path, "user_id", users, list(columns) if columns else None)
    return pa.Table.from_batches(
        [batch.filter(pc.is_in(batch.column("user_id"), wanted)) for batch in batches]
    ).to_pandas()


def fold_in_counts(run: Run, config: TrainConfig, space) -> np.ndarray | None:
    """The DP counts in catalog order when the ranking fold-in uses them (--popularity-column), else None."""
    if config.protocol != "recall" or not config.popularity_column:
        return None
    return catalog_counts(run, space)


def _evaluate(
    config: TrainConfig,
    space,
    *,
    split_dir: str,
    train_rows: str,
    item_vectors: np.ndarray,
    final_users: str,
    mean: float,
    unit: str,
    ratings: tuple[float, float],
    counts: np.ndarray | None = None,
    popularity: np.ndarray | None = None,
    confidence_alpha: float | None = None,
    at: tuple[int, ...] = (),
) -> dict:
    """Valid and test metrics of the protocol, overall and by popularity bucket (trusted side);
    predicted ratings are limited to `ratings`, the run's rating range; a ranking fold-in gets
    `counts` (catalog order) as a popularity column when given, and with `popularity` (the DP
    counts, catalog order) the ranking metrics hold DP popularity's beside the model's;
    with `confidence_alpha` (implicit feedback) a history row weighs its confidence as in training."""
    from trainer import evaluate

    batches = _batches(train_rows, ["item_id"])  # streamed: the driver's memory stays flat with the rows
    counts = evaluate.item_counts(space.item_ids, (batch.column("item_id").to_numpy() for batch in batches))
    buckets = evaluate.buckets_by_count(space.item_ids, counts)
    metrics = {"protocol": config.protocol, "non_private": config.non_private, "unit": unit, "holdout": config.holdout}
    if config.holdout == 0:  # production mode: every row trained, so there is nothing to evaluate on
        metrics["no_heldout_data"] = (
            "--holdout 0 (production mode): every row is a training row, so there is no held-out data and no test "
            "metrics"
        )
        return metrics
    if config.protocol == "rmse":
        user_table = _user_table(final_users, config.vector_dim)
        for part in ("valid", "test"):
            model, baseline = np.zeros((evaluate.BUCKETS, 2)), np.zeros((evaluate.BUCKETS, 2))
            rows = _batches(storage.join(split_dir, f"{part}.parquet"), ["user_id", "item_id", "label"])
            for batch in rows:
                positions = space.index_of(batch.column("item_id").to_numpy())
                labels = batch.column("label").to_numpy()
                predictions = evaluate.predict_ratings(
                    batch.column("user_id").to_numpy(), positions, user_table, item_vectors, mean, ratings
                )
                model += evaluate.squared_errors(predictions, labels, buckets[positions])
                baseline += evaluate.squared_errors(np.full(labels.size, mean), labels, buckets[positions])
            if not model[:, 1].any():  # a data set too small for its split: the model stands, unevaluated
                return {**metrics, "no_heldout_data": f"the {part} split holds no rating: no test metrics"}
            report = evaluate.rmse_report(model)
            metrics[f"{part}_rmse"] = report["rmse"]
            metrics[f"{part}_rmse_sliced"] = report["sliced"]
            report = evaluate.rmse_report(baseline)  # the DP mean, on the same slices
            metrics[f"{part}_mean_predictor_rmse"] = report["rmse"]
            metrics[f"{part}_mean_predictor_rmse_sliced"] = report["sliced"]
        metrics["dp_mean"] = mean
        metrics["sliced"] = {"valid": metrics["valid_rmse_sliced"], "test": metrics["test_rmse_sliced"]}
    else:
        vectors = item_vectors if counts is None else evaluate.with_popularity(item_vectors, counts, config.biases)
        for part in ("valid", "test"):
            history = storage.read_table(storage.join(split_dir, f"{part}_history.parquet"))
            targets = storage.read_table(storage.join(split_dir, f"{part}_targets.parquet"))
            if not np.intersect1d(history["user_id"].to_numpy(), targets["user_id"].to_numpy()).size:
                return {
                    **metrics,
                    "no_heldout_data": f"no held-out user of the {part} split has both a history and targets (too "
                    "few users with enough positives): no test metrics",
                }
            held_out = (history["user_id"].to_numpy(), space.index_of(history["item_id"].to_numpy()))
            aimed = (targets["user_id"].to_numpy(), space.index_of(targets["item_id"].to_numpy()))
            report = evaluate.ranking_report(
                (*held_out, _history_weights(history["label"].to_numpy(), confidence_alpha)),
                aimed,
                vectors,
                config.lambda_u,
                item_buckets=buckets,
                at=at,
                **_fold_in_settings(config),
            )
            keys = [*RANKING, *at_k_keys(at)]
            metrics.update({f"{part}_{key}": report[key] for key in keys})
            metrics[f"{part}_recall_at_20_sliced"] = report["sliced"]
            if popularity is not None:  # the baseline, free: the run's own counts release
                baseline = evaluate.popularity_ranking_report(held_out, aimed, popularity, buckets, at)
                metrics.update({f"{part}_popularity_{key}": baseline[key] for key in keys})
                metrics[f"{part}_popularity_recall_at_20_sliced"] = baseline["sliced"]
        metrics["sliced"] = {"valid": metrics["valid_recall_at_20_sliced"], "test": metrics["test_recall_at_20_sliced"]}
    return metrics


def _others(metrics: dict, prefix: str) -> str:
    """The ranking metrics beside Recall@20, as `describe` prints them (Recall@50, NDCG@100, coverage@20)."""
    return ", ".join(f"{name} {metrics[prefix + key]:.4f}" for key, name in list(RANKING.items())[1:])


def _at_k(metrics: dict, prefix: str, k: int) -> str:
    """The metrics at cut-off k (`ssp evaluate --metrics-at`), as `describe` prints them."""
    names = {"recall": "Recall", "precision": "Precision", "ndcg": "NDCG", "map": "MAP", "coverage": "coverage"}
    return ", ".join(f"{names[name]} {metrics[f'{prefix}{name}_at_{k}']:.4f}" for name in (*AT_K, "coverage"))


def describe(metrics: dict) -> str:
    """The human summary printed at the end of a run."""
    lines = []
    if "no_heldout_data" in metrics:
        lines.append(f"no test metrics: {metrics['no_heldout_data']}")
    elif metrics["protocol"] == "rmse":
        lines.append(
            f"test RMSE {metrics['test_rmse']:.4f} (valid {metrics['valid_rmse']:.4f}; predicting the DP mean "
            f"{metrics['dp_mean']:.3f}: {metrics['test_mean_predictor_rmse']:.4f})"
        )
        sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_rmse_sliced"])
        lines.append(f"test RMSE by item popularity (least to most popular fifth): {sliced}")
        if "test_mean_predictor_rmse_sliced" in metrics:
            sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_mean_predictor_rmse_sliced"])
            lines.append(f"  predicting the DP mean, same fifths: {sliced}")
    else:
        lines.append(f"test Recall@20 {metrics['test_recall_at_20']:.4f} (valid {metrics['valid_recall_at_20']:.4f})")
        lines.append(f"  test {_others(metrics, 'test_')} (valid {_others(metrics, 'valid_')})")
        sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_recall_at_20_sliced"])
        lines.append(f"test Recall@20 by item popularity (least to most popular fifth): {sliced}")
        if "test_popularity_recall_at_20" in metrics:
            baseline = metrics["test_popularity_recall_at_20"]
            sliced = ", ".join("-" if v is None else f"{v:.4f}" for v in metrics["test_popularity_recall_at_20_sliced"])
            below = "; the model is BELOW it" if metrics["test_recall_at_20"] < baseline else ""
            line = "popularity (exact counts: a non-private run)" if metrics["non_private"] else "DP popularity"
            lines.append(
                f"  {line} (the run's counts release): test Recall@20 {baseline:.4f}{below}; same fifths: "
                f"{sliced}; {_others(metrics, 'test_popularity_')}"
            )
        for k in sorted(int(key.removeprefix("test_map_at_")) for key in metrics if key.startswith("test_map_at_")):
            popular = (  # beside the popularity line above
                f" ({line}: {_at_k(metrics, 'test_popularity_', k)})"
                if f"test_popularity_map_at_{k}" in metrics
                else ""
            )
            lines.append(f"test at {k}: {_at_k(metrics, 'test_', k)}{popular}")
    eps = metrics["epsilon_spent"]
    guarantee = (
        "no privacy (non-private run)"
        if metrics["non_private"]
        else f"({eps:.4g}, {metrics['delta']:g})-DP at the {metrics['unit']} level"
    )
    lines.append(
        f"privacy: {guarantee}; epsilon spent {eps:.4g} of {metrics['epsilon_budget']:g} over {metrics['releases']} "
        f"releases (ledger: {metrics['outputs']['ledger']})"
    )
    lines.append(
        f"outputs: encoder {metrics['outputs']['encoder']}, item embeddings {metrics['outputs']['item_embeddings']}, "
        f"metrics {metrics['outputs']['run']}/metrics.json"
    )
    lines.append(f"private (never publish): {metrics['outputs']['run']}/private/; done in {metrics['seconds']:.0f} s")
    return "\n".join(lines)
