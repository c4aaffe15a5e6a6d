"""`ssp audit`: an empirical privacy audit of the releases `ssp train` makes by default, with canary users.

What is audited is enumerated from the runs' own plans: for each product (ratings: `ssp train`'s
defaults; ranking: `--protocol recall`'s, AM-SSP starting from the item Gram; the DP per-item mean:
`--item-update item-mean`; federated: `--engine federated --no-biases`; AM-DPSGD: `--item-update
dpsgd`; the DP item Gram: `--protocol recall --item-update gram --encoder id`; ranking's statistics
alone: `--protocol recall --item-gram-share 0`) the audit makes `TrainConfig.create(epsilon=..., **product)` and audits
every release group of `config.privacy(units).multipliers()` (counts, mean, gram, item_gram, stats,
dpsgd) with that config's own statistics settings (`config.settings()`: its d, clip_u, clip_y,
weight exponent, bias coordinate k, confidences), so a default that changes is audited as it is. A
release group the audit has no auditor for is refused (exit 2), never skipped.

Each product gets a synthetic data set: background users (5 ratings at the bottom of the range on
shared items) and m canary users, each included by an independent fair coin. A canary rates K items
of its own at the top of the range (its centred label beyond clip_y), and its embedding lies beyond
the clip (CANARY_NORM x clip_u; a user bias that pushes its label further out), so a missing clip, a
missing label clip or unnormalised weights raise its contribution. The releases go through the
product's own code: DP counts, DP mean, the users' Gram matrices and the statistics of every outer
step on the Spark stats job (or `--engine local`: the same item tasks in this process), into one
ledger and seed file as a run makes them; the seed-file copy (ratings) copies the run folder before
its first stats release and makes that release in the copy without the canaries.

The federated product's statistics are the federated engine's round (its `release_stats`, the
FederatedJob built from the config as `ssp train` builds it): every user a simulated client that
solves its own embedding from its rows and the broadcast item embeddings (a canary's items: a unit
vector, so its solution lies far beyond the clip) and adds its Skellam share under secure
aggregation. Its round simulates every client, so it has its own, smaller size (one item per canary).
AM-DPSGD's training is the item-update stage of `ssp train` itself (pipelines.training.item_update)
on a run folder as prepare leaves it, every outer step with its DP-SGD release in the run's ledger;
a canary's score is how far its items' published embeddings moved along its row in the step.
The DP item Gram is the product's dp_item_gram (as prepare makes it, before the steps; its sums on
the audit's engine) over a list of items the audit chooses without the data, in place of the top
items by DP count: the background items and ITEM_GRAM_ITEMS items of each of the first
`Size.item_gram` canaries (its release is dense over its items). An included canary's row, 1 / sqrt(2)
on each, adds 1 / 2 to its own 2 x 2 block, which no other user touches; unscaled, it would add 1.

Scores: per canary, the Gaussian log-likelihood ratio of "in" against "out" on its own items'
coordinates, the expected contribution computed here from the released counts (independently of
the product's kernel: weights, clips, bias coordinate), with the noise scale the claim implies.
The DP mean and the Gram matrix are shared by every user (no coordinate of a canary's own): they are
scored by T repeated releases (a multi-run audit: each release one canary in or out by a coin, into
a throw-away ledger at the plan's multiplier), the score the released mean, or the Gram
log-likelihood ratio.

Bounds, and what each assumes:
- one-run: Steinke, Nasr and Jagielski (2023, "Privacy auditing with one (1) training run",
  Theorem 5.2 with delta): guess "in" for the k top scores and "out" for the k bottom ones; if the
  releases were (eps, delta)-DP, v correct of r guesses has p-value P[Binomial(r, q) >= v] +
  2 m delta alpha, q = e^eps / (1 + e^eps), alpha = max_i P[v > Binomial(r, q) >= v - i] / i. It
  assumes only that the canaries are included by independent coins (true by construction); it is
  far below the claim for Gaussian noise at delta 1e-5, and its 2 m delta term caps it whatever the
  defect (every guess right: about 2.4-2.9 with 300-5,000 canaries and one product's tests, less
  as more tests share the confidence; docs/privacy.md), so a row it alone decides can FAIL only
  for a claim below that cap (AM-DPSGD's, at epsilon 4, is not);
- Gaussian: under Gaussian noise the scores of included and excluded canaries are two normals with
  one variance, and the standardized difference of their means is the mechanism's mu (mu-GDP); a
  one-sided lower confidence bound on it (normal approximation) gives epsilon(mu, delta) by the
  ledger's accountant. It ASSUMES Gaussian scores: true for the statistics (a canary's items are its
  own, the noise Gaussian on a fine grid; the federated round's Skellam noise too: a Skellam of
  variance s^2 in fixed-point steps has every even cumulant s^2, so its excess kurtosis is 1 / s^2,
  with s over 2^16 steps, and its variance is at least the planned Gaussian's; the item Gram: a
  canary's own entries, Gaussian noise, nothing projected), NOT for the counts
  (floored at 1), the mean (a clipped ratio), the Gram (projected onto the PSD cone) or DP-SGD (a
  Poisson-sampled mixture). Those rows enter the verdict by their one-run bound only; their
  Gaussian column is shown, marked "(not in verdict)".
Every bound in the verdict (each row's one or two tests, every k of the one-run test) holds together
with the confidence given (Bonferroni): on a correct product a FAIL (exit 1) happens with
probability at most 1 - confidence (default 0.99: at most 1% of audits), the one-run bounds without
assumption, the Gaussian ones under Gaussian scores.

Not audited (named in the table's notes): what a federated round's server sees beyond the noised
sum (secure aggregation's masks are tested in tests/privacy), and plans off the defaults (--loss
logistic, --resamples, a federated round with biases, which it does not have yet).

`--plant` is a self-test of the audit's power (bench/audit_plants.py): a known defect patched into
the product for the audit's duration only, in this process and, through a sitecustomize hook on the
PYTHONPATH of the JVM the audit starts, in Spark's Python workers (checked by asking a worker; with
a Spark session already running, `--plant` needs `--engine local`); the federated round and DP-SGD
run in this process (Beam's DirectRunner, TensorFlow), their plants with them; the audit must then
exit 1.

Privacy: the audit's data are synthetic, its run folders and budget registry ($SSP_BUDGET_ACCOUNTS,
set to a folder of the audit's own while it runs) temporary; it publishes nothing but the table. A
normal run is never affected by --plant.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from scipy import special, stats

from pipelines.base import logs
from privacy import lifetime_budget
from schemas.errors import UserError

FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # the one-run test's guesses: the top and bottom k = f m / 2 scores
EXIT_EXCEEDED = 1
LABELS = (1.0, 5.0)  # the rating range; canaries rate at the top
CANARY_USERS = 1_000_000  # canary c is user CANARY_USERS + c, its items CANARY_ITEMS + c K + k
CANARY_ITEMS = 1_000_000


CANARY_NORM = 10.0  # a canary's embedding norm, in units of clip_u: beyond the clip
CANARY_BIAS = -1.0  # a canary's user bias (biased models): its label less it is further beyond clip_y
MEAN_RATINGS = 50  # a mean canary's ratings: the mean's per-user cap (pipelines.releases.mean.DEFAULT_USER_CAP)
PRODUCTS = {  # `ssp train`'s defaults per protocol, the DP per-item mean, federated, AM-DPSGD, the item Gram
    "ratings": {},
    "ranking": {"protocol": "recall"},
    "item-mean": {"item_update": "item-mean", "encoder": "id"},
    "federated": {"engine": "federated", "biases": False},  # the round has no biases yet
    "dpsgd": {"item_update": "dpsgd"},
    "gram": {"protocol": "recall", "item_update": "gram", "encoder": "id"},
    "ranking-statistics": {"protocol": "recall", "item_gram_share": 0.0},  # no item Gram start (federated's plan)
}
ITEM_GRAM_ITEMS = 2  # a covered canary's items in the item Gram: x = 1 / sqrt(2) on each, so an unscaled row doubles it


@dataclass(frozen=True)
class Size:
    """The audit's data: canaries, their items each (K), background items; T, the repeated releases
    of the shared releases (mean, Gram). There are as many background users as canaries, each with 5
    ratings at the bottom of the range, so that the DP mean stays low and a canary's centred label
    is beyond the label clip. The federated product has `federated` canaries of one item each: its
    round simulates every client, whose vector spans the catalog; its background users rate
    MEAN_RATINGS items each, so that its few users' DP mean stays far below the canaries' label
    (their embeddings, solved from it, must lie beyond the clip). The item Gram covers the first
    `item_gram` canaries (ITEM_GRAM_ITEMS items each): its release is dense over its items."""

    canaries: int
    items_per_canary: int = 4
    background_items: int = 50
    background_ratings: int = 5
    trials: int = 400
    federated: int = 1000
    item_gram: int = 2000

    def of(self, config) -> Size:
        """The size of `config`'s product."""
        return (
            dataclasses.replace(
                self,
                canaries=self.federated,
                items_per_canary=1,
                background_items=max(self.background_items, MEAN_RATINGS),
                background_ratings=MEAN_RATINGS,
            )
            if config.engine == "federated"
            else self
        )

    def item_gram_cover(self) -> tuple[int, int]:
        """(canaries, items of each) in the item Gram."""
        return min(self.item_gram, self.canaries), min(ITEM_GRAM_ITEMS, self.items_per_canary)


