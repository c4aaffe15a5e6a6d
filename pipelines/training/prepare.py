"""The prepare stage of a run: data -> split -> DP item counts -> DP mean -> centred labels -> the
initial item encoder, recorded in RUN/manifest.json.

Prepare is the one stage given the whole configuration; it records it, releases the counts and the
mean (pipelines.releases), picks the catalog the statistics cover from the DP counts
(`stats_catalog`, `stats_threshold_of`) and fits the initial encoder to the public features only.
A run killed here resumes: the releases it made are recognised, never spent twice.

Privacy: reads the private data set; writes the split and the centred rows under RUN/private/; what
leaves it is released (counts, mean) or computed from releases and public features.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pyarrow as pa

from pipelines.base import logs
from pipelines.base.lock import run_lock
from pipelines.data import ingest, splits
from pipelines.engines.engine import Engine
from pipelines.engines.local import LocalEngine
from pipelines.releases import item_gram, release, stats_core
from pipelines.releases.counts import dp_counts, dp_units, sampling_key
from pipelines.releases.item_gram import dp_item_gram
from pipelines.releases.mean import DEFAULT_USER_CAP, CentredOutput, dp_mean
from pipelines.releases.train_sums import TrainSumsRequest
from pipelines.training.model import build_encoder, item_embeddings_table, normalise_embeddings, zero_item_biases
from pipelines.training.run_dir import Run
from pipelines.training.settings import (
    DIM_32_FROM_KEPT,
    STATS_UPDATES,
    TrainConfig,
    dim_chosen_by_item_gram,
    raised_dim,
    release_units,
)
from privacy.ledger import Ledger
from privacy.seeds import content_digest_table
from schemas import storage
from schemas.errors import UserError
from schemas.tables import item_features, validate_catalog


def _check_manifest(run: Run, config: TrainConfig) -> dict:
    """The run's manifest: new (not written yet), or the one of an interrupted run with the same
    settings. A folder that holds something else (a data set, a file) is refused."""
    wanted = {key: value for key, value in config.flags().items() if key != "out"}
    storage.require_folder_target(run.root, "--out")
    if storage.exists(run.manifest_path):
        manifest = run.read_manifest()
        if not isinstance(manifest.get("config"), dict):
            raise UserError(
                f"--out {run.root} holds something other than a training run ({run.manifest_path} has no settings); "
                "use a new --out"
            )
        differing = sorted(key for key, value in wanted.items() if manifest["config"].get(key) != value)
        if differing:
            newer = [key for key in differing if key not in manifest["config"]]
            since = f"; {', '.join(newer)} did not exist in the version that started it" if newer else ""
            raise UserError(
                f"{run.root} holds a run with other settings ({', '.join(differing)}{since}); resume it with the same "
                "flags or use a new --out"
            )
        return manifest
    for name in (
        "counts",
        "step-1",
        "ledger.parquet",
        "private",
    ):  # a run's outputs without its manifest: not a fresh directory
        if _present(run.path(name)):
            raise UserError(
                f"--out {run.root} holds {name} but no run manifest; its releases may count: use a new --out"
            )
    return {"config": wanted, "steps_done": [], "status": "running"}


def _data_fingerprint(path: str) -> dict:
    """What identifies the training data, read-only and wherever it is stored: the digests of a
    data set's tables, or of the files a MovieLens folder is ingested from (the ratings, the
    catalog and its tags: the ml-100k genre list is fixed)."""
    from pipelines.data.movielens import detect_layout

    if ingest.is_dataset(path):
        data = ingest.open_dataset(path)
        return {"interactions": content_digest_table(data.interactions), "items": content_digest_table(data.items)}
    layout = detect_layout(path)
    fs, inner = storage.filesystem(path)
    files = {}
    for name in (layout.ratings, layout.movies, layout.tags):
        if name is None or not fs.isfile(storage.join(inner, name)):
            continue
        digest = hashlib.sha256()
        with fs.open(storage.join(inner, name), "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        files[name] = digest.hexdigest()
    return {"layout": layout.name, "files": files}


def _run_identity(config: TrainConfig) -> dict:
    """The settings and data a run's seed is bound to (everything but where things are stored)."""
    where = (
        "out",
        "seed_file",
        "data",
        "budget_account",
        "engine",
    )  # where things are stored or run: the data are identified by content, and every engine makes the same releases
    return {
        "config": {key: value for key, value in config.flags().items() if key not in where},
        "data": _data_fingerprint(config.data),
    }


