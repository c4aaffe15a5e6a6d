"""RUN/report.html: the page a person opens after a run. The test metrics against their baseline
(DP popularity for a ranking, predicting the DP mean for ratings) overall and by item popularity
fifth, the budget's split (what each release covers and what it cost), example recommendations with
the catalog's titles, and the privacy guarantee in plain words. One self-contained file: inline SVG
plots, no script, nothing fetched when it opens.

Privacy: the page is built from the held-out private split (its metrics and the example users'
histories) and the ledger; it stays in the run folder beside metrics.json, says so at its top, and
`ssp publish` never copies it.
"""

from __future__ import annotations

import html
import math

from privacy.ledger import Ledger
from privacy.report import covers
from trainer.metrics import AT_K, RANKING

MODEL, BASELINE = "#3366cc", "#a0a0a0"  # the model's colour and its baseline's, in every plot
RELEASE_COLOURS = ("#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00")
FIFTHS = ("least popular", "2nd", "3rd", "4th", "most popular")
STYLE = """body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}.note{color:#555}.hit{color:#109618;font-weight:bold}
.warn{color:#b00;font-weight:bold}ol{margin-top:.2em}"""


def _e(text) -> str:
    return html.escape(str(text))


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def bar_chart(title: str, groups: list[str], series: list[tuple[str, list, str]], width: int = 600) -> str:
    """A grouped bar chart as inline SVG: one group per label of `groups`, one bar per (name, values,
    colour) of `series` (a None value draws no bar), with its value above it and a legend."""
    height, top, bottom, left = 240, 30, 40, 10
    peak = max([v for _, values, _ in series for v in values if v is not None] or [1.0]) or 1.0
    slot = (width - left) / len(groups)
    bar = slot * 0.8 / len(series)
    parts = [
        f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f"<title>{_e(title)}</title>",
    ]
    for g, label in enumerate(groups):
        x0 = left + g * slot + slot * 0.1
        for s, (name, values, colour) in enumerate(series):
            value = values[g]
            if value is None:
                continue
            h = (height - top - bottom) * value / peak
            x, y = x0 + s * bar, height - bottom - h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar * 0.9:.1f}" height="{h:.1f}" fill="{colour}">'
                f"<title>{_e(name)}, {_e(label)}: {value:.4f}</title></rect>"
                f'<text x="{x + bar * 0.45:.1f}" y="{y - 3:.1f}" font-size="10" text-anchor="middle">{value:.3f}</text>'
            )
        parts.append(
            f'<text x="{left + (g + 0.5) * slot:.1f}" y="{height - bottom + 15}" font-size="12" '
            f'text-anchor="middle">{_e(label)}</text>'
        )
    for s, (name, _, colour) in enumerate(series):
        x = left + s * 220
        parts.append(
            f'<rect x="{x}" y="{height - 15}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{height - 5}" font-size="12">{_e(name)}</text>'
        )
    return "".join(parts) + "</svg>"


def budget_bar(costs: list[tuple[str, float]], total: float, width: int = 600) -> str:
    """The budget as one horizontal bar of `total` epsilon, a segment per (release, its cost)."""
    parts = [
        f'<svg role="img" width="{width}" height="70" viewBox="0 0 {width} 70">',
        "<title>the budget by release</title>",
    ]
    x = 0.0
    for i, (name, cost) in enumerate(costs):
        w = width * max(cost, 0.0) / total if total > 0 else 0.0
        colour = RELEASE_COLOURS[i % len(RELEASE_COLOURS)]
        parts.append(
            f'<rect x="{x:.1f}" y="5" width="{w:.1f}" height="30" fill="{colour}">'
            f"<title>{_e(name)}: epsilon {cost:.4g}</title></rect>"
        )
        if w > 40:
            parts.append(f'<text x="{x + 3:.1f}" y="55" font-size="11">{_e(name)}</text>')
        x += w
    if x < width - 1:  # what is left of the budget
        parts.append(f'<rect x="{x:.1f}" y="5" width="{width - x:.1f}" height="30" fill="none" stroke="#999"/>')
    return "".join(parts) + "</svg>"


def _quality(metrics: dict) -> list[str]:
    if "no_heldout_data" in metrics:
        return [f"<p>No test metrics: {_e(metrics['no_heldout_data'])}</p>"]
    if metrics["protocol"] == "rmse":
        baseline, rows = "predicting the DP mean", [("RMSE (lower is better)", "test_rmse", "test_mean_predictor_rmse")]
        sliced = (metrics["test_rmse_sliced"], metrics["test_mean_predictor_rmse_sliced"])
        better = metrics["test_rmse"] < metrics["test_mean_predictor_rmse"]
        headline = "test RMSE"
    else:
        baseline = "popularity (exact counts)" if metrics["non_private"] else "DP popularity"
        at = sorted(int(key.removeprefix("test_map_at_")) for key in metrics if key.startswith("test_map_at_"))
        rows = [(name, f"test_{key}", f"test_popularity_{key}") for key, name in RANKING.items()]
        rows += [
            (f"{name} at {k}", f"test_{name}_at_{k}", f"test_popularity_{name}_at_{k}") for k in at for name in AT_K
        ]
        sliced = (metrics["test_recall_at_20_sliced"], metrics.get("test_popularity_recall_at_20_sliced", [None] * 5))
        better = metrics["test_recall_at_20"] > metrics.get("test_popularity_recall_at_20", -math.inf)
        headline = "test Recall@20"
    out = [
        "<h2>Quality on the held-out test users</h2>",
        f'<p class="{"" if better else "warn"}">The model is {"above" if better else "BELOW"} {_e(baseline)} on the '
        f"{headline}.</p>",
        f"<table><tr><th>metric</th><th>model</th><th>{_e(baseline)}</th><th>difference</th></tr>",
    ]
    for name, model, base in rows:
        a, b = metrics.get(model), metrics.get(base)
        difference = "-" if a is None or b is None else f"{a - b:+.4f}"
        out.append(
            f'<tr><td>{_e(name)}</td><td class="n">{_number(a)}</td><td class="n">{_number(b)}</td>'
            f'<td class="n">{difference}</td></tr>'
        )
    out.append("</table><h3>By item popularity (fifths of the catalog by training interactions)</h3>")
    out.append(
        bar_chart(
            f"{headline} by popularity fifth",
            list(FIFTHS),
            [("model", sliced[0], MODEL), (baseline, sliced[1], BASELINE)],
        )
    )
    return out


