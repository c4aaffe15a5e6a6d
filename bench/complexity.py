"""The paper's cost model of SSP2 against DP-SGD, and a measured ratio beside it.

Model (paper, section "Other Practical Considerations", Proposition "complexity", and Appendix
"Batched Algorithms and Complexity Analysis", paragraph "Comparison of Computational Complexity"):
  - beta_j, the expected number of minibatches of one epoch that contain item j, when batches of B
    examples are drawn with replacement from D examples: beta_j = D/B (1 - (1 - p_j)^B) with
    p_j = |Omega_j| / D; beta = sum_j beta_j (B = 1 gives D, full batch about m).
  - cost ratio SSP2 / DP-SGD over e epochs, equation (eq:app:ratio):
        (D d^2 + e m (c + d^2)) / (c e beta) = m/beta (1 + d^2/c + D d^2 / (c e m)),
    the O() bound with its constant taken as 1, for c = d^2 (an encoder with a hidden layer of width
    >= d) and c = d (an id-only linear encoder, the case least favourable to SSP).
Item counts follow a power law with density f(x) ~ x^(-alpha) on [1, inf) (alpha > 1), taken at
its m quantiles (k - 1/2)/m from the top, so the model figures are deterministic; this is the
rank-frequency law n_(k) ~ (k - 1/2)^(-1/(alpha-1)) (alpha = 2 is Zipf's law).

Measured (labelled as a proxy in the report): on synthetic power-law data, in TensorFlow, with the
encoder of the paper's experiments reduced to an item-id embedding (m x d) followed by a dense
d x d layer (so c ~ d^2), the wall time of
  - the statistics: `privacy.accumulator.grouped_sums` over all rows plus Gaussian noise on every
    A_j, b_j (once per run);
  - one SSP2 epoch: item minibatches, loss `trainer.ssp.ssp_loss` (1/2 v^T A v - b^T v), one forward
    and backward pass per item;
  - one DP-SGD-style epoch over rows (not TF-Privacy; trainer/dpsgd.py is the real baseline): row
    minibatches, the encoder evaluated once per distinct item of the batch (the paper's Algorithm
    "Mini-batch DP-SGD"), per-example gradient norms computed in closed form for this two-layer
    encoder (fast clipping, as TF-Privacy's fast path does), clipped sum, Gaussian noise on every
    parameter.
Both epochs use plain SGD and hold their data in memory (no I/O), so what differs is the work the
two algorithms do per epoch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from bench import harness
from schemas.errors import UserError

NAME = "complexity"
PAPER = {"rows": 1_000_000, "items": 1_000}  # the paper's appendix figures
ALPHAS = (1.5, 2.0, 3.0)
RATIO_ALPHA = 2.0
EPOCHS = (1, 10, 100, 1000)
LINEAR_D = 32  # d for the c = d case (the ratio does not depend on d when c = d^2)
BATCHES = np.unique(np.logspace(0, 6, 61).round())  # batch sizes of the model figures, 1 to D
SSP_TIMED_EPOCHS = 5  # an SSP2 epoch takes milliseconds: average several


def power_law_frequencies(items: int, alpha: float) -> np.ndarray:
    """p_j, most frequent first: the upper quantiles 1 - (j - 1/2)/m of the density ~ x^(-alpha) on
    [1, inf), whose inverse survival function is q^(-1/(alpha-1)), normalised to sum 1."""
    if alpha <= 1:
        raise UserError(f"alpha must be > 1, got {alpha}")
    counts = ((np.arange(items) + 0.5) / items) ** (-1 / (alpha - 1))
    return counts / counts.sum()


def beta_items(frequencies: np.ndarray, rows: float, batch_size: float) -> np.ndarray:
    """beta_j = D/B (1 - (1 - p_j)^B): expected batches per epoch that contain item j."""
    return rows / batch_size * -np.expm1(batch_size * np.log1p(-np.asarray(frequencies, dtype=float)))


def cost_ratio(beta: float, rows: float, items: int, d: int, c: float, epochs: float) -> float:
    """Cost of SSP2 over cost of DP-SGD for e epochs, (D d^2 + e m (c + d^2)) / (c e beta)."""
    return (rows * d**2 + epochs * items * (c + d**2)) / (c * epochs * beta)


def visits_summary() -> dict:
    """beta/m at a few batch sizes, for every alpha, in the paper's setting."""
    rows, items = PAPER["rows"], PAPER["items"]
    return {
        alpha: {
            b: float(beta_items(power_law_frequencies(items, alpha), rows, b).sum() / items)
            for b in (1, 100, 1000, 10_000, rows)
        }
        for alpha in ALPHAS
    }