LOCAL_PREPARE_ROWS = 2_000_000  # a log smaller than this is prepared in this process (a few hundred MB at most)
LOCAL = LocalEngine()


def prepare_engine(engine: Engine, rows: int, local_rows: int = LOCAL_PREPARE_ROWS) -> Engine:
    """Where the prepare stage's row work runs for a log of `rows` rows: in this process below
    `local_rows`, where a handful of Spark or Beam jobs would cost more than the work and memory is
    bounded by the threshold; else on the run's engine."""
    return LOCAL if rows < local_rows else engine


def start_from_directions(model, positions: np.ndarray, directions: np.ndarray) -> None:
    """The item embeddings' start from the item Gram's directions (`positions`' rows; its kept
    directions first, zero columns after): an id encoder's vectors (zero on the other items); a
    features encoder's output mapped so that its first coordinates are the features' best linear
    guess of those directions (scaled to the features' root-mean-square norm there) and the others
    what the features say beyond them, every item in the same coordinates, the Gram's items
    starting at its directions through their residuals. No kept direction: the start stays."""
    if not model.has_residual:
        vectors = np.zeros((model.space.size, directions.shape[1]))
        vectors[positions] = directions
        model.set_item_vectors(vectors)
        return
    d = directions.shape[1]
    kept = int(np.sum(np.any(directions != 0, axis=0)))
    if kept == 0:
        return
    features = model.embed_all(shared=True)[:, :d]
    shared = features[positions]
    size = np.sqrt(np.mean(np.sum(directions**2, axis=1)))
    target = directions[:, :kept] * np.sqrt(np.mean(np.sum(shared**2, axis=1))) / size
    guess = np.linalg.lstsq(shared, target, rcond=None)[0]  # d x kept: the taste the features predict
    along = np.linalg.lstsq(features @ guess, features, rcond=None)[0]  # the features' part the guess explains
    beyond = np.eye(d) - guess @ along
    _, _, rows = np.linalg.svd(features @ beyond, full_matrices=False)
    matrix = np.eye(model.dim)
    matrix[:d, :d] = np.c_[guess, beyond @ rows[: d - kept].T]
    model.transform(matrix)
    residuals = np.zeros((positions.size, model.dim))
    residuals[:, :kept] = target - shared @ guess
    model.set_residuals(positions, residuals)


def released_item_gram(
    run: Run, counts: pa.Table, privacy: release.PrivacySettings, seeds, engine: Engine
) -> tuple[np.ndarray, np.ndarray, float]:
    """(items, G, z): the DP item Gram over the top items by DP count and its noise multiplier.
    Planned in two parts (a run with statistics), the second part
    follows the first: a second Gram release pooled with it when the first detects a direction
    beyond the leading one (popularity's) above the noise's edge, else the statistics' noise
    multiplier, recalibrated to the rest of the budget (accounting.settle_item_gram)."""
    items = np.sort(splits.top_items(counts["item_id"].to_numpy(), counts["count"].to_numpy()))
    ledger = Ledger.open(run.ledger)
    gram = dp_item_gram(run.centred, items, run.item_gram_dir, ledger, seeds, engine=engine)
    multiplier = ledger.multipliers[item_gram.RELEASE]
    second = "item_gram_more"
    if second in ledger.multipliers:
        kept = item_gram.kept_directions(gram, multiplier)
        if kept > 1:
            more = dp_item_gram(run.centred, items, run.item_gram_dir, ledger, seeds, engine=engine, name=second)
            gram, multiplier = item_gram.pooled([(gram, multiplier), (more, ledger.multipliers[second])])
            logs.log(f"item gram: its first part detects {kept} directions, so the second part is on it too (pooled)")
        else:
            planned = ledger.multipliers["stats"]
            ledger.settle(privacy.item_gram_to_stats())
            logs.log(
                f"item gram: its first part detects {kept} direction(s), no taste beyond popularity: the second part "
                f"goes to the statistics (noise multiplier {planned:.4g} -> {ledger.multipliers['stats']:.4g})"
            )
    return items, gram, multiplier


