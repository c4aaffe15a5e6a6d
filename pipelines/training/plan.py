"""`ssp train --plan`: what a run would release, before anything is read or spent.

From the settings alone (and the public catalog's size): the budget split over the release groups,
each release's noise multiplier, L2 sensitivity and noise standard deviation, and the DP count an
item needs for its statistics to rise above the noise. PipelineDP previews utility the same way
before a release. Nothing private is read (not even the data set's row counts) and the ledger is not
touched, so planning costs no privacy and may be repeated freely.

Privacy: reads nothing private and spends nothing: the plan follows from the settings and the public
catalog's size.
"""

from __future__ import annotations

import math

from pipelines.releases import release
from pipelines.releases.mean import DEFAULT_USER_CAP
from pipelines.training.settings import TrainConfig, dim_chosen_by_item_gram, release_units
from privacy.clipping import biased_row_clip

LOW_RATIO_THRESHOLD, HIGH_RATIO_THRESHOLD = 1.0, 6.0  # prepare.stats_threshold_of's rule, in units of N/S


def _rows(
    config: TrainConfig, privacy: release.PrivacySettings, multipliers: dict
) -> list[tuple[str, str, int, str, str, str]]:
    """(release group, budget share, events, noise multiplier, L2 sensitivity, noise std) of each planned group."""
    settings = config.settings()
    rho, clip_y = settings.noise_clips()
    k = config.bias_coordinate if config.biases else 0.0
    out = []
    for group in privacy.plan():
        name = "dpsgd" if group.name == "stats" and config.item_update == "dpsgd" else group.name
        z = multipliers.get(name)
        if name == "counts":
            sensitivity, what = (
                math.sqrt(config.max_items_per_user + 1),
                f"sqrt(K + 1), K = {config.max_items_per_user} items per user",
            )
        elif name == "mean":
            sensitivity, what = (
                DEFAULT_USER_CAP,
                f"{DEFAULT_USER_CAP:g} (the count; the sum: times half the rating range)",
            )
        elif name == "gram":
            sensitivity = biased_row_clip(config.clip_u, k) ** 2
            what = f"(1 + k^2) Gamma_u^2 = {sensitivity:.4g}"
        elif name == "item_gram":
            sensitivity, what = 1.0, "1 (each user's row over the top items at unit norm)"
        elif name == "item_gram_more":
            sensitivity, what = (
                1.0,
                "1; a second item Gram release when the first detects directions beyond popularity above its noise, "
                "else this share goes to the statistics (their multiplier recalibrated, lower)",
            )
        elif name == "dpsgd":
            sensitivity, what = config.dpsgd_clip, f"the gradient clip C = {config.dpsgd_clip:g}"
        else:
            unit = settings.wbar * rho**2
            a, b = (
                ("wbar (1 + k^2) Gamma_u^2", "wbar Gamma_y sqrt(1 + k^2) Gamma_u")
                if k
                else ("wbar Gamma_u^2", "wbar Gamma_y Gamma_u")
            )
            if config.loss == "logistic":
                a, b = "S (privacy.quadratic's bound)", "its gradient bound"
            sensitivity, what = unit, f"A: {a} = {unit:.4g}; b: {b} = {settings.wbar * clip_y * rho:.4g}"
        multiplier = "after the counts release (from the DP number of users)" if z is None else f"{z:.4g}"
        std = "-" if z is None else f"{z * sensitivity:.4g}"
        events = "one per DP-SGD step" if name == "dpsgd" else group.events
        out.append((name, f"{group.share:.3g}", events, multiplier, what, std))
    return out


def describe(config: TrainConfig, catalog_items: int | None) -> str:
    """The plan of `config`'s run as text (see the module docstring)."""
    if config.non_private:
        return (
            "plan: a non-private run (--non-private) releases nothing and has no guarantee: no noise, no "
            "clipping, nothing to plan"
        )
    privacy = config.privacy()
    multipliers = privacy.multipliers()
    read = "nothing read but the catalog's size" if catalog_items else "no data set read (no --data: no catalog size)"
    lines = [
        f"plan ({read}, nothing spent): user-level epsilon {config.epsilon:g}, delta "
        f"{config.delta:g}, "
        f"{privacy.accountant.upper()} accountant, {config.outer_steps} outer step(s) x {config.resamples} resample(s)",
        "",
        "| release | budget share | events | noise multiplier | L2 sensitivity (one user) | noise std per event |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in _rows(config, privacy, multipliers)]
    lines += [
        "",
        f"Symbols: K the most items counted per user; Gamma_u = {config.clip_u:g} the user embeddings' clip, Gamma_y "
        f"= {config.clip_y:g} "
        f"the labels' clip, wbar = {config.wbar:g} the bound on a user's weights"
        + (f", k = {config.bias_coordinate:g} the item-bias coordinate's share of the clip" if config.biases else "")
        + "; a release's noise std is its multiplier times its sensitivity.",
    ]
    if config.item_update in ("ssp", "item-mean", "als", "cmf") and "stats" in multipliers:
        unit, noise = release_units(config, multipliers["stats"])
        per_item = noise / unit
        lines += [
            "",
            f"Each item's A_j gets noise of spectral norm about N = 2 sqrt(d) z S = {noise:.4g} (S = {unit:.4g}, the "
            "most one user adds; "
            f"d = {config.encoder_dim}): an item's statistics rise above the noise from a DP count of about N/S = "
            f"{per_item:.4g} users"
            + (
                " at this d; d becomes 32 if the item Gram's release keeps many directions (--dim-from-item-gram)."
                if dim_chosen_by_item_gram(config)
                else "."
            ),
        ]
        if config.item_update == "ssp" and config.encoder == "features":
            rule = (
                f"--stats-threshold {config.stats_threshold:g}: items from a DP count of "
                f"{config.stats_threshold * per_item:.4g}"
                if config.stats_threshold is not None
                else f"by default items from {LOW_RATIO_THRESHOLD:g} N/S = {LOW_RATIO_THRESHOLD * per_item:.4g}, or "
                "from "
                f"{HIGH_RATIO_THRESHOLD:g} N/S = {HIGH_RATIO_THRESHOLD * per_item:.4g} when the noise-to-signal "
                "ratio sqrt(m) (N/S) / "
                f"sqrt(C n) exceeds 0.03 (C, n: the DP counts' total and users, known after the counts release"
                + (f"; m = {catalog_items} catalog items" if catalog_items else "")
                + ")"
            )
            lines.append(f"The statistics cover {rule}; the others keep their public-feature embedding.")
    return "\n".join(lines)