def plot_item_visits():
    """The paper's item-visits figure: item counts by rank (left), beta/m against batch size (right)."""
    rows, items = PAPER["rows"], PAPER["items"]
    fig, (counts_ax, visits_ax) = harness.new_figure(2)
    for alpha in ALPHAS:
        freq = power_law_frequencies(items, alpha)
        counts_ax.loglog(np.arange(1, items + 1), freq * rows, label=f"alpha = {alpha:g}")
        visits_ax.loglog(
            BATCHES, [beta_items(freq, rows, b).sum() / items for b in BATCHES], label=f"alpha = {alpha:g}"
        )
    harness.finish(
        counts_ax,
        f"Item counts, D = {rows:.0e}, m = {items}",
        "item rank, 1 = most frequent (rank)",
        "examples of the item (count)",
    )
    harness.finish(
        visits_ax, "Average visits per item per epoch, beta/m", "batch size B (examples)", "beta / m (batches per item)"
    )
    return fig


def plot_cost_ratio():
    """The paper's complexity figure: the cost ratio against batch size and epochs, c = d^2 and c = d."""
    rows, items = PAPER["rows"], PAPER["items"]
    freq = power_law_frequencies(items, RATIO_ALPHA)
    beta = np.array([beta_items(freq, rows, b).sum() for b in BATCHES])
    fig, axes = harness.new_figure(2)
    for ax, (case, c) in zip(axes, (("c = d^2", LINEAR_D**2), ("c = d", LINEAR_D)), strict=True):
        for epochs in EPOCHS:
            ax.loglog(BATCHES, cost_ratio(beta, rows, items, LINEAR_D, c, epochs), label=f"e = {epochs} epochs")
        ax.axhline(1.0, color="black", linewidth=1.5, label="equal cost")
        harness.finish(
            ax,
            f"SSP2 / DP-SGD cost, {case} (d = {LINEAR_D}, alpha = {RATIO_ALPHA:g})",
            "batch size B (examples)",
            "cost ratio SSP2 / DP-SGD (ratio)",
        )
    return fig


def measured_sizes(quick: bool) -> dict:
    """Sizes of the timed comparison; the quick ones take well under a minute with TF's start-up."""
    if quick:
        return {
            "rows": 200_000,
            "items": 2_000,
            "d": 32,
            "alpha": RATIO_ALPHA,
            "batch_sizes": [256, 1024],
            "item_batch": 256,
        }
    return {
        "rows": 1_000_000,
        "items": 10_000,
        "d": 32,
        "alpha": RATIO_ALPHA,
        "batch_sizes": [256, 1024, 4096],
        "item_batch": 1024,
    }