def with_dim_from_item_gram(config: TrainConfig, gram: np.ndarray, multiplier: float, items: pa.Table, built):
    """(config, space, model) at the d the released item Gram gives (`raised_dim` by the directions
    it keeps above its noise), the encoder rebuilt if d changes (the same catalog and
    settings the encoder was first built from, so it cannot fail where that build passed)."""
    kept = item_gram.kept_directions(gram, multiplier, item_gram.KEEP_ABOVE)
    dim = raised_dim(config.dim, kept)
    logs.log(
        f"item gram: keeps {kept} directions above its noise, so d = {dim} (--dim-from-item-gram: at least 32 from "
        f"{DIM_32_FROM_KEPT})"
    )
    if dim == config.dim:
        return config, *built
    config = config.replace(dim=dim)
    return config, *build_encoder(config, items)


def ledger_multiplier(ledger_path: str, group: str = "stats") -> float:
    """The noise multiplier of a release group (the statistics') in the run's ledger: as planned, or settled."""
    return float(Ledger.open(ledger_path).multipliers[group])


def confidence_alpha_of(config: TrainConfig, manifest: dict) -> float | None:
    """The confidence rule of the run's ranking rows: --confidence-alpha for implicit feedback (the
    split's label is how many times a pair came), None (every positive weighs 1) otherwise."""
    implicit = config.protocol == "recall" and config.loss == "square" and manifest.get("feedback") == "implicit"
    return config.confidence_alpha if implicit else None


def data_source_of(config: TrainConfig, data) -> str | None:
    """The name of the run's data source: --data-source, or the one the data set was ingested under
    (None: its content digest names it); refused when the two differ, before anything is spent."""
    declared = getattr(data, "manifest", {}).get("data_source")
    if config.data_source is not None and declared is not None and config.data_source != declared:
        raise UserError(
            f"--data-source {config.data_source} contradicts the data set {config.data}, ingested as data source "
            f"{declared!r}: a data set has one source (give --data-source {declared}, or none)"
        )
    return config.data_source or declared


def stats_threshold_of(config: TrainConfig, counts: np.ndarray, dp_users: int, noise_per_unit: float) -> float:
    """--stats-threshold, or its default rule for AM-SSP's features encoder: 6 when the release's
    noise-to-signal ratio R = sqrt(m) (N/S) / sqrt(C n) exceeds 0.15 with biases (0.03 without),
    else 1: an item below N/S,
    the count at which its data would only match the noise in its A_j, keeps its public-feature
    embedding (and bias) rather than one fitted to more noise than data.

    m: catalog items; C: the DP counts' total; n: the DP number of users; N/S: `noise_per_unit`.
    The noise that per-item statistics put into the shared feature embeddings grows like sqrt(m) N
    (the paper's sqrt(m d) bound); the signal, with each user's weights normalised, like
    sqrt(C n) S. When R is large, the items below the noise add more noise than signal and thin
    every user's weight. The measurements behind the cut: docs/results.md#the-statistics-threshold.
    An id encoder has no other embedding for an item outside the statistics."""
    if config.stats_threshold is not None:
        return config.stats_threshold
    if config.item_update != "ssp" or config.encoder != "features" or noise_per_unit == 0:
        return 0.0
    ratio = math.sqrt(counts.size) * noise_per_unit / math.sqrt(max(float(np.sum(counts)), 1.0) * max(dp_users, 1))
    return 6.0 if ratio > (0.15 if config.biases else 0.03) else 1.0


def stats_catalog(
    config: TrainConfig, counts: pa.Table, keep_items: np.ndarray | None, multiplier: float, dp_users: int
) -> np.ndarray:
    """The item ids the statistics cover, from the DP counts only: those of `keep_items` (the
    ranking protocol's top share; None: every item) whose DP count is at least k * N / S (k:
    `stats_threshold_of`; N/S of `release_units`: the count at which an item's data would match
    the noise in its A_j). Which rows the stats job reads then depends on released data alone.
    When no item clears the threshold (small data, a low epsilon, many resamples), the catalog is
    empty: the run then keeps its starting point and makes no stats release (`covers_items`)."""
    ids, dp_counts = counts["item_id"].to_numpy(), counts["count"].to_numpy()
    chosen = np.ones(ids.size, bool) if keep_items is None else np.isin(ids, keep_items)
    unit, noise = release_units(config, multiplier)
    threshold = stats_threshold_of(config, dp_counts, dp_users, noise / unit)
    if threshold > 0:
        chosen &= dp_counts >= threshold * noise / unit
        if not chosen.any():
            logs.warn(
                f"no catalog item has a DP count of at least {threshold * noise / unit:.4g} (--stats-threshold "
                f"{threshold:g} times N/S "
                "at this epsilon): the statistics would cover nothing, so this run keeps its starting point (the "
                "public-feature "
                "encoder) and spends nothing on statistics; lower --stats-threshold (0: every item) or raise --epsilon "
                "to train it"
            )
            return ids[chosen]
    logs.log(f"the statistics cover {int(chosen.sum())} of {ids.size} catalog items (DP count >= {threshold:g} N/S)")
    return ids[chosen]


