"""`ssp publish --run RUN --to DEST`: hand a finished run's public results over, after checking its ledger.

What is published: `encoder/` (SavedModel, signatures `embed` and `embed_features`),
`recommender/` (SavedModel for TF Serving, signatures `recommend` and `similar_items`: trainer.serving;
not for a logistic-loss model), `item_embeddings.parquet`, `model.json` (the user side's settings,
for `ssp recommend`), the DP counts release (`counts.parquet`) and for a ranking model with features
`feature_popularity.parquet` (a new item's popularity column: trainer.feature_popularity), the
catalog's titles where it has them (`titles.parquet`, shown by `ssp recommend`),
`privacy.json` (the ledger's budget, releases and epsilon spent, the privacy settings) and
`privacy.md` (privacy.report). All come from DP releases and public item features only. Never
published: `RUN/private/`, `metrics.json` (an evaluation on held-out private rows).

Refused, with nothing written, unless every outer step is done and the final encoder and item
embeddings exist, a shipped `counts.parquet` is the counts release the ledger recorded (not, say,
exact counts with the same schema), the run is private (a `--non-private` run has no guarantee to hand over), the
ledger's budget is the one the run was configured with, and the epsilon the ledger has spent is
within it. The ledger refuses over-budget releases as they are made; this check is the last gate,
against a ledger edited, replaced or shared with another run.

Atomic: a local destination is assembled in a hidden sibling folder and renamed into place; on
gs:// the files are written in place and the publication is committed by `DEST/_PUBLISHED`,
uploaded last (consumers wait for it, as table readers wait for `_SUCCESS`). Publishing a run again
to its destination does nothing; a destination holding another publication is refused.

Privacy: only released tables and public features leave the run; `private/` and metrics.json never
do, and a run whose ledger spent more than its budget is refused.
"""

from __future__ import annotations

import argparse
import datetime
import os
import posixpath
import shutil
import uuid

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.data.datasets import open_dataset
from pipelines.releases.release import check_counts_release, check_ledger_complete
from pipelines.releases.stats_job import RELEASE_SUMMARY
from pipelines.training.run_dir import Run, catalog_counts, config_of, existing_run_lock, require_steps
from privacy import report
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from schemas.errors import UserError
from trainer import feature_popularity
from trainer.recommend import ITEM_KEYS, TITLES

PUBLISHED = "_PUBLISHED"
TOLERANCE = 1e-9  # relative slack of the budget comparison, as the ledger's
PUBLIC_SETTINGS = (
    "protocol",
    "unit",
    "epsilon",
    "delta",
    "outer_steps",
    "resamples",
    "clip_u",
    "clip_y",
    "wbar",
    "weight_exponent",
    "max_items_per_user",
    "count_share",
    "mean_share",
    "gram_share",
    "item_gram_share",
    "dim",
    "encoder",
    "item_update",
    "item_id_feature",
)


def public_settings(run: Run, manifest: dict, extra: tuple[str, ...] = ()) -> dict:
    """The run's public settings as they took effect (rules resolved: d, k), its model's biases and
    its data's feedback kind (explicit ratings or implicit interactions)."""
    config, effective = manifest["config"], config_of(run, manifest).flags()
    settings = {key: effective.get(key, config.get(key)) for key in (*PUBLIC_SETTINGS, *extra) if key in config}
    settings["biases"] = effective["biases"]
    if effective["biases"] or effective["item_update"] == "item-mean":
        settings["bias_coordinate"] = effective["bias_coordinate"]
    settings["feedback"] = open_dataset(manifest["prepared"]["data"]).manifest.get("feedback", "explicit")
    return settings


def privacy_summary(run: Run) -> dict:
    """Check that the run may be published (see the module docstring); returns its privacy summary."""
    manifest = run.prepared()
    config = manifest["config"]
    require_steps(run, manifest, config["outer_steps"] + 1)
    for path in (
        run.path("item_embeddings.parquet"),
        run.path("encoder"),
    ):  # both complete: committed by their _SUCCESS markers
        if not storage.exists(path):
            raise UserError(f"{run.root}: {path} is missing; the last item update writes it")
    if config["non_private"]:
        raise UserError(
            f"{run.root} is a non-private run (no noise, no clipping): it has no privacy guarantee and is not published"
        )
    ledger = Ledger.open(run.ledger)
    seed_path = config.get("seed_file") or run.private("seed")
    check_ledger_complete(ledger, seed_path)
    seeds = SeedFile.load(
        seed_path
    )  # counts.parquet is shipped (the ranking fold-in's column, every model's cold start): the recorded release
    check_counts_release(ledger, seeds, run.counts, seeds.digest_table(run.counts))
    budget, spent = ledger.budget, ledger.epsilon_spent()
    if (budget["epsilon"], budget["delta"]) != (config["epsilon"], config["delta"]):
        raise UserError(
            f"{run.ledger}: budget epsilon {budget['epsilon']:g}, delta {budget['delta']:g} is not the run's "
            f"(epsilon {config['epsilon']:g}, delta {config['delta']:g}); not published"
        )
    if not spent <= budget["epsilon"] * (1 + TOLERANCE):
        raise UserError(
            f"{run.ledger}: epsilon spent {spent:.6g} exceeds the run's budget {budget['epsilon']:g}; not published"
        )
    account = ledger.check_account()  # the data source's lifetime budget, over every run on these users
    return {
        "run": run.root,
        "unit": budget["unit"],
        "epsilon_spent": spent,
        "epsilon_budget": budget["epsilon"],
        "delta": budget["delta"],
        "accountant": budget["accountant"],
        "budget_account": account,
        "releases": [
            {
                key: row[key]
                for key in ("release", "name", "noise_multiplier", "epsilon_spent", "data_fingerprint", "recorded_at")
            }
            for row in ledger.rows
        ],
        "settings": public_settings(run, manifest),
        "public_features": open_dataset(manifest["prepared"]["data"]).manifest.get("public_features"),
    }