def synthetic_rows(rows: int, items: int, d: int, alpha: float, seed: int) -> dict:
    """Rows with power-law item counts (each item at least once), unit users, labels in [-1, 1]."""
    rng = np.random.default_rng(seed)
    counts = np.maximum(1, np.round(power_law_frequencies(items, alpha) * rows)).astype(np.int64)
    item = rng.permutation(np.repeat(np.arange(items), counts))
    u = rng.normal(size=(item.size, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    y = np.clip(rng.normal(size=item.size), -1.0, 1.0)
    return {"item": item, "u": u, "y": y, "counts": counts}


def time_epochs(params: dict) -> dict:
    """One timed cell: statistics, one SSP2 epoch, one DP-SGD-style epoch per batch size."""
    import tensorflow as tf

    from privacy.accumulator import augment, grouped_sums, unpack_upper
    from trainer.ssp import dense_product, ssp_loss

    tf.keras.utils.set_random_seed(params["seed"])
    m, d, noise, clip, lr = params["items"], params["d"], 1.0, 1.0, 1e-3
    data = synthetic_rows(params["rows"], m, d, params["alpha"], params["seed"])
    rng = np.random.default_rng(params["seed"])

    grouped_sums(
        data["item"][:1000], augment(data["u"][:1000], data["y"][:1000])
    )  # warm-up: first-call costs are not the statistics'
    start = time.perf_counter()
    _, a_upper, b = grouped_sums(data["item"], augment(data["u"], data["y"]))
    a_upper = a_upper + noise * rng.normal(size=a_upper.shape)
    b = b + noise * rng.normal(size=b.shape)
    stats_seconds = time.perf_counter() - start

    table = tf.Variable(tf.random.normal((m, d), stddev=d**-0.5))
    kernel = tf.Variable(tf.random.normal((d, d), stddev=d**-0.5))
    bias = tf.Variable(tf.zeros(d))
    variables = [table, kernel, bias]

    def encoder(positions):
        return tf.gather(table, positions) @ kernel + bias

    a_all = tf.constant(unpack_upper(a_upper, d) + np.eye(d), tf.float32)  # + ridge, as the trainer adds
    b_all = tf.constant(b, tf.float32)
    rows_item, rows_u, rows_y = (
        tf.constant(data["item"]),
        tf.constant(data["u"], tf.float32),
        tf.constant(data["y"], tf.float32),
    )

    @tf.function
    def ssp_step(positions):
        with tf.GradientTape() as tape:
            loss = ssp_loss(encoder, positions, dense_product(tf.gather(a_all, positions)), tf.gather(b_all, positions))
        for var, grad in zip(variables, tape.gradient(loss, variables), strict=True):
            if isinstance(grad, tf.IndexedSlices):  # the embedding's gradient stays sparse, as in the trainer
                var.scatter_sub(tf.IndexedSlices(lr * grad.values, grad.indices))
            else:
                var.assign_sub(lr * grad)

    @tf.function
    def dpsgd_step(rows):
        item, u, y = tf.gather(rows_item, rows), tf.gather(rows_u, rows), tf.gather(rows_y, rows)
        distinct, index = tf.unique(item)
        with tf.GradientTape() as tape:
            hidden = tf.gather(table, distinct)  # one forward/backward per distinct item of the batch
            v = tf.gather(hidden @ kernel + bias, index)
            residual = tf.reduce_sum(v * u, axis=1) - y
            grad_v = residual[:, None] * u  # d loss_i / d v_i
            # per-example gradient norm^2: kernel |h|^2 |g|^2, bias |g|^2, embedding row |g kernel^T|^2
            h = tf.gather(hidden, index)
            norm2 = tf.reduce_sum(grad_v**2, 1) * (tf.reduce_sum(h**2, 1) + 1.0) + tf.reduce_sum(
                (grad_v @ tf.transpose(kernel)) ** 2, 1
            )
            scale = tf.stop_gradient(tf.minimum(1.0, clip / tf.sqrt(norm2 + 1e-12)))
            loss = tf.reduce_sum(scale * 0.5 * residual**2)
        for var, grad in zip(variables, tape.gradient(loss, variables), strict=True):
            noisy = tf.convert_to_tensor(grad) + noise * clip * tf.random.normal(var.shape)
            var.assign_sub(lr * noisy / tf.cast(tf.size(rows), tf.float32))
        return tf.size(distinct)

    def ssp_epoch():
        order = rng.permutation(m)
        for s in range(0, m, params["item_batch"]):
            ssp_step(tf.constant(order[s : s + params["item_batch"]]))

    def dpsgd_epoch(batch):
        order = rng.permutation(data["item"].size)
        visits = 0
        for s in range(0, order.size - batch + 1, batch):  # the last partial batch is dropped
            visits += int(dpsgd_step(tf.constant(order[s : s + batch])))
        return visits

    out = {"stats_seconds": stats_seconds, "rows": int(data["item"].size), "max_item_rows": int(data["counts"].max())}
    ssp_epoch()  # trace
    start = time.perf_counter()
    for _ in range(SSP_TIMED_EPOCHS):
        ssp_epoch()
    out["ssp2_epoch_seconds"] = (time.perf_counter() - start) / SSP_TIMED_EPOCHS
    freq = data["counts"] / data["counts"].sum()
    out["dpsgd"] = {}
    for batch in params["batch_sizes"]:
        dpsgd_epoch(batch)  # trace
        start = time.perf_counter()
        visits = dpsgd_epoch(batch)
        out["dpsgd"][str(batch)] = {
            "epoch_seconds": time.perf_counter() - start,
            "item_visits": visits,
            "model_beta": float(beta_items(freq, data["item"].size, batch).sum()),
        }
    return out


def plot_measured(size: dict, cells: list[dict]):
    """Measured and modelled SSP2 / DP-SGD ratio against epochs, one curve per batch size."""
    epochs = np.logspace(0, 3, 13)
    fig, (ax,) = harness.new_figure(width=6.5)
    for batch in size["batch_sizes"]:
        ratios = [
            [
                (c["stats_seconds"] + e * c["ssp2_epoch_seconds"]) / (e * c["dpsgd"][str(batch)]["epoch_seconds"])
                for e in epochs
            ]
            for c in cells
        ]
        harness.mean_std_band(ax, epochs, ratios, f"measured, B = {batch}")
        beta = float(np.mean([c["dpsgd"][str(batch)]["model_beta"] for c in cells]))
        rows = cells[0]["rows"]
        ax.plot(
            epochs,
            [cost_ratio(beta, rows, size["items"], size["d"], size["d"] ** 2, e) for e in epochs],
            linestyle="--",
            label=f"model c = d^2, B = {batch}",
        )
    ax.axhline(1.0, color="black", linewidth=1.5, label="equal cost")
    ax.set_xscale("log")
    ax.set_yscale("log")
    harness.finish(
        ax,
        f"SSP2 / DP-SGD-proxy time, D = {cells[0]['rows']}, m = {size['items']}, d = {size['d']}",
        "epochs e (epochs)",
        "time ratio SSP2 / DP-SGD proxy (ratio)",
    )
    return fig


@harness.experiment(
    NAME, "cost model of SSP2 vs DP-SGD (beta_j, cost ratio for c = d^2 and c = d) and a measured ratio"
)
def run(ctx: harness.Context) -> harness.Section:
    size = measured_sizes(ctx.quick)
    cells = ctx.results.run(NAME, [{**size, "seed": seed} for seed in range(ctx.seeds)], time_epochs, ctx.progress)
    figures = {
        name: harness.save_figure(fig, ctx.out, f"complexity_{name}.png")
        for name, fig in (
            ("item_visits", plot_item_visits()),
            ("cost_ratio", plot_cost_ratio()),
            ("measured", plot_measured(size, cells)),
        )
    }
    return report(size, cells, figures)


def _mean_std(values) -> str:
    values = np.asarray(values, dtype=float)
    std = values.std(ddof=1) if values.size > 1 else 0.0
    return f"{values.mean():.3g} ± {std:.2g}"


def report(size: dict, cells: list[dict], figures: dict) -> harness.Section:
    """The section: the model's figures and values, then the measured proxy and how it was measured."""
    rows, items = PAPER["rows"], PAPER["items"]
    summary = visits_summary()
    section = harness.Section("Computational cost: SSP2 vs DP-SGD")
    section.text(
        "**Model** (paper, Proposition on complexity and Appendix eq. (app:ratio)). beta_j = D/B (1 - (1 - p_j)^B) is "
        "the expected "
        "number of batches of one epoch that contain item j (batches of B examples drawn with replacement, p_j = "
        "|Omega_j|/D); "
        "DP-SGD costs at least c e beta, SSP2 at most D d^2 + e m (c + d^2), so the ratio is "
        "(D d^2 + e m (c + d^2)) / (c e beta) = m/beta (1 + d^2/c + D d^2/(c e m)), plotted with the O() constant "
        "taken as 1. "
        f"As in the paper D = {rows:.0e}, m = {items}; item counts follow a power law with density ~ x^(-alpha), taken "
        "at its "
        "m quantiles (deterministic), i.e. rank-frequency ~ rank^(-1/(alpha-1))."
    )
    section.table(
        ["alpha", "beta/m at B=1", "B=100", "B=1000", "B=10^4", "B=D"],
        [[f"{a:g}"] + [f"{summary[a][b]:.3g}" for b in (1, 100, 1000, 10_000, rows)] for a in ALPHAS],
    )
    section.figure(
        figures["item_visits"],
        "Item counts (left) and average visits per item per epoch beta/m against batch size (right).",
    )
    freq = power_law_frequencies(items, RATIO_ALPHA)
    ratio_rows = []
    for batch in (100, 1000, 10_000):
        beta = beta_items(freq, rows, batch).sum()
        ratio_rows.append(
            [batch]
            + [
                f"{cost_ratio(beta, rows, items, LINEAR_D, c, e):.3g}"
                for c in (LINEAR_D**2, LINEAR_D)
                for e in (1, 100)
            ]
        )
    section.table(["B", "c=d^2, e=1", "c=d^2, e=100", "c=d, e=1", "c=d, e=100"], ratio_rows)
    section.figure(
        figures["cost_ratio"],
        f"Cost ratio SSP2 / DP-SGD against batch size and epochs (alpha = {RATIO_ALPHA:g}, d = {LINEAR_D}); below the "
        "black line SSP2 is cheaper.",
    )
    section.text(
        "With c = d^2 the ratio does not depend on d: (D + 2 e m) / (e beta). SSP2 is cheaper wherever beta/m is large "
        "(small "
        "batches) and the statistics' one-off cost D d^2 is spread over enough epochs; with c = d the d^2 work per "
        "item "
        "dominates and SSP2 is cheaper only for small batches and many epochs, as the paper says."
    )

    first = cells[0]
    section.text(
        f"**Measured proxy** ({len(cells)} repeats, each on fresh synthetic data; CPU, TensorFlow eager loop over "
        "`tf.function` steps). Data: D = "
        f"{first['rows']} rows, m = {size['items']} items with power-law counts (alpha = {size['alpha']:g}, largest "
        "item "
        f"{first['max_item_rows']} rows), d = {size['d']}. Encoder: item-id embedding (m x d) then a dense d x d "
        "layer, so c ~ d^2. "
        "Timed: the statistics once (`privacy.accumulator.grouped_sums` over all rows + Gaussian noise on every A_j, "
        "b_j; "
        "PSD projection not included); one SSP2 epoch (item batches of "
        f"{size['item_batch']}, loss `trainer.ssp.ssp_loss`); one DP-SGD-style epoch over rows per batch size B: "
        "distinct items of "
        "the batch encoded once, per-example gradient norms in closed form for this encoder (fast clipping), clipped "
        "sum, "
        "Gaussian noise on every parameter (the dense noise on the m x d table is a real DP-SGD cost the model does "
        "not count). "
        "Both use plain SGD on in-memory data, after one untimed epoch that traces the graphs. This is a proxy written "
        "here, "
        "not TF-Privacy and not trainer/dpsgd.py."
    )
    table = []
    ssp_steps = math.ceil(size["items"] / size["item_batch"])
    for batch in size["batch_sizes"]:
        key = str(batch)
        per_epoch = [c["ssp2_epoch_seconds"] / c["dpsgd"][key]["epoch_seconds"] for c in cells]
        with_stats = [
            (c["stats_seconds"] + 10 * c["ssp2_epoch_seconds"]) / (10 * c["dpsgd"][key]["epoch_seconds"]) for c in cells
        ]
        beta = float(np.mean([c["dpsgd"][key]["model_beta"] for c in cells]))
        visits = float(np.mean([c["dpsgd"][key]["item_visits"] for c in cells]))
        model = cost_ratio(beta, first["rows"], size["items"], size["d"], size["d"] ** 2, 10)
        table.append(
            [
                batch,
                _mean_std([c["dpsgd"][key]["epoch_seconds"] for c in cells]),
                _mean_std([1e3 * c["dpsgd"][key]["epoch_seconds"] / (c["rows"] // batch) for c in cells]),
                _mean_std([c["ssp2_epoch_seconds"] for c in cells]),
                _mean_std(per_epoch),
                f"{2 * size['items'] / beta:.3g}",
                _mean_std(with_stats),
                f"{model:.3g}",
                f"{visits / size['items']:.4g}",
                f"{beta / size['items']:.4g}",
            ]
        )
    section.table(
        [
            "B",
            "DP-SGD proxy epoch (s)",
            "DP-SGD ms/step",
            "SSP2 epoch (s)",
            "SSP2/DP-SGD per epoch",
            "model per epoch, 2m/beta",
            "SSP2/DP-SGD over 10 epochs incl. stats",
            "model, 10 epochs",
            "measured visits/m per epoch",
            "model beta/m",
        ],
        table,
    )
    section.text(
        f"Statistics: {_mean_std([c['stats_seconds'] for c in cells])} s once per run. Model columns use c = d^2 and "
        "the data's "
        "own beta; 'per epoch' leaves out the statistics (the e -> infinity limit m/beta (1 + d^2/c)). "
        f"An SSP2 epoch is {ssp_steps} steps ({_mean_std([1e3 * c['ssp2_epoch_seconds'] / ssp_steps for c in cells])} "
        "ms each) "
        "and a DP-SGD epoch D/B steps (ms per step in the table): at these sizes a step's fixed cost (a `tf.function` "
        "call "
        "from Python) is part of what is measured, and the model does not count it. "
        "Measured visits count the distinct items of each batch of a shuffled epoch (sampling without replacement, "
        "last partial batch dropped); the model's beta assumes sampling with replacement."
    )
    section.figure(
        figures["measured"],
        "Measured SSP2 / DP-SGD-proxy time ratio against epochs (statistics amortised over e epochs), mean ± std over "
        "repeats, with the model's ratio (dashed).",
    )
    return section
