"""The item update of one outer step.

After the step's stats release (pipelines.training.stats_stage), `item_update` fits the item
encoder: the SSP trainer, or the DP-ALS / DP-CMF closed-form solves, from the released
statistics (`_stats_update`), or AM-DPSGD's TF-Privacy trainer on the private rows
(`_dpsgd_update`, no stats release). The last step refits the shared features encoder to the
embeddings the updates gave the catalog where the refit guesses them better (what a new item gets
from its features, trainer.encoder.ItemEncoder.refit_shared) and exports the encoder and item
embeddings.

Privacy: the SSP, ALS and CMF updates read only released tables (the statistics, the DP counts) and
public features, never the interactions; DP-SGD reads the private rows under its own release. The
refit reads the released embeddings and DP counts only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np
import pyarrow as pa

from pipelines.base import logs
from pipelines.releases import release, stats_core, stats_job
from pipelines.releases.gram import dp_gram
from pipelines.training.model import build_encoder, item_embeddings_table, normalise_embeddings
from pipelines.training.prepare import ledger_multiplier
from pipelines.training.run_dir import Run, catalog_counts, config_of, require_steps
from pipelines.training.settings import FIXED_UPDATES, TrainConfig, release_units
from pipelines.training.stats_stage import covers_items
from privacy import accounting
from privacy.accumulator import packed_size
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.tables import validate_item_embeddings, validate_user_embeddings


def _ridge_scale(config: TrainConfig, space, multiplier: float, counts: pa.Table, averaged: int = 1) -> np.ndarray:
    """Each item's ridge: weighted-lambda, growing like the item's weighted row count (DP count
    n^(1+e) under user-level weights w ~ n^e), plus a floor at the scale of the noise in A_j (N of
    `release_units`), so that pure noise shrinks to 0."""
    settings = config.settings()
    _, noise_scale = release_units(config, multiplier, averaged)
    ridge_scale = (
        np.full(space.size, config.noise_ridge * noise_scale / config.ridge)
        if config.ridge > 0
        else np.ones(space.size)
    )
    exponent = settings.weight_exponent if settings.unit == "user" else 0.0
    ridge_scale[space.index_of(counts["item_id"].to_numpy())] += counts["count"].to_numpy() ** (1 + exponent)
    return ridge_scale


def _ssp_penalties(
    config: TrainConfig,
    space,
    multiplier: float,
    *,
    rating_range: tuple[float, float],
    has_residual: bool,
    bias_weights: np.ndarray | None,
    resamples: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The SSP item update's per-item ridge scale, residual penalty and anchor, in the units the
    release defines (never bare numbers: S and N of `release_units`). The ridge is ridge * S + noise_ridge * N, the same
    for every
    item: its share of an item's problem fades as the item's data grows, so popular items are not
    shrunk like rare ones. The residual penalty mu = residual_penalty * (S + N) keeps an item's
    free residual at zero until its statistics outweigh the noise: such an item stays what its
    public features say (the starting point), not what the noise says. The anchor kappa =
    anchor * (S + N) holds the shared encoder's output near where the update began, in the same
    units. With biases the bias coordinate has its own penalty, one per item (`bias_penalty`, from
    `bias_weights`, the released weights of `released_bias_weights` over `resamples` tables), on the
    residual (the features' prediction is the item bias's prior mean; the shared bias is not
    anchored), or with an id encoder on the whole coordinate."""
    unit, noise = release_units(config, multiplier)
    d = config.encoder_dim
    ridge_scale = np.full(
        (space.size, d), unit + (config.noise_ridge * noise / config.ridge if config.ridge > 0 else 0.0)
    )
    residual = np.full((space.size, d), config.residual_penalty * (unit + noise))
    anchor = np.full(d, config.anchor * (unit + noise))
    if config.biases:
        penalty = bias_penalty(config, multiplier, rating_range, bias_weights, resamples)
        ridge_scale[:, -1] = (
            penalty / config.ridge if not has_residual and config.ridge > 0 else unit
        )  # --ridge 0: no ridge at all
        residual[:, -1] = penalty
        anchor[-1] = 0.0
    return ridge_scale, residual, anchor


