"""`privacy.md`: a training run's privacy guarantee, written for a reviewer.

Rendered from what the run records (its ledger, its settings, its data set's declared public
features, the data source's budget account), never from private data: the unit of privacy and the
neighbouring relation, epsilon and delta and the accountant, every release with its mechanism, its
noise and what it covers, what is public and what is private, the trust assumptions and the known
caveats. `ssp evaluate` writes it into the run directory, `ssp publish` ships it with the model,
and `ssp privacy RUN --format md` prints it.

Privacy: reads the ledger and the run's settings only, no private row.
"""

from __future__ import annotations

import math

from privacy.clipping import biased_row_clip
from privacy.ledger import Ledger

# Settings that concern one kind of release (key -> the end of its ledger names): the report lists them
# only for a run that made it.
RELEASE_SETTINGS = {"mean_share": "mean", "gram_share": "/gram", "item_gram_share": "item_gram", "dpsgd_clip": "/dpsgd"}


def covers(name: str, settings: dict) -> tuple[str, str]:
    """(what a release covers, the most one user changes it: its L2 sensitivity) by release name."""
    wbar, clip_u, clip_y = settings.get("wbar"), settings.get("clip_u"), settings.get("clip_y")
    if name == "counts":
        k = settings.get("max_items_per_user")
        verb = "interacted with" if _implicit(settings) else "rated"
        return (
            f"how many users {verb} each catalog item (each user's at most K items counted once), and the number of "
            "users",
            f"sqrt(K + 1) = {math.sqrt(k + 1):.4g} (K = {k})" if k else "sqrt(K + 1)",
        )
    if name == "mean":
        return (
            "the mean rating: a weighted sum and count of the ratings, each user's weights summing to at most a "
            "fixed cap",
            "set by the cap and the public rating range (pipelines/releases/mean.py)",
        )
    if name in ("item_gram", "item_gram_more"):  # one unit-norm indicator row per user: x_u x_u^T has L2 norm <= 1
        second = (
            " (its second part, fresh noise, pooled with the first: made because the first detected directions beyond "
            "popularity above its noise; else that share goes to the statistics)"
            if name == "item_gram_more"
            else ""
        )
        return (
            "the item Gram: for each pair of the most popular items (by DP count), how many users interacted with "
            f"both, each user's row scaled to unit norm{second}",
            "||x_u||^2 = 1 (x_u the user's unit-norm indicator row over those items)",
        )
    if name.endswith("/gram"):  # one unweighted row per user, [Clip(u)] or with biases [Clip(u), k Gamma_u]
        k = settings.get("bias_coordinate", 2.0) if settings.get("biases") else 0.0
        return (
            "the users' Gram matrix of item embeddings (implicit feedback)",
            f"(1 + k^2) Gamma_u^2 = {biased_row_clip(clip_u, k) ** 2:.4g}" if clip_u else "(1 + k^2) Gamma_u^2",
        )
    if name.endswith("/dpsgd"):
        return (
            "the item update by DP-SGD: every step's sum of per-user gradients (Poisson-sampled users)",
            f"the per-user gradient clip norm C = {settings.get('dpsgd_clip', 'C')}",
        )
    if "/stats/" in name and settings.get("item_update") == "item-mean":  # rows [c], c = k Gamma_u
        k = settings.get("bias_coordinate", 2.0)
        return (
            "each covered catalog item's weighted count and label sum (the per-item mean; items without rows too)",
            f"A: wbar (k Gamma_u)^2 = {wbar * biased_row_clip(clip_u, k, has_embedding=False) ** 2:.4g}; "
            f"b: wbar Gamma_y k Gamma_u = {wbar * clip_y * biased_row_clip(clip_u, k, has_embedding=False):.4g}"
            if wbar and clip_u and clip_y
            else "A: wbar (k Gamma_u)^2; b: wbar Gamma_y k Gamma_u",
        )
    if "/stats/" in name and settings.get(
        "biases"
    ):  # rows [Clip(u), c] with c = k Gamma_u: |x|^2 <= (1 + k^2) Gamma_u^2
        k = settings.get("bias_coordinate", 2.0)
        sensitivity = (
            f"A: wbar (1 + k^2) Gamma_u^2 = {wbar * biased_row_clip(clip_u, k) ** 2:.4g}; b: wbar Gamma_y sqrt(1 + "
            "k^2) Gamma_u = "
            f"{wbar * clip_y * biased_row_clip(clip_u, k):.4g} (the bias coordinate c = k Gamma_u, k = {k:g}, "
            "appended to each clipped user vector)"
            if wbar and clip_u and clip_y
            else "A: wbar (1 + k^2) Gamma_u^2; b: wbar Gamma_y sqrt(1 + k^2) Gamma_u (the bias coordinate c = k "
            "Gamma_u appended)"
        )
        return (
            "A_j and b_j, the item's bias coordinate included, of every covered catalog item at outer step "
            f"{name.split('/')[0].removeprefix('step-')} (items without rows too)",
            sensitivity,
        )
    if "/stats/" in name:
        sensitivity = (
            f"A: wbar Gamma_u^2 = {wbar * clip_u**2:.4g}; b: wbar Gamma_y Gamma_u = {wbar * clip_y * clip_u:.4g}"
            if wbar and clip_u and clip_y
            else "A: wbar Gamma_u^2; b: wbar Gamma_y Gamma_u"
        )
        return (
            f"A_j and b_j of every covered catalog item at outer step {name.split('/')[0].removeprefix('step-')} "
            "(items without rows too)",
            sensitivity,
        )
    return "a release of the run", "see the ledger's event"


