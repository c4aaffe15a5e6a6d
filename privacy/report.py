"""`privacy.md`: a training run's privacy guarantee, written for a reviewer.

Rendered from what the run records (its ledger, its settings, its data set's declared public
features, the data source's budget account), never from private data: the unit of privacy and the
neighbouring relation, epsilon and delta and the accountant, every release with its mechanism, its
noise and what it covers, what is public and what is private, the trust assumptions and the known
caveats. `ssp evaluate` writes it into the run directory, `ssp publish` ships it with the model,
and `ssp privacy RUN --format md` prints it.
"""

from __future__ import annotations

import math

from privacy.ledger import Ledger


def _covers(name: str, settings: dict) -> tuple[str, str]:
    """(what a release covers, the most one user changes it: its L2 sensitivity) by release name."""
    wbar, clip_u, clip_y = settings.get("wbar"), settings.get("clip_u"), settings.get("clip_y")
    if name == "counts":
        k = settings.get("max_items_per_user")
        return ("how many users rated each catalog item (each user's at most K items counted once), and the number of users",
                f"sqrt(K + 1) = {math.sqrt(k + 1):.4g} (K = {k})" if k else "sqrt(K + 1)")
    if name == "mean":
        return ("the mean rating: a weighted sum and count of the ratings, each user's weights summing to at most a fixed cap",
                "set by the cap and the public rating range (pipelines/mean.py)")
    if name.endswith("/gram"):
        return "the users' Gram matrix of item embeddings (implicit feedback)", f"Gamma_u^2 wbar = {clip_u ** 2 * wbar:.4g}" if clip_u and wbar else "Gamma_u^2 wbar"
    if name.endswith("/dpsgd"):
        return ("the item update by DP-SGD: every step's sum of per-user gradients (Poisson-sampled users)",
                f"the per-user gradient clip norm C = {settings.get('dpsgd_clip', 'C')}")
    if "/stats/" in name:
        sensitivity = (f"A: wbar Gamma_u^2 = {wbar * clip_u ** 2:.4g}; b: wbar Gamma_y Gamma_u = {wbar * clip_y * clip_u:.4g}"
                       if wbar and clip_u and clip_y else "A: wbar Gamma_u^2; b: wbar Gamma_y Gamma_u")
        return f"A_j and b_j of every covered catalog item at outer step {name.split('/')[0].removeprefix('step-')} (items without rows too)", sensitivity
    return "a release of the run", "see the ledger's event"


def _families(public_features: dict | list) -> str:
    """The declared public feature families, with their kinds when the data set records them."""
    if isinstance(public_features, dict):
        return ", ".join(f"{name} ({kind})" for name, kind in public_features.items())
    return ", ".join(public_features)


def render(ledger: Ledger, settings: dict, public_features: dict | list | None, run: str) -> str:
    """The Markdown report of the run at `run` (see the module docstring)."""
    budget = ledger.budget
    unit = budget["unit"]
    spent = ledger.epsilon_spent()
    lines = [
        f"# Privacy report: {run}",
        "",
        "## Guarantee",
        "",
        f"- **Unit of privacy: {unit}.** "
        + ("Neighbouring data sets differ by all the ratings of one user, added or removed. Whatever one user's whole history is, "
           "the run's outputs are almost as likely without it: within a factor e^epsilon, plus delta. (User level implies example level "
           "with the same epsilon and delta.)" if unit == "user" else
           "Neighbouring data sets differ by one rating. This does not bound what a user with many ratings reveals."),
        f"- **epsilon {budget['epsilon']:g}, delta {budget['delta']:g}**, composed over every release below with dp-accounting's "
        f"{budget['accountant'].upper()} accountant. Spent: epsilon {spent:.4g} of {budget['epsilon']:g}.",
        "- The noise of every release was calibrated before the first one, so that together they spend the target; a release that "
        "would exceed it is refused before it is computed.",
        "",
        "## Releases",
        "",
        "| # | release | what it covers | mechanism | L2 sensitivity (one user) | epsilon after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ledger.rows:
        covers, sensitivity = _covers(row["name"], settings)
        mechanism = f"Gaussian, noise multiplier {row['noise_multiplier']:.4g}" if row["noise_multiplier"] > 0 else "no noise"
        lines.append(f"| {row['release']} | `{row['name']}` | {covers} | {mechanism} | {sensitivity} | {row['epsilon_spent']:.4g} |")
    lines += [
        "",
        "The noise standard deviation of a release is its noise multiplier times its sensitivity. Each user's rows enter with weights "
        "whose squares sum to at most wbar^2, user embeddings clipped to Gamma_u and labels to Gamma_y, so the sensitivity holds "
        "whatever the length of a user's history.",
        "",
        "## What is public, what is private",
        "",
        "- **Public:** the item catalog and the feature families the data set declares public"
        + (f" ({_families(public_features)})" if public_features else "") + "; "
        "the run's settings (below). Which items a user rated is private even though the items' features are public.",
        "- **Released (differentially private):** the ledger, the DP counts, the statistics of every step, the item encoder and the "
        "item embeddings: all computed from the releases above and the public features only.",
        "- **Private, never published:** `RUN/private/` (the secret noise seed, the ingested data, the split, the user embeddings). "
        "`metrics.json` is an evaluation on held-out private ratings, not a DP release.",
        "",
        "## Trust assumptions",
        "",
        "- The trusted zone (the machines that run the jobs, whoever can read the input tables and `RUN/private/`) sees everything "
        "un-noised; the guarantee is about what leaves it.",
        "- The noise is a keyed function of the secret seed `RUN/private/seed`: whoever holds it can remove the noise from every release.",
        "- The intermediate releases (counts, statistics) are as safe to show as the final model; they count in epsilon whether or not "
        "they are shown.",
        "",
        "## Known caveats",
        "",
        "- The guarantee is relative to the raw input given to the run: every step before a release is row- or user-local (keyed "
        "hashes, DP counts), so removing a user removes exactly that user's rows.",
        "- Differential privacy does not hide what the whole population reveals, such as which genres are popular.",
        "- Repeated runs on the same users compose: see the lifetime budget below.",
    ]
    account = ledger.account()
    lines += ["", "## Lifetime budget of the data source", ""]
    if account is None:
        lines.append("- This run charges no budget account: its epsilon is not composed with other runs on the same users.")
    else:
        cap = "no cap" if account.cap is None else f"cap {account.cap:g}"
        lines.append(f"- Budget account `{account.path}`: epsilon {account.epsilon():.4g} at delta {account.delta:g} ({cap}) over "
                     f"{len(account.counted())} releases of every run it lists.")
    lines += ["", "## Settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| `{key}` | {value} |" for key, value in sorted(settings.items())]
    return "\n".join(lines) + "\n"