def bias_penalty(
    config: TrainConfig, multiplier: float, rating_range: tuple[float, float], weights: np.ndarray, resamples: int = 1
) -> np.ndarray:
    """Each item's bias prior precision in the units of A_j's bias coordinate (c^2 per unit weight):
    noise over prior variance, the posterior of the DP per-item mean (trainer.item_mean), with the
    prior from the public rating scale (trainer.item_mean.rating_prior: tau = range / 4).
    `weights`: each item's weight W_j as released (A_j's bias entry over c^2, `released_bias_weights`).
    Three sources of noise:
    - the ratings' own, sigma = range / 2 per unit weight: (sigma / tau)^2 wbar c^2 = 4 wbar c^2;
    - the noise on A_j's bias entry, its standard deviation z S (N / (2 sqrt(d)): one entry's share);
    - the noise on b_j's bias entry, std_b = z wbar Gamma_y rho (rho the rows' norm bound), against the
      prior of the bias: std_b^2 / (tau^2 W_j), the per-item mean's V / (tau^2 W_j), larger the
      fewer ratings the item has. W_j is taken at its lower bound, the released weight less twice
      its noise (s_W = z S / c^2, over sqrt(R) for R resamples), floored at a thousandth of s_W: at a
      low epsilon the noisy DP counts let items of a few ratings into the statistics, whose released
      weight is mostly noise; their bias stays what their features say. Measured against one penalty
      for every item (W = 1 / c^2): docs/results.md#each-items-bias-penalty-from-its-own-released-weight.
    Why not the embedding's penalties: those are sized to the spectral norm of d x d noise and hold
    the bias of every item below a few thousand ratings at zero (at 10^5 users x 20 ratings the
    model lost to the per-item mean)."""
    from trainer.item_mean import rating_prior

    settings = config.settings()
    unit, noise = release_units(config, multiplier)
    sigma, tau = rating_prior(rating_range)
    c, pseudo_weights = settings.bias_scale, (sigma / tau) ** 2
    weights = np.asarray(weights, dtype=np.float64)
    if noise == 0:
        return np.full(weights.shape, pseudo_weights * unit * c**2)
    std_b = multiplier * settings.wbar * settings.clip_y * settings.noise_clips()[0]
    entry = noise / (2 * math.sqrt(config.encoder_dim))  # z S: one entry of A_j's noise
    noise_w = entry / c**2 / math.sqrt(resamples)
    lower = np.maximum(weights - 2 * noise_w, noise_w / 1000)
    return pseudo_weights * settings.wbar * c**2 + entry + std_b**2 / (tau**2 * lower)


def released_bias_weights(tables: list[str], space, d: int, bias_scale: float) -> np.ndarray:
    """Each catalog item's weight W_j as the release states it: A_j's bias entry (the last diagonal
    entry) over c^2, the mean over the R resampled tables; 0 for an item without statistics.
    Post-processing of the release."""
    weights = np.zeros(space.size)
    for table in tables:
        for batch in storage.iter_batches(table, batch_size=8192):
            positions = space.index_of(batch.column("item_id").to_numpy())
            weights[positions] += (
                list_column_to_matrix(batch.column("a_upper"), packed_size(d), "a_upper")[:, -1]
                / bias_scale**2
                / len(tables)
            )
    return weights


def _check_step(config: TrainConfig, step: int) -> None:
    if not isinstance(step, int) or not 1 <= step <= config.outer_steps:
        raise UserError(f"--step must be an outer step of the run, 1..{config.outer_steps}, got {step}")