def _present(path: str) -> bool:
    """Whether anything (a file or a folder, complete or not) is at `path`."""
    fs, inner = storage.filesystem(path)
    fs.invalidate_cache()
    return fs.exists(inner)


def _is_empty_folder(path: str) -> bool:
    fs, inner = storage.filesystem(path)
    return fs.isdir(inner) and not fs.ls(inner, detail=False)


def _released_anything(run: Run) -> bool:
    """Whether the run directory records a release (or cannot be read to tell)."""
    try:
        return storage.exists(run.ledger) and bool(Ledger.open(run.ledger).rows)
    except Exception:
        return True


@contextmanager
def run_directory(config: TrainConfig):
    """The run directory held for a command: its folder checked first, read-only (a folder holding
    something other than this run is refused before the lock would write in it), then the lock,
    and the directory removed whole if the command is refused before its first release."""
    _check_manifest(Run(config.out), config)
    with removed_if_refused(config.out), run_lock(config.out):
        yield


@contextmanager
def removed_if_refused(root: str):
    """A run directory this command creates is removed whole if the command fails before the run's
    first release: a refused command leaves nothing behind, and the corrected command can use the
    same --out. After a release the directory stays: its ledger is the record of what was spent."""
    created = not _present(root)
    was_empty = not created and _is_empty_folder(root)  # made by hand (or a scheduler) for this run
    try:
        yield
    except Exception:
        if (created or was_empty) and _present(root) and not _released_anything(Run(root)):
            storage.remove(root)
            if was_empty:
                fs, inner = storage.filesystem(root)
                fs.makedirs(inner, exist_ok=True)
        raise


def rating_range(config: TrainConfig, data: ingest.Dataset) -> tuple[float, float]:
    """The run's rating range (the DP mean's clipping bounds, the predictions' limits): the data
    set's declared scale, or --rating-min/--rating-max for data that declares none (0.5..5 if not
    given either). Flags that contradict the declared scale are refused, and so is a regression run
    on ratings outside its range: they would be clipped silently and the RMSE would mean nothing.
    (A check on the trusted side before any release, like a malformed row: it releases nothing.)"""
    declared = data.manifest.get("rating_scale")
    given = (config.rating_min, config.rating_max)
    if declared is not None:
        wanted = tuple(d if g is None else g for g, d in zip(given, declared, strict=True))
        if wanted != tuple(declared):
            raise UserError(
                f"--rating-min/--rating-max {wanted[0]:g}..{wanted[1]:g} contradict the rating scale "
                f"{declared[0]:g}..{declared[1]:g} "
                f"that {data.path} declares; leave them out to use the data's scale"
            )
        low, high = declared
    else:
        low, high = given[0] if given[0] is not None else 0.5, given[1] if given[1] is not None else 5.0
    if not low < high:
        raise UserError(f"rating range must have min < max, got [{low:g}, {high:g}]")
    observed = data.manifest.get("label_range")
    if config.protocol == "rmse" and observed and not low <= observed[0] <= observed[1] <= high:
        raise UserError(
            f"{data.path}: its ratings range over {observed[0]:g}..{observed[1]:g}, outside the run's rating range "
            f"{low:g}..{high:g}; "
            + (
                "the data set declares that scale: fix the data"
                if declared is not None
                else "give the data's scale with --rating-min/--rating-max"
            )
        )
    return float(low), float(high)


def prepared_rating_range(prepared: dict) -> tuple[float, float]:
    """The rating range a prepared run chose (runs prepared before it was recorded used 0.5..5)."""
    return tuple(prepared.get("rating_range", (0.5, 5.0)))