def privacy_report(run: Run) -> str:
    """The run's privacy.md (privacy.report), from its ledger, settings and declared public features."""
    manifest = run.prepared()
    config = manifest["config"]
    settings = public_settings(run, manifest, ("dpsgd_clip",))
    features = open_dataset(manifest["prepared"]["data"]).manifest.get("public_features")
    text = report.render(Ledger.open(run.ledger), settings, features, posixpath.basename(run.root.rstrip("/")))
    if config.get("engine") == "federated":  # its trust model, in a section of its own
        first = storage.join(run.stats(1), RELEASE_SUMMARY)
        neighbours = storage.read_json(first)["federated"]["neighbours"] if storage.exists(first) else None
        text += report.federated_trust(config["federated_max_dropout"], neighbours)
    return text


def catalog_titles(run: Run) -> pa.Table:
    """(item_id, title) of the catalog's items that have a title (public, as the features)."""
    items = storage.read_table(run.prepared()["prepared"]["items"], columns=["item_id", "title"])
    return items.filter(pc.is_valid(items["title"]))


def feature_popularity_table(run: Run, settings: dict):
    """The catalog's mean DP count per public feature value (trainer.feature_popularity), from the
    counts release and the run's public catalog."""
    from trainer.features import FeatureSpace

    items = storage.read_table(run.prepared()["prepared"]["items"])
    space = FeatureSpace.from_items(items, use_item_id=False, families=list(settings["feature_families"]))
    return feature_popularity.table(space, catalog_counts(run, space))


def model_settings(run: Run) -> dict:
    """model.json: what a client needs to solve a user's side from the published item embeddings as
    the run's evaluation does (trainer.recommend): public settings, the released DP mean rating and
    the positive threshold of the split (a setting, not data), and the encoder's public families."""
    from pipelines.data.splits import SPLIT_MANIFEST
    from pipelines.training.prepare import prepared_rating_range

    manifest = run.prepared()
    config, prepared = manifest["config"], manifest["prepared"]
    recall = config["protocol"] == "recall"
    settings = config_of(run, manifest)
    biased = settings.biases
    features = open_dataset(prepared["data"]).manifest.get("public_features") or {}
    return {
        "protocol": config["protocol"],
        "dim": settings.vector_dim,  # the item embeddings' length
        "biases": biased,  # items [v, b_j, 1], users [u, 1, b_u] (trainer.encoder.as_written)
        "lambda_bias": settings.lambda_bias
        if biased and settings.protocol == "rmse"
        else None,  # ranking holds every user's bias at 0
        "loss": config.get("loss", "square"),
        "lambda_u": settings.lambda_u,
        "user_prior": settings.user_prior,  # the user ridge's fixed part (trainer.solve.ridge_solve's prior)
        "gravity": settings.fold_in_gravity,  # the fold-in's (a served user is ranked as evaluation ranked)
        "dp_mean": None if recall else prepared["mean"],
        "rating_range": None if recall else list(prepared_rating_range(prepared)),  # a ranking scores no rating
        "positive_threshold": storage.read_json(storage.join(run.split, SPLIT_MANIFEST)).get("positive_threshold")
        if recall
        else None,
        "encoder": config["encoder"],
        "feature_families": features if config["encoder"] == "features" else {},
        "popularity_column": recall
        and config.get("popularity_column", False),  # counts.parquet beside it (an older run's fold-in had none)
        "confidence_alpha": prepared.get(
            "confidence_alpha"
        ),  # implicit feedback: a history's counts weigh as in training (trainer.solve.confidence)
    }