def item_update(run: Run, step: int, progress: bool = True) -> dict:
    """Stage 2c of step s (TensorFlow): fit the encoder from step s's released statistics and the
    public features, starting from step s-1's checkpoint; the last step also exports the encoder
    and the final item embeddings. Marks the step done and returns the manifest (a done step is
    left as it is)."""
    from trainer import curves
    from trainer import encoder as encoders

    manifest = run.prepared()
    config = config_of(run, manifest)
    _check_step(config, step)
    if step in manifest["steps_done"]:
        logs.log(f"outer step {step} of {run.root} is already done")
        return manifest
    require_steps(run, manifest, step)
    started = time.time()
    space, model = build_encoder(config, storage.read_table(manifest["prepared"]["items"]))
    encoders.restore_checkpoint(model, run.checkpoint(step - 1))
    losses = []  # the SSP loss by epoch (from released statistics); the other updates have no public loss
    if config.item_update == "dpsgd":
        _dpsgd_update(run, config, manifest, step, space=space, model=model, progress=progress)
    elif config.item_update not in FIXED_UPDATES and covers_items(
        manifest
    ):  # none, gram, or no item covered: the encoder stays as it started
        losses = _stats_update(run, config, step, space, model, progress)
    normalise_embeddings(model, config)
    if step == config.outer_steps and config.encoder == "features":  # new items: the features' best guess
        fitted = model.refit_shared(catalog_counts(run, space))
        if fitted:
            logs.log(f"new items: the shared encoder refit to the embeddings of the {fitted} items the updates moved")
    embeddings = item_embeddings_table(model, config)
    storage.write_table(embeddings, run.item_embeddings(step))
    encoders.write_checkpoint(model, run.checkpoint(step))
    if step == config.outer_steps:
        storage.write_table(embeddings, run.path("item_embeddings.parquet"))
        encoders.export(model, run.path("encoder"), config.settings().bias_scale if config.biases else None)
    spent = Ledger.open(run.ledger).epsilon_spent()
    curves.write_step(run.step(step), run.path("tensorboard", f"step-{step}"), losses, spent, time.time() - started)
    manifest = run.mark_step_done(step)
    logs.log(f"outer step {step}/{config.outer_steps} done (epsilon spent {spent:.4g})")
    return manifest