def prepare(
    config: TrainConfig, progress: bool = True, engine: Engine = LOCAL, local_rows: int = LOCAL_PREPARE_ROWS
) -> dict:
    """Stage 1: record the run's settings, then split, DP counts, DP mean, centred labels and the
    initial item embeddings (public features only); returns the manifest. Done once: a prepared run
    is left as it is (a different configuration is refused). The rows are split, counted, summed
    and centred on `engine`, the run's (`prepare_engine`): the same tables and releases as in this
    process, without holding the log here (a log under `local_rows` rows is prepared here)."""
    from privacy.seeds import SeedFile

    run = Run(config.out)
    manifest = _check_manifest(run, config)
    if "prepared" in manifest:
        run.require_ledger(config.seed_file)
        return manifest
    # every check before the first write: the data, a given seed's binding, the catalog's features
    identity = _run_identity(config)
    if config.seed_file is not None:
        given = SeedFile.load(config.seed_file)
        given.check_run(given.run_fingerprint(identity))
        given.check_ledger(
            Ledger.open(run.ledger).identity if storage.exists(run.ledger) else "this run's new ledger"
        )  # a seed serves one ledger
    if storage.exists(run.manifest_path) and storage.exists(
        run.counts
    ):  # an interrupted prepare that released the counts
        run.require_ledger(config.seed_file)
    run.write_manifest(manifest)
    storage.make_private_folder(run.private())  # before anything private is written: its owner's alone
    started = time.time()
    unit = config.unit_of_privacy()
    data = ingest.load_or_ingest(config.data, run.private("data"), progress=progress)
    if (
        config.protocol == "rmse" and data.manifest.get("feedback") == "implicit"
    ):  # before any release: it spends nothing
        raise UserError(
            f"{data.path} holds implicit feedback (interactions without ratings, every label 1): a regression run "
            "(--protocol rmse) has no ratings to predict; use --protocol recall"
        )
    ratings = rating_range(config, data)
    engine = prepare_engine(engine, storage.row_count(data.interactions), local_rows)
    if not storage.exists(storage.join(run.split, splits.SPLIT_MANIFEST)):
        splits.make_split(
            data,
            config.protocol,
            run.split,
            config.split_seed,
            config.holdout,
            config.positive_threshold,
            ratings,
            engine=engine,
        )
    train_rows = storage.join(run.split, "train.parquet")
    items = storage.read_table(data.items)
    ids = items["item_id"].to_numpy()
    if np.any(ids[1:] <= ids[:-1]):  # every data set written since the catalog is canonical has them sorted
        raise UserError(
            f"{data.items}: the catalog's item ids are not in ascending order (a data set written by an older "
            "version): ingest it again"
        )
    if config.encoder == "features" and not item_features(items.schema):
        raise UserError(
            f"{data.items}: the catalog declares no public feature family, so the features encoder has nothing to "
            "embed; "
            "declare features when ingesting (--public-features), or use --item-id-feature or --encoder id"
        )
    space, model = build_encoder(
        config, items
    )  # built before any release: an encoder that cannot be built spends nothing
    privacy = config.privacy()  # AM-DPSGD: its DP-SGD schedule waits for the DP number of users of the counts release

    privacy = replace(privacy, source=data_source_of(config, data))
    if ingest.is_dataset(config.data):  # the content digest the run's identity took of the same table
        privacy = replace(privacy, digest=identity["data"]["interactions"])
    privacy.open_ledger(
        run.ledger, unit, data.interactions
    )  # creates the run's budget (charging its data source's account), or checks it on resume
    seeds = release.open_seed_file(config.seed_file, run.ledger)
    seeds.bind_run(seeds.run_fingerprint(identity))  # before the first release is noised
    sums = engine.train_sums(  # every row checked, and the counts' and mean's sums taken, before either release
        train_rows,
        TrainSumsRequest(
            np.sort(validate_catalog(items.select(["item_id"]))["item_id"].to_numpy()),  # the catalog read above
            unit,
            config.max_items_per_user,
            sampling_key(seeds.seed),
            ratings if config.protocol == "rmse" else None,
            DEFAULT_USER_CAP,
            seeds.digest_key(),
        ),
    )
    counted = dp_counts(
        train_rows,
        data.items,
        run.counts_dir,
        privacy,
        unit,
        config.max_items_per_user,
        run.ledger,
        seeds.path,
        engine=engine,
        sums=sums,
    )
    counts = storage.read_table(run.counts)
    units = dpsgd_multiplier = None
    if config.item_update == "dpsgd":  # plan the DP-SGD sampling over the DP number of users (released with the counts)
        units = dp_units(run.counts)
        dpsgd_multiplier = config.privacy(units).multipliers()["dpsgd"]
    mean = 0.0
    if config.protocol == "rmse":
        mean = dp_mean(
            train_rows,
            Ledger.open(run.ledger),
            seeds,
            ratings,
            unit,
            engine=engine,
            interactions_digest=counted["inputs"]["interactions"],
            sums=sums.mean_sums,
        )["mean"]
    keep_items = None
    if config.protocol == "recall":  # train on the top items by DP count (not exact counts)
        keep_items = splits.top_items(
            counts["item_id"].to_numpy(), counts["count"].to_numpy(), config.train_item_fraction
        )
    alpha = confidence_alpha_of(config, data.manifest)
    outputs = [CentredOutput(run.centred, keep_items)]  # the user update's rows
    if config.item_gram_share > 0:  # the item Gram first: it may settle the statistics' noise before their catalog
        engine.write_centred(train_rows, outputs, mean, config.protocol, alpha)
        outputs = []
        gram_items, gram, gram_multiplier = released_item_gram(run, counts, privacy, seeds, engine)
        if dim_chosen_by_item_gram(config):
            config, space, model = with_dim_from_item_gram(config, gram, gram_multiplier, items, (space, model))
        directions = item_gram.principal_directions(gram, gram_multiplier, config.dim)
    if config.item_update in STATS_UPDATES:
        covered = stats_catalog(config, counts, keep_items, ledger_multiplier(run.ledger), dp_units(run.counts))
        storage.write_table(items.filter(pa.array(np.isin(items["item_id"].to_numpy(), covered))), run.stats_items)
        train_count = storage.row_count(train_rows)
        outputs.append(
            CentredOutput(run.stats_rows, covered, stats_core.shards_for(train_count, config.shards))
        )  # the stats job's rows, by item shard
    if outputs:
        engine.write_centred(train_rows, outputs, mean, config.protocol, alpha)
    if (
        config.encoder == "features" and config.encoder_init == "principal"
    ):  # from public features and the DP counts only
        weights = np.ones(space.size)
        weights[space.index_of(counts["item_id"].to_numpy())] = counts["count"].to_numpy()
        rank = min(model.init_principal(weights), config.dim)  # with biases the bias output is zeroed below
        logs.log(
            f"initial encoder: the {rank} principal directions of the public features (weighted by DP counts)"
            + (f", {config.dim - rank} random ones beyond their rank" if rank < config.dim else "")
        )
    if config.item_gram_share > 0:
        start_from_directions(model, space.index_of(gram_items), directions)
        logs.log(
            f"item embeddings: {int(np.any(directions != 0, axis=0).sum())} principal directions of the DP item "
            f"Gram above its noise (at most --dim {config.dim}) on its {gram_items.size} items"
        )

    from trainer import encoder as encoders  # TensorFlow: imported once the checks above have passed

    zero_item_biases(model, config)
    normalise_embeddings(model, config)
    storage.write_table(item_embeddings_table(model, config), run.item_embeddings(0))
    encoders.write_checkpoint(model, run.checkpoint(0))
    manifest["prepared"] = {
        "data": data.path,
        "items": data.items,
        "stats_items": run.stats_items,
        "mean": mean,
        "rating_range": list(ratings),
        "units": units,
        "dim": config.dim,
        "stats_cover": int(covered.size) if config.item_update in STATS_UPDATES else None,
        "dpsgd_multiplier": dpsgd_multiplier,
        "confidence_alpha": alpha,
        "started_at": started,
        "at": time.time(),
    }
    run.write_manifest(manifest)
    logs.detail(f"settings of {run.root}: {json.dumps(manifest['config'], sort_keys=True)}")
    logs.log(
        f"prepared {run.root}: split, DP counts{', DP mean' if config.protocol == 'rmse' else ''}, initial item "
        "embeddings"
    )
    return manifest