def _budget(ledger: Ledger, settings: dict, non_private: bool) -> list[str]:
    out = ["<h2>The budget</h2>"]
    if non_private:
        return out + ['<p class="warn">A non-private run: nothing was released under a privacy budget.</p>']
    total, before, costs = ledger.budget["epsilon"], 0.0, []
    header = ("#", "release", "what it covers", "noise multiplier", "epsilon of it", "epsilon after")
    rows = ["<table><tr>" + "".join(f"<th>{name}</th>" for name in header) + "</tr>"]
    for row in ledger.rows:
        cost = row["epsilon_spent"] - before
        before = row["epsilon_spent"]
        costs.append((row["name"], cost))
        rows.append(
            f'<tr><td class="n">{row["release"]}</td><td><code>{_e(row["name"])}</code></td>'
            f'<td>{_e(covers(row["name"], settings)[0])}</td><td class="n">{row["noise_multiplier"]:.4g}</td>'
            f'<td class="n">{cost:.4g}</td><td class="n">{row["epsilon_spent"]:.4g}</td></tr>'
        )
    spent = ledger.epsilon_spent()
    return out + [
        f"<p>Spent epsilon {spent:.4g} of {total:g} (delta {ledger.budget['delta']:g}) over {len(ledger.rows)} "
        "releases, composed by the accountant: a release's epsilon is what it added to the total.</p>",
        budget_bar(costs, total if math.isfinite(total) else max(spent, 1e-12)),
        *rows,
        "</table>",
    ]


def _examples(examples: list[dict], titles: dict, ratings: bool, keys: dict) -> list[str]:
    out = ["<h2>Example recommendations</h2>"]
    if not examples:
        return out + ["<p>No held-out user to show.</p>"]
    held = "a test rating" if ratings else "a held-out interaction"
    out.append(f'<p class="note">Held-out test users; <span class="hit">&#10003;</span> marks {held}.</p>')

    def name(item) -> str:
        title, key = titles.get(item), keys.get(item, item)
        return f"{_e(title)} <small>({_e(key)})</small>" if title is not None else f"item {_e(key)}"

    for example in examples:
        seen = ", ".join(
            name(item) + (f" rated {label:g}" if ratings else "") for item, label in example["history"][:8]
        )
        more = len(example["history"]) - 8
        out.append(
            f"<h3>User {_e(example['user'])}</h3><p>History: {seen}{f', and {more} more' if more > 0 else ''}</p><ol>"
        )
        for item, score, label in example["recommended"]:
            mark = (
                "" if label is None else f' <span class="hit">&#10003;{f" rated {label:g}" if ratings else ""}</span>'
            )
            out.append(f"<li>{name(item)} <small>score {score:.3f}</small>{mark}</li>")
        out.append("</ol>")
    return out


def _plain_words(metrics: dict, ledger: Ledger) -> list[str]:
    out = ["<h2>Privacy in plain words</h2>"]
    if metrics["non_private"]:
        return out + [
            '<p class="warn">No privacy: this run used every interaction exactly. Do not publish its model.</p>'
        ]
    eps, delta = ledger.epsilon_spent(), ledger.budget["delta"]
    factor = f"{math.exp(eps):,.3g}" if eps < 700 else f"e^{eps:g}"
    return out + [
        f"<p>Whatever one {_e(ledger.budget['unit'])}'s whole history is, everything this run released (the model, its "
        f"statistics, the counts) is almost as likely without it: no outcome becomes more than {factor} times "
        f"(e^{eps:.3g}) as likely, except with a chance of at most {delta:g}. Repeated runs on the same users add "
        "up: see the lifetime budget in privacy.md.</p>",
        "<p>This page is not part of that guarantee: its metrics and examples come from held-out users' real data. "
        "Keep it with the run; it is never published.</p>",
    ]


def render(
    run_name: str,
    metrics: dict,
    ledger: Ledger,
    settings: dict,
    examples: list[dict],
    titles: dict,
    keys: dict | None = None,
) -> str:
    """The page, from the run's metrics.json contents, ledger, public settings (privacy.report's),
    example recommendations (evaluation.example_recommendations), the catalog's titles by item id
    and, for a catalog with text ids, its keys by item id."""
    guarantee = (
        "non-private"
        if metrics["non_private"]
        else f"({ledger.epsilon_spent():.3g}, {ledger.budget['delta']:g})-DP at the {ledger.budget['unit']} level"
    )
    body = [
        f"<h1>Run {_e(run_name)}</h1>",
        f'<p class="note">{_e("ratings (RMSE)" if metrics["protocol"] == "rmse" else "ranking")}, {_e(guarantee)}. '
        "Private to the run's operator: built from held-out user data.</p>",
        *_quality(metrics),
        *_budget(ledger, settings, metrics["non_private"]),
        *_examples(examples, titles, metrics["protocol"] == "rmse", keys or {}),
        *_plain_words(metrics, ledger),
    ]
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Run {_e(run_name)}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