def _stats_update(run: Run, config: TrainConfig, step: int, space, model, progress: bool) -> list[float]:
    """The item update from step s's released statistics: the SSP trainer (each of the R resamples
    in turn), or the DP-ALS / DP-CMF closed-form solves from the mean of the R resamples
    (post-processing of the release: R independent noisy copies, all paid for, average to 1/R of
    the noise variance). Returns the SSP trainer's loss by epoch (none for a closed-form solve)."""
    from trainer import ssp

    if not storage.exists(storage.join(run.stats(step), stats_job.RELEASE_SUMMARY)):
        raise UserError(
            f"{run.root}: the statistics of step {step} are not released ({run.stats(step)} is incomplete); run step "
            f"{step}'s stats job first"
        )
    summary = storage.read_json(storage.join(run.stats(step), stats_job.RELEASE_SUMMARY))
    settings = config.settings()
    tables = stats_job.stats_tables(run.stats(step))
    multiplier = ledger_multiplier(run.ledger)
    ssp_config = ssp.SSPConfig(
        config.epochs,
        config.batch_size,
        config.learning_rate,
        config.ridge,
        psd_projection=config.psd_projection and not config.non_private,
        seed=config.model_seed,
        solve_residuals=config.biases and config.protocol == "rmse",
    )
    # the release parameters the run's own ledger planned (not the folder's word for them)
    expected = {
        "clip_u": settings.clip_u,
        "clip_y": settings.clip_y,
        "wbar": settings.wbar,
        "noise_multiplier": multiplier,
        "bias": float(settings.bias),
    }
    if summary["noise_multiplier"] != expected["noise_multiplier"]:
        raise UserError(
            f"{run.stats(step)}: released with noise multiplier {summary['noise_multiplier']:g}, but this run "
            f"planned {expected['noise_multiplier']:g}"
        )
    if config.loss == "logistic":  # SSP2's A_j, b_j around the step's starting item embeddings (post-processing)
        for table in tables:
            ssp.check_stats(table, {"d": config.dim, **expected})
        start = validate_item_embeddings(storage.read_table(run.item_embeddings(step - 1)), dim=config.dim).sort_by(
            "item_id"
        )
        points = (start["item_id"].to_numpy(), list_column_to_matrix(start["embedding"], config.dim, "item embedding"))
        tables = [
            ssp.expand_table(
                table,
                storage.join(run.stats(step), "expanded-" + table.rsplit("/", 1)[-1]),
                points,
                ssp_config.psd_projection,
            )
            for table in tables
        ]
        ssp_config = dataclasses.replace(ssp_config, psd_projection=False)  # done before the expansion
    gravity = None
    if config.gravity > 0:  # implicit feedback: penalise every item's scores through the users' DP Gram matrix
        seeds = release.open_seed_file(config.seed_file, run.ledger)
        gravity = config.gravity * dp_gram(run.user_embeddings(step), Ledger.open(run.ledger), seeds, settings, step)
    if config.item_update in ("als", "cmf"):  # weighted-lambda ridges, from the mean of the resamples
        ridge_scale = _ridge_scale(config, space, multiplier, storage.read_table(run.counts), len(tables))
    if config.item_update in ("als", "cmf", "item-mean") and len(tables) > 1:
        for table in tables:  # each resample as released (what the ledger planned), before they are mixed
            ssp.check_stats(table, {"d": config.encoder_dim, **expected})
        tables = [ssp.mean_table(tables, storage.join(run.stats(step), "mean-of-resamples.parquet"))]
    if config.item_update == "item-mean":  # a posterior mean per item, from the release's own noise scale
        from pipelines.training.prepare import prepared_rating_range
        from trainer import item_mean

        model.set_item_vectors(
            item_mean.item_means(
                tables[0],
                space,
                settings.bias_scale,
                item_mean.noise_std_b(tables[0]),
                prepared_rating_range(run.prepared()["prepared"]),
                expected,
            )
        )
        return []
    if config.item_update == "als":
        from trainer import als

        model.set_item_vectors(
            als.solve_items(
                tables[0],
                space,
                config.encoder_dim,
                config.ridge,
                ridge_scale=ridge_scale,
                psd_projection=ssp_config.psd_projection,
                expected=expected,
                gravity=gravity,
            )
        )
        return []
    elif config.item_update == "cmf":
        from trainer import cmf

        # The feature vectors are a function of the previous item vectors (the feature solve), so
        # nothing but the encoder carries over between steps; step 1 starts from DP-ALS (P = 0).
        features = (
            cmf.solve_features(
                cmf.feature_matrix(space), model.embed_all(), config.feature_weight, config.feature_ridge
            )
            if step > 1
            else None
        )
        table = tables[0]
        if ssp_config.psd_projection:  # once, not once per inner iteration
            table = ssp.project_table(table, storage.join(run.stats(step), "psd-" + table.rsplit("/", 1)[-1]))
        vectors, _ = cmf.solve_items(
            table,
            space,
            config.encoder_dim,
            config.ridge,
            ridge_scale=ridge_scale,
            psd_projection=False,
            expected=expected,
            feature_weight=config.feature_weight,
            feature_ridge=config.feature_ridge,
            inner_iterations=config.cmf_iterations,
            feature_vectors=features,
            gravity=gravity,
        )
        model.set_item_vectors(vectors)
        return []
    from pipelines.training.prepare import prepared_rating_range

    label_range = (
        prepared_rating_range(run.prepared()["prepared"]) if config.protocol == "rmse" else (0.0, 1.0)
    )  # ranking labels: 1, and 0 by gravity
    weights = None
    if config.biases:
        for table in tables:  # the tables' parameters before their entries are read
            ssp.check_stats(table, {"d": config.encoder_dim, **expected})
        weights = released_bias_weights(tables, space, config.encoder_dim, settings.bias_scale)
    ssp_ridge, residual_penalty, anchor = _ssp_penalties(
        config,
        space,
        multiplier,
        rating_range=label_range,
        has_residual=model.has_residual,
        bias_weights=weights,
        resamples=len(tables),
    )
    with _kernel(run, step):
        return ssp.train(
            model,
            tables,
            ssp_config,
            expected=expected,
            progress=logs.bars(progress),
            ridge_scale=ssp_ridge,
            gravity=gravity,
            residual_penalty=residual_penalty,
            anchor=anchor,
            hold_residuals=config.item_gram_share > 0,  # the item Gram's start, held until the statistics outweigh it
        )


@contextmanager
def _kernel(run: Run, step: int):
    """Time the item update's trainer steps into the manifest's `kernel_seconds` (Run.record_seconds)."""
    started = time.perf_counter()
    yield
    run.record_seconds(f"step-{step}/item_update", time.perf_counter() - started, "kernel_seconds")