QUICK = Size(canaries=300, background_items=20, trials=60, federated=100, item_gram=300)
FULL = Size(canaries=5000, trials=400, federated=1000, item_gram=2000)


# ---------------------------------------------------------------------------------------------
# The bounds


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of v or more correct of r guesses on m canaries if the releases were (epsilon, delta)-DP
    (Steinke et al. 2023, Theorem 5.2): P[Bin(r, q) >= v] + 2 m delta max_i P[v > Bin(r, q) >= v - i] / i."""
    q = special.expit(epsilon)
    tail = float(stats.binom.sf(v - 1, r, q))
    if v == 0 or delta == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v - i] for i = 1..v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * alpha)


def one_run_epsilon(m: int, r: int, v: int, delta: float, failure: float) -> float:
    """The largest epsilon whose p-value for (m, r, v) is at most `failure` (0 if none is)."""
    if one_run_p_value(m, r, v, 0.0, delta) > failure:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(m, r, v, high, delta) <= failure:
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if one_run_p_value(m, r, v, middle, delta) <= failure else (low, middle)
    return low


def one_run_bound(scores: np.ndarray, member: np.ndarray, delta: float, failure: float) -> float:
    """The one-run bound over the guesses of FRACTIONS (each at failure / len(FRACTIONS))."""
    m = scores.size
    order = np.argsort(scores, kind="stable")
    best = 0.0
    for fraction in FRACTIONS:
        k = max(1, int(round(fraction * m / 2)))
        correct = int(member[order[-k:]].sum() + (~member[order[:k]]).sum())
        best = max(best, one_run_epsilon(m, 2 * k, correct, delta, failure / len(FRACTIONS)))
    return best


def gaussian_mu_bound(scores: np.ndarray, member: np.ndarray, failure: float) -> float:
    """A lower confidence bound (1 - failure) on mu, the standardized difference of the mean scores
    of included and excluded canaries (the mu of mu-GDP when the scores are Gaussian)."""
    inside, outside = scores[member], scores[~member]
    n1, n0 = inside.size, outside.size
    if n1 < 2 or n0 < 2:
        return 0.0
    pooled = math.sqrt(((n1 - 1) * inside.var(ddof=1) + (n0 - 1) * outside.var(ddof=1)) / (n1 + n0 - 2))
    difference = float(inside.mean() - outside.mean())
    if pooled == 0:
        return math.inf if difference > 0 else 0.0
    mu = difference / pooled
    error = math.sqrt(1 / n1 + 1 / n0 + mu**2 / (2 * (n1 + n0 - 2)))
    return max(0.0, mu - float(stats.norm.isf(failure)) * error)


def gdp_epsilon(mu: float, delta: float, accountant: str) -> float:
    """Epsilon at `delta` of a Gaussian mechanism with mu = sensitivity / noise std (the ledger's accountant)."""
    from privacy import accounting

    if mu <= 0:
        return 0.0
    if not math.isfinite(mu) or mu > 1e3:
        return math.inf
    return accounting.epsilon_of([accounting.gaussian_event(1 / mu)], delta, accountant)


def llr(released: np.ndarray, expected: np.ndarray, std: float) -> np.ndarray:
    """Each canary's Gaussian log-likelihood ratio of "in" (mean `expected`) against "out" (mean 0)
    for its released coordinates (one row per canary, the background's part already subtracted)."""
    released = released.reshape(released.shape[0], -1)
    expected = expected.reshape(expected.shape[0], -1)
    return ((released * expected).sum(axis=1) - 0.5 * (expected**2).sum(axis=1)) / std**2


# ---------------------------------------------------------------------------------------------
# The data and the releases


@dataclass
class Tables:
    """Paths of one data set's tables: interactions, items, user embeddings per step."""

    interactions: str
    items: str
    embeddings: list[str]


def embedding_coordinates(settings) -> int:
    """How many embedding coordinates a user vector has (the rest: [1, b_u] with biases)."""
    return settings.user_dim - 2 if settings.bias else settings.user_dim


def canary_vector(step: int, settings, clip_u: float) -> np.ndarray:
    """A canary's user vector at `step`: CANARY_NORM x clip_u along axis 0 at odd steps and 1 at even
    ones (none without embedding coordinates); with biases [u, 1, CANARY_BIAS]."""
    n = embedding_coordinates(settings)
    u = np.zeros(n)
    if n:
        u[(step - 1) % min(2, n)] = CANARY_NORM * clip_u
    return np.r_[u, 1.0, CANARY_BIAS] if settings.bias else u


def write_data(folder: str, size: Size, member: np.ndarray, *, settings, labels, steps: int, seed: int) -> Tables:
    """The background users (drawn from `seed`) and the included canaries, written as the run's
    tables; the catalog holds every canary's items, included or not. `labels`: (background, canary)."""
    from schemas import storage
    from schemas.tables import INTERACTIONS, USER_EMBEDDINGS, items_schema

    k = size.items_per_canary
    rng = np.random.default_rng(seed)
    users, items, values = [], [], []
    for user in range(1, size.canaries + 1):
        rated = rng.choice(
            np.arange(1, size.background_items + 1),
            size=min(size.background_ratings, size.background_items),
            replace=False,
        )
        users += [user] * rated.size
        items += rated.tolist()
        values += [labels[0]] * rated.size
    canaries = np.flatnonzero(member)
    users += np.repeat(CANARY_USERS + canaries, k).tolist()
    items += (CANARY_ITEMS + canaries[:, None] * k + np.arange(k)).reshape(-1).tolist()
    values += [labels[1]] * (canaries.size * k)
    storage.write_table(
        pa.table(
            {"user_id": users, "item_id": items, "label": values, "timestamp": [0] * len(users)}, schema=INTERACTIONS
        ),
        storage.join(folder, "interactions.parquet"),
    )
    catalog = np.r_[np.arange(1, size.background_items + 1), CANARY_ITEMS + np.arange(size.canaries * k)]
    genres = [[f"genre {i % 3}"] if i < CANARY_ITEMS else [] for i in catalog]  # a features encoder's; canaries: none
    storage.write_table(
        pa.table(
            {"item_id": catalog, "title": [f"item {i}" for i in catalog], "genres": genres},
            schema=items_schema({"genres": "multivalent"}),
        ),
        storage.join(folder, "items.parquet"),
    )
    background = background_vectors(rng, size.canaries, settings)
    embeddings = []
    for step in range(1, steps + 1):
        vectors = np.vstack([background, np.tile(canary_vector(step, settings, settings.clip_u), (canaries.size, 1))])
        ids = np.r_[np.arange(1, size.canaries + 1), CANARY_USERS + canaries]
        path = storage.join(folder, f"embeddings-{step}.parquet")
        storage.write_table(
            pa.table({"user_id": ids, "embedding": [list(v) for v in vectors]}, schema=USER_EMBEDDINGS), path
        )
        embeddings.append(path)
    return Tables(storage.join(folder, "interactions.parquet"), storage.join(folder, "items.parquet"), embeddings)


def background_vectors(rng: np.random.Generator, n: int, settings) -> np.ndarray:
    """Background users' vectors: normal embedding coordinates; with biases [u, 1, 0]."""
    u = rng.normal(size=(n, embedding_coordinates(settings)))
    return np.hstack([u, np.ones((n, 1)), np.zeros((n, 1))]) if settings.bias else u


def row_clip(settings) -> float:
    """rho, the norm bound of a statistics row, computed here: clip_u, or with the bias coordinate
    c = k clip_u sqrt(clip_u^2 + c^2) (c alone without embedding coordinates)."""
    if not settings.bias:
        return settings.clip_u
    c = settings.bias * settings.clip_u
    return math.hypot(settings.clip_u if embedding_coordinates(settings) else 0.0, c)


def canary_row(step: int, settings) -> np.ndarray:
    """A canary's statistics row as a correct product forms it: [Clip(u), c] or Clip(u)."""
    vector = canary_vector(step, settings, settings.clip_u)
    u = vector[:-2] if settings.bias else vector
    norm = float(np.linalg.norm(u))
    u = u * min(1.0, settings.clip_u / norm) if norm > 0 else u
    return np.r_[u, settings.bias * settings.clip_u] if settings.bias else u


def canary_contributions(
    dp_counts: np.ndarray, label: float, size: Size, settings, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """What each canary adds to its items' packed A and b at `step` when included, computed here
    (not by the product's kernel) from its items' released counts `dp_counts` (m, K) and its
    label: weights w_j = wbar n_j^e / sqrt(sum n^2e), A_j += w_j x x^T, b_j += w_j Clip(y - b_u) x."""
    from privacy.accumulator import pack_upper

    scales = np.asarray(dp_counts, dtype=np.float64) ** settings.weight_exponent
    weights = settings.wbar * scales / np.sqrt((scales**2).sum(axis=1, keepdims=True))
    x = canary_row(step, settings)
    y = float(np.clip(label - (CANARY_BIAS if settings.bias else 0.0), -settings.clip_y, settings.clip_y))
    a = weights[:, :, None] * pack_upper(np.outer(x, x))[None, None, :]
    b = weights[:, :, None] * (y * x)[None, None, :]
    return a, b


def read_canary_stats(path: str, size: Size) -> tuple[np.ndarray, np.ndarray]:
    """(packed A, b) of every canary's items: arrays (m, K, d(d+1)/2) and (m, K, d)."""
    from schemas import storage

    table = storage.read_table(path).sort_by("item_id")
    ids = table["item_id"].to_numpy()
    wanted = CANARY_ITEMS + np.arange(size.canaries * size.items_per_canary)
    at = np.searchsorted(ids, wanted)
    a = np.array(table["a_upper"].to_pylist())[at]
    b = np.array(table["b"].to_pylist())[at]
    return a.reshape(size.canaries, size.items_per_canary, -1), b.reshape(size.canaries, size.items_per_canary, -1)


@dataclass
class Row:
    """One line of the table. `gaussian_in_verdict`: whether the scores are Gaussian under the claim
    (else the Gaussian bound is shown but only the one-run bound decides)."""

    release: str
    claimed: float
    one_run: float
    gaussian: float
    seconds: float
    gaussian_in_verdict: bool = True
    canaries: int = 0

    @property
    def bound(self) -> float:
        return max(self.one_run, self.gaussian) if self.gaussian_in_verdict else self.one_run

    @property
    def exceeded(self) -> bool:
        return self.bound > self.claimed * (1 + 1e-9)


@dataclass
class Scored:
    """A row before its bounds: scores, membership, claim, whether its scores are Gaussian."""

    scores: np.ndarray
    member: np.ndarray
    claimed: float
    seconds: float
    gaussian: bool = True


def release_stats(engine, job) -> None:
    """A stats release on the audit's engine: the Spark job on the session, or the local engine."""
    from pipelines.engines import spark_stats

    if engine == "local" or engine is None:
        from pipelines.engines.local import LocalEngine

        LocalEngine().release_stats(job)
    else:
        spark_stats.run(job, engine)


def federated_release(config, job, rng: np.random.Generator, round_secret: bytes | None) -> None:
    """A step's statistics released by the federated engine's round, as `ssp train --engine federated`
    makes it (pipelines.training.stats_stage: the engine's release_stats, its FederatedJob from the
    config): every user a client that solves its embedding from its own rows (the centred rows) and
    the broadcast item embeddings, normal vectors for the background items and s e_axis (canary_vector's
    axis, s = sqrt(lambda_u): the scale that makes the solution longest) for a canary's items, so that
    its solution y s / (s^2 + lambda_u) e_axis = y / (2 sqrt(lambda_u)) e_axis (no gravity) lies beyond
    the clip, where canary_row puts it. `round_secret`: the simulated devices' root secret (None:
    fresh, as a run draws it)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipelines.engines import federated
    from pipelines.engines.engine import engine_of
    from schemas import storage
    from schemas.tables import ITEM_EMBEDDINGS

    rows = storage.read_table(job.interactions, columns=["user_id", "label"])
    canaries = rows["label"].to_numpy()[rows["user_id"].to_numpy() >= CANARY_USERS]
    scale = math.sqrt(config.lambda_u) if config.lambda_u > 0 else 1.0
    longest = scale / (scale**2 + config.lambda_u)  # the canary's solution per unit of its centred label
    if config.gravity or (canaries.size and canaries.min() * longest <= job.settings.clip_u):
        raise RuntimeError(
            f"the federated canaries' embeddings would not lie beyond the clip on their axis (smallest centred label "
            f"{canaries.min():.4g}, gravity {config.gravity:g}, clip_u {job.settings.clip_u:g})"
        )
    items = storage.read_table(job.items, columns=["item_id"])["item_id"].to_numpy()
    axis = (job.step - 1) % min(2, job.settings.dim)
    vectors = rng.normal(size=(items.size, job.settings.dim))
    vectors[items >= CANARY_ITEMS] = scale * np.eye(job.settings.dim)[axis]
    broadcast = storage.join(job.out + "-broadcast", "item_embeddings.parquet")
    storage.write_table(
        pa.table({"item_id": items, "embedding": [list(v) for v in vectors]}, schema=ITEM_EMBEDDINGS), broadcast
    )
    run = job.ledger_path.rsplit("/", 1)[0]

    def rounds(stats):
        return federated.FederatedJob(
            stats,
            stats.interactions,
            broadcast,
            config.lambda_u,
            config.gravity,
            config.federated_dropout,
            config.federated_max_dropout,
            round_secret=round_secret,
            scratch=storage.join(run, "private", "federated"),
            server=config.federated_server,
        )

    in_process = PipelineOptions([])  # the DirectRunner, in this process (where --plant is), whatever the environment
    with engine_of(
        "federated", scratch=storage.join(run, "private", "beam"), beam_options=in_process, rounds=rounds
    ) as engine:
        engine.release_stats(job)


def dpsgd_training(config, run_path: str, tables: Tables, rows: str, *, units: int, mean: float) -> dict[str, float]:
    """AM-DPSGD's item update of every outer step, as `ssp train --item-update dpsgd` runs it: the run
    folder prepare leaves (manifest with the DP number of users and the DP-SGD multiplier planned
    over it, the centred rows, the initial encoder of the public features), each step's user
    embeddings, then the item-update stage of each step (pipelines.training.item_update: DP-SGD on
    the rows, its release in the run's ledger, the step's item embeddings written). Returns
    {"dpsgd-s": seconds}."""
    from pipelines.training.item_update import item_update
    from pipelines.training.model import build_encoder, item_embeddings_table, normalise_embeddings, zero_item_biases
    from pipelines.training.run_dir import Run
    from schemas import storage
    from trainer import encoder as encoders

    run = Run(run_path)
    _, model = build_encoder(config, storage.read_table(tables.items))
    zero_item_biases(model, config)
    normalise_embeddings(model, config)
    storage.write_table(item_embeddings_table(model, config), run.item_embeddings(0))
    encoders.write_checkpoint(model, run.checkpoint(0))
    storage.write_table(storage.read_table(rows), run.centred)
    for step, path in enumerate(tables.embeddings, start=1):
        storage.write_table(storage.read_table(path), run.user_embeddings(step))
    prepared = {
        "items": tables.items,
        "mean": mean,
        "rating_range": list(LABELS),
        "units": units,
        "dpsgd_multiplier": config.privacy(units).multipliers()["dpsgd"],
    }
    flags = {name: value for name, value in config.flags().items() if name != "out"}
    run.write_manifest({"config": flags, "prepared": prepared, "steps_done": []})
    seconds = {}
    for step in range(1, config.outer_steps + 1):
        started = time.perf_counter()
        item_update(run, step, progress=False)
        seconds[f"dpsgd-{step}"] = time.perf_counter() - started
    return seconds


def dpsgd_scores(run_path: str, size: Size, config, step: int) -> np.ndarray:
    """Each canary's score at outer step `step`: how far its items' encoder outputs [v, b] moved along
    its row x = [Clip(u), c] in the step (the run's published item embeddings [v, c b, 1] of steps
    s - 1 and s), summed over its K items. An included canary's clipped gradient pushes each of them
    along x (its label, clipped, is above any prediction); an excluded one's items have no rows."""
    from pipelines.training.run_dir import Run
    from schemas import storage

    settings = config.settings()
    wanted = CANARY_ITEMS + np.arange(size.canaries * size.items_per_canary)

    def outputs(path):
        table = storage.read_table(path).sort_by("item_id")
        vectors = np.array(table["embedding"].to_pylist())[np.searchsorted(table["item_id"].to_numpy(), wanted)]
        if config.biases:  # [v, c b, 1] -> [v, b]
            vectors = np.hstack([vectors[:, :-2], vectors[:, -2:-1] / settings.bias_scale])
        return vectors.reshape(size.canaries, size.items_per_canary, -1)

    run = Run(run_path)
    moved = outputs(run.item_embeddings(step)) - outputs(run.item_embeddings(step - 1))
    return (moved @ canary_row(step, settings)).sum(axis=1)


def item_gram_items(size: Size) -> np.ndarray:
    """The item Gram's items, chosen without looking at the data (as the product's top items by DP
    count are chosen from a release): the background items and the first ITEM_GRAM_ITEMS items of
    each covered canary, included or not."""
    covered, k = size.item_gram_cover()
    own = CANARY_ITEMS + np.arange(covered)[:, None] * size.items_per_canary + np.arange(k)
    return np.r_[np.arange(1, size.background_items + 1), own.reshape(-1)]


def item_gram_release(engine, interactions: str, items: np.ndarray, out: str, ledger_path: str, name: str) -> None:
    """The product's dp_item_gram as release `name` (the item Gram or its second part) into the
    run's ledger and seed file, its exact sums on the audit's engine: the Spark engine on the session
    (its item_gram_sums in Spark's Python workers), or the local one."""
    from pipelines.engines.local import LocalEngine
    from pipelines.engines.prepare_spark import SparkEngine
    from pipelines.releases import release
    from pipelines.releases.item_gram import dp_item_gram
    from privacy.ledger import Ledger

    rows = LocalEngine() if engine == "local" or engine is None else SparkEngine(engine)
    seeds = release.open_seed_file(None, ledger_path)
    dp_item_gram(interactions, items, out, Ledger.open(ledger_path), seeds, engine=rows, name=name)


def item_gram_scores(path: str, size: Size, std: float) -> np.ndarray:
    """Each covered canary's Gaussian log-likelihood ratio on its own entries of the released item
    Gram: its k items' upper block, where an included canary's row x = 1 / sqrt(k) on each adds
    x x^T = 1 / k (computed here, not by the product's sums) and no other user adds anything."""
    from schemas import storage

    table = storage.read_table(path)  # as item_gram.read_item_gram reads it, without a Python float per entry
    items = table["item_id"].to_numpy()
    gram = table["row"].combine_chunks().flatten().to_numpy().reshape(items.size, items.size)
    covered, k = size.item_gram_cover()
    own = CANARY_ITEMS + np.arange(covered)[:, None] * size.items_per_canary + np.arange(k)
    at = np.searchsorted(items, own)
    upper, right = np.triu_indices(k)
    released = gram[at[:, upper], at[:, right]]
    return llr(released, np.full(released.shape, 1.0 / k), std)


AUDITED_GROUPS = ("counts", "mean", "gram", "item_gram", "item_gram_more", "stats", "dpsgd")
ITEM_GRAM_PARTS = {"item_gram": "item gram", "item_gram_more": "second item gram"}


def audit_product(
    name: str,
    config,
    size: Size,
    *,
    engine,
    work: str,
    rng: np.random.Generator,
    seed: int | None,
    copy: bool,
) -> dict[str, Scored]:
    """Make one product's releases with the canaries and score them: {row name: Scored}."""
    from pipelines.releases import release
    from pipelines.releases.counts import dp_counts, dp_units
    from pipelines.releases.gram import dp_gram
    from pipelines.releases.mean import centred, dp_mean
    from pipelines.releases.stats_job import StatsJob
    from privacy import accounting
    from privacy.ledger import Ledger
    from privacy.seeds import SeedFile
    from schemas import storage

    privacy = config.privacy()
    settings = config.settings()
    multipliers = config.privacy(2 * size.canaries).multipliers()  # its groups (AM-DPSGD's, planned over the users)
    unaudited = sorted(set(multipliers) - set(AUDITED_GROUPS))
    if unaudited:
        raise UserError(
            f"ssp audit has no auditor for the release group(s) {unaudited} of the {name} plan; nothing is "
            "certified for them (add one to bench/audit.py)"
        )
    ratings = config.protocol == "rmse"
    labels = LABELS if ratings else (1.0, 1.0)
    steps = config.outer_steps
    member = rng.random(size.canaries) < 0.5
    folder = storage.join(work, name)
    run, twin = storage.join(folder, "run"), storage.join(folder, "copy")
    ledger_path = storage.join(run, "ledger.parquet")
    if seed is not None:  # a fixed test seed: the whole audit reproduces
        SeedFile.create(release.default_seed_path(ledger_path), np.random.default_rng([seed, len(name)]).bytes(32))
    background = int(rng.integers(2**63))
    logs.log(
        f"audit {name}: {size.canaries} canaries ({int(member.sum())} included), {size.items_per_canary} items each; "
        f"plan {sorted(multipliers)}, {steps} outer step(s), d {settings.dim}, k {settings.bias:g}"
    )
    tables = write_data(
        storage.join(folder, "data"), size, member, settings=settings, labels=labels, steps=steps, seed=background
    )
    from pipelines.engines.local import LocalEngine

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    dp_counts(
        tables.interactions,
        tables.items,
        storage.join(run, "counts"),
        privacy,
        "user",
        config.max_items_per_user,
        ledger_path,
        engine=LocalEngine(),
    )
    seconds["counts"] = time.perf_counter() - started
    counts = storage.join(run, "counts", "counts.parquet")
    units = dp_units(counts)  # the DP number of users, over which prepare plans AM-DPSGD's sampling
    dp = 0.0
    if "mean" in multipliers:
        dp = dp_mean(
            tables.interactions,
            Ledger.open(ledger_path),
            release.open_seed_file(None, ledger_path),
            LABELS,
            "user",
            engine=LocalEngine(),
        )["mean"]
    rows = storage.join(folder, "data", "stats-rows.parquet")
    storage.write_table(centred(storage.read_table(tables.interactions), dp, config.protocol, None), rows)
    for part in ITEM_GRAM_PARTS:  # made in prepare, before the steps (the second part as a second Gram release)
        if part in multipliers:
            started = time.perf_counter()
            item_gram_release(engine, rows, item_gram_items(size), storage.join(run, "item_gram"), ledger_path, part)
            seconds[part] = time.perf_counter() - started
    if copy:
        shutil.copytree(run, twin)  # the seed-file copy: the run folder before its first stats release

    def job(rows_path, embeddings, step, out, ledger):
        return StatsJob(
            rows_path,
            embeddings,
            tables.items,
            counts if out.startswith(run) else storage.join(twin, "counts", "counts.parquet"),
            out,
            settings,
            privacy,
            step=step,
            ledger_path=ledger,
            shards=2,
        )

    for step in range(1, steps + 1):
        started = time.perf_counter()
        if "gram" in multipliers:  # made and charged as a run makes it; scored by repeated releases below
            dp_gram(
                tables.embeddings[step - 1],
                Ledger.open(ledger_path),
                release.open_seed_file(None, ledger_path),
                settings,
                step,
            )
        out = storage.join(run, "stats", f"step-{step}")
        if "stats" in multipliers and config.engine == "federated":
            secret = None if seed is None else np.random.default_rng([seed, len(name), step]).bytes(32)
            federated_release(config, job(rows, tables.embeddings[step - 1], step, out, ledger_path), rng, secret)
        elif "stats" in multipliers:  # AM-DPSGD has none: its item updates below
            release_stats(engine, job(rows, tables.embeddings[step - 1], step, out, ledger_path))
        seconds[f"step-{step}"] = time.perf_counter() - started
    if "dpsgd" in multipliers:
        seconds.update(dpsgd_training(config, run, tables, rows, units=units, mean=dp))
    if copy:
        started = time.perf_counter()
        other = write_data(
            storage.join(folder, "copy-data"),
            size,
            np.zeros(size.canaries, bool),
            settings=settings,
            labels=labels,
            steps=1,
            seed=background,
        )
        other_rows = storage.join(folder, "copy-data", "stats-rows.parquet")
        storage.write_table(centred(storage.read_table(other.interactions), dp, config.protocol, None), other_rows)
        release_stats(
            engine,
            job(
                other_rows,
                other.embeddings[0],
                1,
                storage.join(twin, "stats", "step-1"),
                storage.join(twin, "ledger.parquet"),
            ),
        )
        seconds["copy"] = time.perf_counter() - started

    # scores (outside any plant: the caller scores after the releases)
    ledger = Ledger.open(ledger_path)
    accountant, delta = ledger.budget["accountant"], ledger.budget["delta"]
    groups, multipliers = set(multipliers), ledger.multipliers  # the plan's groups; the run's multipliers

    def claimed(events) -> float:
        return accounting.epsilon_of(events, delta, accountant)

    k = size.items_per_canary
    out: dict[str, Scored] = {}
    released = storage.read_table(counts).sort_by("item_id")
    at = np.searchsorted(released["item_id"].to_numpy(), CANARY_ITEMS + np.arange(size.canaries * k))
    dp_counts_of_canaries = released["count"].to_numpy()[at].reshape(size.canaries, k).astype(np.float64)
    count_std = multipliers["counts"] * math.sqrt(config.max_items_per_user + 1)
    count_scores = llr(dp_counts_of_canaries, np.ones((size.canaries, k)), count_std)
    count_event = accounting.gaussian_event(multipliers["counts"])
    out[f"{name}: counts"] = Scored(count_scores, member, claimed([count_event]), seconds["counts"], False)
    if "stats" in multipliers:
        # the federated round's Skellam noise is Gaussian to within its fixed point (module docstring): its
        # statistics' rows keep the Gaussian bound in the verdict, as the central ones do
        rho = row_clip(settings)
        std_a = multipliers["stats"] * settings.wbar * rho**2
        std_b = multipliers["stats"] * settings.wbar * settings.clip_y * rho
        label = (LABELS[1] - dp) if ratings else 1.0
        stats_claim = claimed([accounting.gaussian_event(multipliers["stats"], 2)])
        per_step = {}
        for step in range(1, steps + 1):
            a, b = read_canary_stats(storage.join(run, "stats", f"step-{step}", "resample-0.parquet"), size)
            x_a, x_b = canary_contributions(dp_counts_of_canaries, label, size, settings, step)
            per_step[step] = (a, b, x_a, x_b)
            out[f"{name}: stats step {step}"] = Scored(
                llr(a, x_a, std_a) + llr(b, x_b, std_b), member, stats_claim, seconds[f"step-{step}"]
            )
        if steps >= 2:
            (a1, b1, xa1, xb1), (a2, b2, xa2, xb2) = per_step[1], per_step[2]
            out[f"{name}: stats steps 1-2 (difference)"] = Scored(
                llr(a1 - a2, xa1 - xa2, math.sqrt(2) * std_a) + llr(b1 - b2, xb1 - xb2, math.sqrt(2) * std_b),
                member,
                claimed([accounting.gaussian_event(multipliers["stats"], 4)]),
                seconds["step-1"] + seconds["step-2"],
            )
        step_events = [accounting.gaussian_event(multipliers["stats"], 2 * steps)]
        if copy:
            a_copy, b_copy = read_canary_stats(storage.join(twin, "stats", "step-1", "resample-0.parquet"), size)
            a1, b1, xa1, xb1 = per_step[1]
            out[f"{name}: seed-file copy, stats step 1"] = Scored(
                llr(a1 - a_copy, xa1, math.sqrt(2) * std_a) + llr(b1 - b_copy, xb1, math.sqrt(2) * std_b),
                member,
                stats_claim,
                seconds["copy"],
            )
    elif "dpsgd" in groups:  # AM-DPSGD: each outer step's DP-SGD training, as its ledger records it
        q, steps_per_update = config.dpsgd_schedule(units)
        event = accounting.dpsgd_event(config.privacy(units).multipliers()["dpsgd"], q, steps_per_update)
        for step in range(1, steps + 1):
            out[f"{name}: dpsgd step {step}"] = Scored(
                dpsgd_scores(run, size, config, step), member, claimed([event]), seconds[f"dpsgd-{step}"], False
            )
        step_events = [event] * steps
    composed, events, parts = count_scores.copy(), [count_event], ["counts"]
    for kind in ("stats", "dpsgd"):
        if kind in groups:
            composed += sum(out[f"{name}: {kind} step {s}"].scores for s in range(1, steps + 1))
            events += step_events
            parts.append(kind)
    for part, label in ITEM_GRAM_PARTS.items():  # scores of the covered canaries, on their own entries (Gaussian noise)
        if part in multipliers:
            scores = item_gram_scores(storage.join(run, "item_gram", f"{part}.parquet"), size, multipliers[part])
            event = accounting.gaussian_event(multipliers[part])
            out[f"{name}: {label}"] = Scored(scores, member[: scores.size], claimed([event]), seconds[part])
            composed[: scores.size] += scores
            events.append(event)
            parts.append(label)
    out[f"{name}: {', '.join(parts[:-1])} and {parts[-1]} composed"] = Scored(
        composed,
        member,
        claimed(events),
        sum(seconds.values()) - seconds.get("copy", 0.0),
        False,
    )
    trial_rng = np.random.default_rng(rng.integers(2**63))
    if "mean" in multipliers:
        out[f"{name}: mean ({size.trials} releases)"] = mean_trials(
            storage.join(folder, "mean-trials"), size, multipliers["mean"], delta, accountant, trial_rng
        )
    if "gram" in multipliers:
        out[f"{name}: gram ({size.trials} releases)"] = gram_trials(
            storage.join(folder, "gram-trials"), size, multipliers["gram"], delta, accountant, settings, trial_rng
        )
    return out


def trials_ledger(folder: str, group: str, multiplier: float, delta: float, accountant: str):
    """A throw-away ledger with no cap whose plan gives `group` the product's multiplier, and its seed
    file (one per repeated release: a ledger makes each release once)."""
    from pipelines.releases import release
    from privacy.ledger import Ledger
    from schemas import storage

    path = storage.join(folder, "ledger.parquet")
    ledger = Ledger.create(path, math.inf, delta, accountant=accountant, multipliers={group: multiplier})
    return ledger, release.open_seed_file(None, path)


def mean_trials(folder: str, size: Size, multiplier: float, delta: float, accountant: str, rng) -> Scored:
    """The DP mean scored: `size.trials` releases of the product's dp_mean, each on the background
    with or without one canary (MEAN_RATINGS ratings at the top), by a fair coin; the score is the
    released mean (a clipped ratio: not Gaussian, one-run bound only)."""
    from pipelines.engines.local import LocalEngine
    from pipelines.releases.mean import dp_mean
    from privacy import accounting
    from schemas import storage
    from schemas.tables import INTERACTIONS

    started = time.perf_counter()
    n = size.canaries
    users = np.repeat(np.arange(1, n + 1), 5)
    labels = np.where(np.arange(users.size) % 2 == 0, LABELS[0], 3.0)
    paths = []
    for with_canary in (False, True):
        u = np.r_[users, [CANARY_USERS] * MEAN_RATINGS] if with_canary else users
        y = np.r_[labels, [LABELS[1]] * MEAN_RATINGS] if with_canary else labels
        path = storage.join(folder, f"interactions-{int(with_canary)}.parquet")
        storage.write_table(
            pa.table(
                {"user_id": u, "item_id": np.arange(u.size) % 7 + 1, "label": y, "timestamp": [0] * u.size},
                schema=INTERACTIONS,
            ),
            path,
        )
        paths.append(path)
    member = rng.random(size.trials) < 0.5
    engine = LocalEngine()
    scores = np.array(
        [
            dp_mean(
                paths[int(inside)],
                *trials_ledger(storage.join(folder, f"trial-{t}"), "mean", multiplier, delta, accountant),
                LABELS,
                "user",
                engine=engine,
            )["mean"]
            for t, inside in enumerate(member)
        ]
    )
    claim = accounting.epsilon_of([accounting.gaussian_event(multiplier, 2)], delta, accountant)
    return Scored(scores, member, claim, time.perf_counter() - started, False)


def gram_trials(folder: str, size: Size, multiplier: float, delta: float, accountant: str, settings, rng) -> Scored:
    """The users' Gram release scored: `size.trials` releases of the product's dp_gram, each over the
    background users with or without one canary (beyond the clip), by a fair coin; the score is the
    Gaussian log-likelihood ratio on the released matrix less the background's exact Gram (computed
    here). The PSD projection makes it not quite Gaussian: one-run bound only in the verdict."""
    from pipelines.releases.gram import dp_gram
    from privacy import accounting
    from privacy.accumulator import pack_upper
    from schemas import storage
    from schemas.tables import USER_EMBEDDINGS

    started = time.perf_counter()
    n = max(2000, size.canaries)
    background = background_vectors(np.random.default_rng(rng.integers(2**63)), n, settings)
    canary = canary_vector(1, settings, settings.clip_u)
    paths = []
    for with_canary in (False, True):
        vectors = np.vstack([background, canary[None, :]]) if with_canary else background
        ids = np.arange(1, vectors.shape[0] + 1)
        path = storage.join(folder, f"embeddings-{int(with_canary)}.parquet")
        storage.write_table(
            pa.table({"user_id": ids, "embedding": [list(v) for v in vectors]}, schema=USER_EMBEDDINGS), path
        )
        paths.append(path)

    def rows(vectors):
        u = vectors[:, :-2] if settings.bias else vectors
        u = u * np.minimum(1.0, settings.clip_u / np.maximum(np.linalg.norm(u, axis=1), 1e-300))[:, None]
        return np.hstack([u, np.full((u.shape[0], 1), settings.bias * settings.clip_u)]) if settings.bias else u

    exact = pack_upper(rows(background).T @ rows(background))
    x = rows(canary[None, :])[0]
    expected = pack_upper(np.outer(x, x))
    member = rng.random(size.trials) < 0.5
    std = multiplier * row_clip(settings) ** 2
    released = np.array(
        [
            pack_upper(
                dp_gram(
                    paths[int(inside)],
                    *trials_ledger(storage.join(folder, f"trial-{t}"), "gram", multiplier, delta, accountant),
                    settings,
                    1,
                )
            )
            for t, inside in enumerate(member)
        ]
    )
    scores = llr(released - exact, np.tile(expected, (member.size, 1)), std)
    claim = accounting.epsilon_of([accounting.gaussian_event(multiplier)], delta, accountant)
    return Scored(scores, member, claim, time.perf_counter() - started, False)


def audit(
    size: Size,
    epsilon: float,
    confidence: float,
    *,
    engine,
    work: str,
    delta: float = 1e-5,
    seed: int | None = None,
    plant: str | None = None,
    products: tuple[str, ...] = tuple(PRODUCTS),
) -> list[Row]:
    """Make every product's releases on the canaries (with `plant` planted in this process), score
    them, and bound each row; returns the table's rows. `engine`: a Spark session, or "local"."""
    from bench.audit_plants import planted
    from pipelines.training.settings import STATS_UPDATES, TrainConfig
    from schemas import storage

    rng = np.random.default_rng(seed)
    scored: dict[str, Scored] = {}
    configs = {name: TrainConfig.create(epsilon=epsilon, delta=delta, **PRODUCTS[name]) for name in products}
    central = [  # the products with central statistics
        name for name, config in configs.items() if config.engine != "federated" and config.item_update in STATS_UPDATES
    ]
    registry = storage.join(work, "budget-accounts")
    with lifetime_budget.registry_at(registry), planted(plant):
        if plant:
            logs.log(f"audit: planted defect: {plant}")
        for name, config in configs.items():  # the seed-file copy: in the first product with central statistics
            copy = name == central[0] if central else False
            scored.update(
                audit_product(name, config, size.of(config), engine=engine, work=work, rng=rng, seed=seed, copy=copy)
            )
    tests = sum(2 if row.gaussian else 1 for row in scored.values())
    failure = (1 - confidence) / tests  # Bonferroni over the verdict's rows and tests
    table = []
    for name, row in scored.items():
        delta_of = configs[name.split(":")[0]].delta
        accountant = configs[name.split(":")[0]].privacy().accountant
        table.append(
            Row(
                name,
                row.claimed,
                one_run_bound(row.scores, row.member, delta_of, failure),
                gdp_epsilon(gaussian_mu_bound(row.scores, row.member, failure), delta_of, accountant),
                row.seconds,
                row.gaussian,
                row.scores.size,
            )
        )
    return table


NOT_AUDITED = (
    "not audited here: what a federated round's server sees beyond the noised sum (secure aggregation's masks: "
    "tests/privacy), and plans off the defaults (--loss logistic, --resamples, federated biases); the federated "
    "product has canaries of its own, fewer (its round simulates every client); the item Gram is released over "
    "items the audit lists (its covered canaries'), not the top items by DP count"
)


def describe(rows: list[Row], confidence: float, plant: str | None, seconds: float) -> str:
    """The table as Markdown, with the verdict and its false-positive rate."""

    def number(value: float) -> str:
        return "inf" if math.isinf(value) else f"{value:.2f}"

    lines = [
        f"Privacy audit ({'planted defect: ' + plant if plant else 'the product'}; the releases of `ssp train`'s "
        f"default plans; every bound in the verdict holds together with confidence {confidence:g}; {seconds:.0f} s)",
        "",
        "| release | claimed epsilon | empirical lower bound | one-run | Gaussian | bound / claim | canaries | "
        "time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = row.bound / row.claimed if row.claimed > 0 else math.inf
        flag = " EXCEEDS" if row.exceeded else ""
        gaussian = number(row.gaussian) + ("" if row.gaussian_in_verdict else " (not in verdict)")
        lines.append(
            f"| {row.release} | {number(row.claimed)} | {number(row.bound)}{flag} | {number(row.one_run)} | "
            f"{gaussian} | {number(ratio)} | {row.canaries} | {row.seconds:.1f} |"
        )
    exceeded = [row.release for row in rows if row.exceeded]
    rate = f"{1 - confidence:.2g}"
    lines += [
        "",
        NOT_AUDITED,
        "",
        f"FAIL: the lower bound exceeds the claimed epsilon for {', '.join(exceeded)} (on a correct product a FAIL "
        f"happens with probability at most {rate}: a privacy defect, or one planted with --plant)"
        if exceeded
        else f"PASS: every lower bound is at or below its claimed epsilon (a correct product fails with probability "
        f"at most {rate})",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from bench.audit_plants import DEFECTS

    parser = argparse.ArgumentParser(
        prog="ssp audit",
        description="Empirical privacy audit, with canary users, of the releases `ssp train` makes by default "
        "(ratings, ranking, the DP per-item mean, federated, AM-DPSGD, the DP item Gram: counts, mean, Gram, item "
        "Gram, statistics, DP-SGD): a lower bound on epsilon per release and composed, next to the ledger's claim.",
        epilog="Exit status: 0 when every lower bound is at or below its claimed epsilon; "
        f"{EXIT_EXCEEDED} when one exceeds it (a privacy defect, or one planted with --plant; on a correct product "
        "with probability at most 1 - confidence); 2 on bad input.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes for CI ({QUICK.canaries} canaries, the federated product {QUICK.federated}; default "
        f"{FULL.canaries} and {FULL.federated})",
    )
    parser.add_argument(
        "--canaries", type=int, help="canary users of each product but the federated one (each included by a fair coin)"
    )
    parser.add_argument(
        "--federated-canaries",
        type=int,
        help=f"canary users of the federated product (default {FULL.federated}, --quick {QUICK.federated})",
    )
    parser.add_argument("--trials", type=int, help="repeated releases scoring the mean and the Gram")
    parser.add_argument(
        "--epsilon", type=float, default=4.0, help="the audited runs' target epsilon (default: %(default)s)"
    )
    parser.add_argument("--delta", type=float, default=1e-5, help="its delta (default: %(default)g)")
    parser.add_argument(
        "--confidence",
        type=float,
        default=0.99,
        help="confidence of the verdict's bounds, all together: a correct product fails with probability at most "
        "1 - confidence (default: %(default)s)",
    )
    parser.add_argument(
        "--products", default=",".join(PRODUCTS), help="which default plans to audit (default: %(default)s)"
    )
    parser.add_argument(
        "--plant",
        choices=tuple(DEFECTS),
        help="self-test of the audit's power: plant this defect in the product (this process and Spark's Python "
        "workers) for the duration of the audit; the audit must then exit 1. "
        + "; ".join(f"{name}: {what}" for name, what in DEFECTS.items()),
    )
    parser.add_argument(
        "--engine",
        choices=("spark", "local"),
        default="spark",
        help="where the statistics' item tasks run: Spark's Python workers, or this process (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="FIXED TEST SEED of the canaries' coins and the runs' noise (default: fresh from the OS)",
    )
    parser.add_argument(
        "--work", help="folder for the audit's data and runs (default: a temporary folder, removed afterwards)"
    )
    parser.add_argument("--master", help="Spark master URL (default: local[*])")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


@contextlib.contextmanager
def plant_in_workers(plant: str | None, folder: str):
    """The environment a JVM started in the block passes to its Python workers: the plant's
    sitecustomize hook on PYTHONPATH and $SSP_AUDIT_PLANT (nothing without a plant)."""
    import os

    from bench import audit_plants

    if plant is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", audit_plants.ENV)}
    hook = audit_plants.worker_hook(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, saved["PYTHONPATH"]) if p)
    os.environ[audit_plants.ENV] = plant
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str] | None = None) -> int:
    from bench import audit_plants
    from pipelines.engines.spark import session
    from schemas import SchemaError, storage

    args = build_parser().parse_args(argv)
    logs.configure(-1 if args.quiet else 0)
    try:
        size = QUICK if args.quick else FULL
        if args.canaries is not None:
            if args.canaries < 10:
                raise UserError(f"--canaries must be at least 10, got {args.canaries}")
            size = dataclasses.replace(size, canaries=args.canaries)
        if args.federated_canaries is not None:
            if args.federated_canaries < 10:
                raise UserError(f"--federated-canaries must be at least 10, got {args.federated_canaries}")
            size = dataclasses.replace(size, federated=args.federated_canaries)
        if args.trials is not None:
            if args.trials < 10:
                raise UserError(f"--trials must be at least 10, got {args.trials}")
            size = dataclasses.replace(size, trials=args.trials)
        if not 0 < args.confidence < 1:
            raise UserError(f"--confidence must be in (0, 1), got {args.confidence}")
        products = tuple(name.strip() for name in args.products.split(",") if name.strip())
        unknown = [name for name in products if name not in PRODUCTS]
        if unknown or not products:
            raise UserError(f"--products must name some of {tuple(PRODUCTS)}, got {args.products!r}")
        from pipelines.releases.release import PrivacySettings

        PrivacySettings(epsilon=args.epsilon, delta=args.delta)  # the budget's own checks
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            work = args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="ssp-audit-"))
            if storage.exists(storage.join(work, "budget-accounts")):
                raise UserError(f"--work {work} already holds an audit; give an empty folder")
            engine = "local"
            if args.engine == "spark":
                with plant_in_workers(args.plant, storage.join(work, "plant-hook")):
                    engine = stack.enter_context(session("ssp-audit", args.master))
                if args.plant and audit_plants.worker_plant(engine) != args.plant:
                    raise UserError(
                        f"--plant {args.plant} cannot reach the Python workers of a Spark session started before "
                        "the audit; give --engine local (the same item tasks in this process), or run it alone"
                    )
            rows = audit(
                size,
                args.epsilon,
                args.confidence,
                engine=engine,
                work=work,
                delta=args.delta,
                seed=args.seed,
                plant=args.plant,
                products=products,
            )
    except (ValueError, SchemaError, storage.MissingTableError) as exc:
        print(f"ssp audit: error: {exc}", file=sys.stderr)
        return 2
    print(describe(rows, args.confidence, args.plant, time.perf_counter() - started))
    return EXIT_EXCEEDED if any(row.exceeded for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