def _copy_tree(source: str, target: str) -> list[str]:
    """Copy every file under `source` to `target` (any filesystems); returns the relative names."""
    src_fs, src_root = storage.filesystem(source)
    dst_fs, dst_root = storage.filesystem(target)
    names = []
    for path in sorted(src_fs.find(src_root)):
        name = posixpath.relpath(path, src_root)
        destination = posixpath.join(dst_root, name)
        dst_fs.makedirs(posixpath.dirname(destination), exist_ok=True)
        with src_fs.open(path, "rb") as reader, dst_fs.open(destination, "wb") as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
        names.append(name)
    return names


def _copy_table(source: str, target: str) -> None:
    """Copy a committed table (streamed in batches, schema metadata kept) as a committed table."""
    with storage.TableWriter(target, storage.read_schema(source)) as writer:
        for batch in storage.iter_batches(source):
            writer.write(batch)


def publish(run: Run, dest: str) -> dict:
    """Publish the run to `dest` (see the module docstring); returns the `_PUBLISHED` marker."""
    dest = dest.rstrip("/")
    inside, root = storage.canonical(dest), storage.canonical(run.root)
    if inside == root or inside.startswith(root.rstrip("/") + "/"):
        raise UserError(
            f"--to {dest} is inside the run directory {run.root}, whose private/ folder must never be published: "
            "publish elsewhere"
        )
    summary = privacy_summary(run)
    marker_path = storage.join(dest, PUBLISHED)
    if storage.exists(marker_path):
        marker = storage.read_json(marker_path)
        if marker.get("run") == run.root:
            return marker
        raise UserError(
            f"{dest} already holds the publication of run {marker.get('run')}; publish to a new destination"
        )
    fs, inner = storage.filesystem(dest)
    local = storage.is_local(fs)
    if local and os.path.exists(inner) and os.listdir(inner):
        raise UserError(f"{dest} exists and is not a publication; publish to a new destination")
    staging = (
        storage.join(os.path.dirname(inner), f".{os.path.basename(inner)}.tmp-{uuid.uuid4().hex}") if local else dest
    )
    try:
        files = ["encoder/" + name for name in _copy_tree(run.path("encoder"), storage.join(staging, "encoder"))]
        _copy_table(run.path("item_embeddings.parquet"), storage.join(staging, "item_embeddings.parquet"))
        storage.write_json(summary, storage.join(staging, "privacy.json"))
        settings = model_settings(run)
        storage.write_json(settings, storage.join(staging, "model.json"))
        _copy_table(
            run.counts, storage.join(staging, "counts.parquet")
        )  # the DP counts release: a ranking fold-in's column, a new user's ranking
        storage.StagedFile(privacy_report(run).encode(), storage.join(staging, "privacy.md")).publish()
        contents = ["counts.parquet", "encoder/", "item_embeddings.parquet", "model.json", "privacy.json", "privacy.md"]
        keys = open_dataset(run.prepared()["prepared"]["data"]).item_keys
        if keys is not None:  # a catalog with text ids: the map back to them (public, as the catalog)
            _copy_table(keys, storage.join(staging, ITEM_KEYS))
            contents.append(ITEM_KEYS)
        titles = catalog_titles(run)
        if titles.num_rows:  # public: the catalog's declared titles, shown beside recommendations
            storage.write_table(titles, storage.join(staging, TITLES))
            contents.append(TITLES)
        if settings["popularity_column"] and settings["feature_families"]:  # a new item's popularity column
            storage.write_table(feature_popularity_table(run, settings), storage.join(staging, feature_popularity.FILE))
            contents.append(feature_popularity.FILE)
        if (
            settings["loss"] != "logistic"
        ):  # the user side for TF Serving (a logistic fold-in is Newton's method: ssp recommend only)
            from trainer import serving
            from trainer.recommend import PublishedModel

            model = PublishedModel.read(staging)
            serving.export(
                model.item_ids,
                model.vectors,
                model.settings,
                model.popularity,
                storage.join(staging, serving.SERVING_FOLDER),
                None if model.item_keys is None else model.key_of(model.item_ids),
            )
            contents.append(serving.SERVING_FOLDER + "/")
        marker = {
            "run": run.root,
            "published_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "epsilon_spent": summary["epsilon_spent"],
            "delta": summary["delta"],
            "unit": summary["unit"],
            "contents": sorted(contents),
            "encoder_files": files,
        }
        storage.write_json(marker, storage.join(staging, PUBLISHED))
        if local:
            if os.path.exists(inner):
                os.rmdir(inner)  # an empty folder (checked above)
            os.rename(staging, inner)
    except BaseException:
        if local:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return marker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="finished run directory (local or gs://)")
    parser.add_argument("--to", required=True, help="destination folder (local or gs://), new for each publication")


def main(args: argparse.Namespace) -> int:
    with existing_run_lock(args.run):
        marker = publish(Run(args.run), args.to)
    print(
        f"published {args.run} to {args.to}: {', '.join(marker['contents'])} "
        f"({marker['unit']}-level epsilon {marker['epsilon_spent']:.4g}, delta {marker['delta']:g})"
    )
    return 0