def _dpsgd_update(run: Run, config: TrainConfig, manifest: dict, step: int, *, space, model, progress: bool) -> None:
    """AM-DPSGD's item update: TF-Privacy DP-SGD on the private training rows (weighted, clipped
    per user) against step s's user embeddings, released through the ledger as one DP-SGD event.
    Its sampling rate is planned over the DP number of users (so the event's q reveals no exact
    count); every user is still sampled with that rate when the true number is larger.
    Its sampling and noise are seeded from the run's secret seed and the release index, so a rerun
    of the step (after a crash) reproduces the same release rather than spending budget twice."""
    import hashlib

    from privacy.weights import user_level_weights
    from trainer import dpsgd

    units = manifest["prepared"]["units"]  # the DP number of users (released with the counts), never the exact one
    settings = config.settings()
    rows = storage.read_table(run.centred)
    users, positions, labels = (
        rows["user_id"].to_numpy(),
        space.index_of(rows["item_id"].to_numpy()),
        rows["label"].to_numpy(),
    )
    seeds = release.open_seed_file(config.seed_file, run.ledger)
    if (
        config.loss == "logistic"
    ):  # positives and sampled negatives (secret randomness), weighted as SSP-convex weighs its every-item negatives
        negatives = np.random.default_rng(
            int.from_bytes(hashlib.sha256(seeds.seed + b"negatives" + step.to_bytes(8, "big")).digest()[:8], "big")
        )
        users, positions, labels, weights = dpsgd.logistic_rows(users, positions, space.size, negatives)
    else:
        confidence = None
        if (
            settings.confidence
        ):  # the ranking rows' labels are confidences: the weights (within each user's budget); every row a positive
            confidence, labels = labels, np.ones(labels.size)
        if settings.unit == "user":
            counts = storage.read_table(run.counts).sort_by("item_id")
            row_counts = counts["count"].to_numpy()[
                np.searchsorted(counts["item_id"].to_numpy(), rows["item_id"].to_numpy())
            ]
            weights = user_level_weights(users, row_counts, settings.wbar, settings.weight_exponent, confidence)
        else:
            weights = np.ones(rows.num_rows) if confidence is None else confidence
    embeddings = validate_user_embeddings(storage.read_table(run.user_embeddings(step)), dim=config.vector_dim).sort_by(
        "user_id"
    )
    user_vectors = (
        embeddings["user_id"].to_numpy(),
        list_column_to_matrix(embeddings["embedding"], config.vector_dim, "user embedding"),
    )
    clip_u = settings.clip_u
    if (
        config.biases
    ):  # fit [Clip(u), c] . [v, b] to the label less b_u, as the statistics do (stats_core.biased_user_rows)
        vectors, user_biases = stats_core.biased_user_rows(user_vectors[1], settings)
        labels = (
            labels - user_biases[np.minimum(np.searchsorted(user_vectors[0], users), user_biases.size - 1)]
        )  # a user without one: dpsgd names it
        user_vectors, clip_u = (
            (user_vectors[0], vectors),
            settings.noise_clips()[0],
        )  # the rows' norm bound: clipping them again changes nothing
    ledger = Ledger.open(run.ledger)
    multiplier = float(
        manifest["prepared"]["dpsgd_multiplier"]
    )  # planned by prepare over `units`; the ledger caps what it spends
    q, steps = config.dpsgd_schedule(units)
    event = accounting.dpsgd_event(multiplier, q, steps)
    inputs = {
        "rows": seeds.digest_table(run.centred),
        "user_embeddings": seeds.digest_table(run.user_embeddings(step)),
        "counts": seeds.digest_table(run.counts),
    }
    release.check_counts_release(ledger, seeds, run.counts, inputs["counts"])
    index = release.make_release(
        ledger,
        seeds,
        f"step-{step}/dpsgd",
        event,
        {"settings": asdict(config.dpsgd_config(units)), "units": units, "inputs": inputs},
    )
    seed = int.from_bytes(
        hashlib.sha256(seeds.release_seed(index) + b"dpsgd").digest()[:8], "big"
    )  # keyed by the release, as every noise draw
    with _kernel(run, step):
        result = dpsgd.train(
            model,
            (users, positions, labels, weights),
            user_vectors,
            config.dpsgd_config(units, seed),
            noise_multiplier=multiplier,
            clip_u=clip_u,
            clip_y=settings.clip_y,
            progress=logs.bars(progress),
            units=units,
        )
    if accounting.event_to_json(result["event"]) != accounting.event_to_json(event):
        raise RuntimeError(f"DP-SGD ran {result['event']}, not the recorded release {event}")