def _implicit(settings: dict) -> bool:
    return settings.get("feedback") == "implicit"


def _families(public_features: dict | list) -> str:
    """The declared public feature families, with their kinds when the data set records them."""
    if isinstance(public_features, dict):
        return ", ".join(f"{name} ({kind})" for name, kind in public_features.items())
    return ", ".join(public_features)


def federated_trust(max_dropout: float, neighbours: int | None) -> str:
    """The trust model of a federated run (pipelines.engines.federated, privacy.secure_aggregation), in plain
    words: a section of its own, appended to the report by pipelines.training.publish.privacy_report."""
    k, t = (f"k = {neighbours}", f"t = {neighbours // 2 + 1}") if neighbours else ("k = 2 ceil(log2 n)", "t = k/2 + 1")
    lines = [
        "",
        "## Federated trust model",
        "",
        "- **What the server sees.** Each user's device is a client: it keeps its ratings and its user embedding, "
        "and sends its clipped, "
        "weighted statistics with its share of the noise, masked by secure aggregation (Bonawitz et al. 2017). The "
        "server sees each "
        "client's masked vector (random without the client's secrets), which clients took part and which dropped "
        "out, and the noised "
        "sum; the neighbouring relation above holds with one client's data replaced by an empty device's.",
        f"- **Dropout threshold.** A round goes on only when at least n_min = max(ceil((1 - {max_dropout:g}) n), "
        "floor(n/2) + 1) of the "
        "n clients answer, and the noise is planned for n_min clients, so no sum is ever unmasked with less noise "
        "than planned. A round "
        "with fewer is refused before any client reveals a share; it may run again under the same charge. Any other "
        "round runs once: "
        "a second round of a step is refused, whatever happens to the run's output folders.",
        "- **What the server must not do.** A server that follows the protocol learns only the sum. A server that "
        "shows clients "
        "different survivor lists is caught: every survivor signs the list it was shown and no client reveals a "
        "share without more than "
        "half of the clients' signatures on exactly its list, so the round is refused. The server here also hands "
        "out the clients' "
        "keys: it must not swap them or invent clients (Sybils), which a deployment prevents with keys certified "
        "outside the server.",
        f"- **Collusion threshold.** Each client's secrets are shared among its {k} neighbours, any {t} of whom can "
        "rebuild them: a "
        f"server colluding with {t} of one client's neighbours (fewer are tolerated) can unmask that client's "
        "vector, which carries only "
        "its own 1/n_min share of the noise. The server can always drop clients or abort rounds.",
        "- The exact number of clients is not published: the statistics' release.json gives the counts release's DP "
        "number of users.",
    ]
    return "\n".join(lines) + "\n"


def _factor(epsilon: float) -> str:
    """e^epsilon in words: how much more likely any outcome can be with one user's data than without."""
    return f"e^{epsilon:g} = {math.exp(epsilon):,.3g}" if epsilon < 700 else f"e^{epsilon:g}"


def render(ledger: Ledger, settings: dict, public_features: dict | list | None, run: str) -> str:
    """The Markdown report of the run at `run` (see the module docstring)."""
    budget = ledger.budget
    unit = budget["unit"]
    spent = ledger.epsilon_spent()
    rows, row, verb = (
        ("interactions", "interaction", "interacted with") if _implicit(settings) else ("ratings", "rating", "rated")
    )
    lines = [
        f"# Privacy report: run `{run}`",
        "",
        "## Guarantee",
        "",
        f"- **Unit of privacy: {unit}.** "
        + (
            f"Neighbouring data sets differ by all the {rows} of one user, added or removed. Whatever one user's "
            "whole history is, "
            "the run's outputs are almost as likely without it: within a factor e^epsilon "
            f"({_factor(budget['epsilon'])} here), plus delta. (User level "
            "implies example level "
            "with the same epsilon and delta.)"
            if unit == "user"
            else f"Neighbouring data sets differ by one {row}. This does not bound what a user with many {rows} "
            "reveals."
        ),
        f"- **epsilon {budget['epsilon']:g}, delta {budget['delta']:g}**, composed over every release below with "
        "dp-accounting's "
        f"{budget['accountant'].upper()} accountant. Spent: epsilon {spent:.4g} of {budget['epsilon']:g}.",
        "- The noise of every release was calibrated before the first one, so that together they spend the target; a "
        "release that "
        "would exceed it is refused before it is computed.",
        "",
        "## Releases",
        "",
        "| # | release | what it covers | mechanism | L2 sensitivity (one user) | epsilon after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ledger.rows:
        covered, sensitivity = covers(row["name"], settings)
        mechanism = (
            f"Gaussian, noise multiplier {row['noise_multiplier']:.4g}" if row["noise_multiplier"] > 0 else "no noise"
        )
        lines.append(
            f"| {row['release']} | `{row['name']}` | {covered} | {mechanism} | {sensitivity} | "
            f"{row['epsilon_spent']:.4g} |"
        )
    lines += [
        "",
        "The noise standard deviation of a release is its noise multiplier times its sensitivity. Each user's rows "
        "enter with weights "
        "whose squares sum to at most wbar^2, user embeddings clipped to Gamma_u and labels to Gamma_y, so the "
        "sensitivity holds "
        "whatever the length of a user's history.",
        "",
        "Symbols: A_j and b_j are item j's sufficient statistics (the sum over its users of w x x^T and of w y x, x "
        "the user's clipped "
        "vector, y the label, w the user's weight); wbar the bound on a user's weights (`wbar`); Gamma_u the clip "
        "norm of a user's "
        "embedding (`clip_u`); Gamma_y the clip of a label (`clip_y`); K the most items counted per user "
        "(`max_items_per_user`); k the "
        "item-bias coordinate's share of the clip (c = k Gamma_u, `bias_coordinate`); C the DP-SGD gradient clip "
        "(`dpsgd_clip`).",
        "",
        "## What is public, what is private",
        "",
        "- **Public:** the item catalog and the feature families the data set declares public"
        + (f" ({_families(public_features)})" if public_features else "")
        + "; "
        f"the run's settings (below). Which items a user {verb} is private even though the items' features are public.",
        "- **Released (differentially private):** the ledger, the DP counts, the statistics of every step, the item "
        "encoder and the "
        "item embeddings: all computed from the releases above and the public features only.",
        "- **Private, never published:** `RUN/private/` (the secret noise seed, the ingested data, the split, the "
        "user embeddings). "
        f"`metrics.json` is an evaluation on held-out private {rows}, not a DP release.",
        "",
        "## Trust assumptions",
        "",
        "- The trusted zone (the machines that run the jobs, whoever can read the input tables and `RUN/private/`) "
        "sees everything "
        "un-noised; the guarantee is about what leaves it.",
        "- The noise is a keyed function of the secret seed `RUN/private/seed`: whoever holds it can remove the "
        "noise from every release.",
        "- **Operators.** Copying, moving, restoring or deleting run folders cannot make two releases share noise: "
        "each release's noise "
        "is keyed by the seed, the release's index and a keyed digest of its inputs, so different inputs always get "
        "independent noise "
        "and identical inputs reproduce the same release, free. A seed serves one ledger; a ledger that lost "
        "releases, a budget account "
        "that is missing, replaced or lacks the run's charges, and a release without noise on a capped account are "
        "refused before "
        "anything is released. The data source's account is found by its name (`--data-source`), or by the content "
        "of its interactions when it has none, through the account registry, "
        "which is the root of trust: it must be kept where it cannot be deleted unnoticed (a versioned bucket with a "
        "retention policy).",
        "- **Checks before the first release.** A run stops before anything is released on exact properties of its "
        "data: a label "
        "outside the declared range, an item missing from the catalog, a repeated (user, item) pair, no user "
        "eligible for a ranking "
        "split. These are validations inside the trusted zone; whether a run stopped on them depends on the data "
        "exactly, so that "
        "outcome and its message stay with the operator and are never shown to the users or published.",
        "- The intermediate releases (counts, statistics) are as safe to show as the final model; they count in "
        "epsilon whether or not "
        "they are shown.",
        "",
        "## Known caveats",
        "",
        "- The guarantee is relative to the raw input given to the run: every step before a release is row- or "
        "user-local (keyed "
        "hashes, DP counts), so removing a user removes exactly that user's rows.",
        "- Differential privacy does not hide what the whole population reveals, such as which genres are popular.",
        "- Repeated runs on the same users compose: see the lifetime budget below.",
    ]
    account = ledger.account()
    lines += ["", "## Lifetime budget of the data source", ""]
    if account is None:
        lines.append(
            "- This run charges no budget account: its epsilon is not composed with other runs on the same users."
        )
    else:
        cap = "no cap" if account.cap is None else f"cap {account.cap:g}"
        lines.append(
            f"- Budget account `{account.path.rsplit('/', 1)[-1]}` (id {account.identity}): epsilon "
            f"{account.epsilon():.4g} at delta "
            f"{account.delta:g} ({cap}) over {len(account.counted())} releases of every run on these users it lists."
        )
    names = [row["name"] for row in ledger.rows]
    shown = {  # a release's own setting only where the run made that release
        key: value
        for key, value in settings.items()
        if key not in RELEASE_SETTINGS or any(name.endswith(RELEASE_SETTINGS[key]) for name in names)
    }
    lines += ["", "## Settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| `{key}` | {value} |" for key, value in sorted(shown.items())]
    return "\n".join(lines) + "\n"
