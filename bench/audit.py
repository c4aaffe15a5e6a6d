"""`ssp audit`: an empirical privacy audit of the real releases, with canary users.

The audit builds a small data set, adds m canary users, each included by an independent fair coin,
and makes a run's releases with the product's own code: the DP counts (pipelines.releases.counts), the DP
mean (pipelines.releases.mean) and the statistics of every outer step through the Spark stats job
(pipelines.engines.spark_stats), into one ledger and seed file as `ssp train` makes them. A canary is a worst
case: it rates K items of its own (the counts' cap, so all are counted), every rating at the top of
the range (its centred label at the clip), and its embedding lies on the clip, along one axis at odd
steps and another at even ones. Its items are in the catalog whether it is included or not (every
catalog item is noised), so its coordinates are identifiable.

Each canary gets a score per release: the Gaussian log-likelihood ratio of "included" against "not
included" on its own coordinates, with the noise scale the release claims (the optimal test for a
Gaussian release; the mean has no coordinate of a canary's own, so it is made and charged but not
scored). Rows of the table:
- each release alone (counts; stats of each step);
- stats of steps 1 and 2 by their difference: the test for noise shared between releases;
- all releases composed: the sum of a canary's scores;
- a seed-file copy: the run folder copied before the step-1 stats release, which is then made in
  both copies, with the canaries and without (a neighbouring pair), scored by the difference.
Every row turns its scores into two lower bounds on epsilon at the ledger's delta, next to the
epsilon the ledger claims for those releases:
- one-run: Steinke, Nasr and Jagielski (2023, "Privacy auditing with one (1) training run",
  Theorem 5.2 with delta): guess "in" for the k top scores and "out" for the k bottom ones; if the
  releases were (eps, delta)-DP, v correct of r guesses has p-value P[Binomial(r, q) >= v] +
  2 m delta alpha, q = e^eps / (1 + e^eps), alpha = max_i P[v > Binomial(r, q) >= v - i] / i. It
  assumes nothing about the mechanism, and for Gaussian noise at delta 1e-5 it stays far below the
  truth (its 2 m delta term caps it near 3.7 with 5,000 canaries, and it cannot see noise cut by half);
- Gaussian: the releases claim Gaussian noise, under which the scores of included and excluded
  canaries are two normals with one variance and the standardized difference of their means is the
  mechanism's mu (mu-GDP); a one-sided lower confidence bound on it (normal approximation of the
  standardized mean difference) gives epsilon(mu, delta), composed by the same accountant as the
  ledger's claim. It is close to the claim and sees a halved noise.
A row's bound is the larger of the two; every bound of the table (both tests, every k tried) holds
together with the confidence given (Bonferroni). Exit status 1 when a bound exceeds its claim.

`--plant` is a self-test of the audit's power: it patches the product in this process, for the
duration of the audit only, with a known defect, and the audit must then exit 1:
- sensitivity: every release's noise scaled by 1/2 while the ledger records the calibrated
  multipliers (a sensitivity understated 2x);
- shared-noise: every stats release uses the noise of the first one;
- seed-copy: `SeedFile.release_seed` returns the bare seed (noise keyed by the release index only:
  both copies of a run folder draw the same noise).

Privacy: the audit's data are synthetic and its run folder is temporary; it publishes nothing but
the table. A normal run is never affected by --plant.
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
from unittest import mock

import numpy as np
import pyarrow as pa
from scipy import special, stats

from pipelines.base import logs
from schemas.errors import UserError

PLANTS = ("sensitivity", "shared-noise", "seed-copy")
FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # the one-run test's guesses: the top and bottom k = f m / 2 scores
EXIT_EXCEEDED = 1
LABELS = (1.0, 5.0)  # the rating range; canaries rate at the top
CANARY_USERS = 1_000_000  # canary c is user CANARY_USERS + c, its items CANARY_ITEMS + c K + k
CANARY_ITEMS = 1_000_000


@dataclass(frozen=True)
class Size:
    """The audit's data: canaries, their items each (K), background items, dimension. There are as
    many background users as canaries, each with 5 ratings at the bottom of the range, so that the
    DP mean stays low and a canary's centred label is beyond the label clip."""

    canaries: int
    items_per_canary: int = 4
    background_items: int = 50
    dim: int = 2


QUICK = Size(canaries=300, background_items=20)
FULL = Size(canaries=5000)


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


def canary_embedding(step: int, dim: int, clip: float) -> np.ndarray:
    """A canary's embedding at `step`: on the clip, along axis 0 at odd steps and axis 1 at even ones."""
    vector = np.zeros(dim)
    vector[(step - 1) % min(2, dim)] = clip
    return vector


def write_data(folder: str, size: Size, member: np.ndarray, steps: int, clip_u: float, background_seed: int) -> Tables:
    """The background users (drawn from `background_seed`) and the included canaries, written as the
    run's tables; the catalog holds every canary's items, included or not."""
    from schemas import storage
    from schemas.tables import INTERACTIONS, USER_EMBEDDINGS, items_schema

    k = size.items_per_canary
    rng = np.random.default_rng(background_seed)
    users, items, labels = [], [], []
    for user in range(1, size.canaries + 1):
        rated = rng.choice(np.arange(1, size.background_items + 1), size=min(5, size.background_items), replace=False)
        users += [user] * rated.size
        items += rated.tolist()
        labels += [LABELS[0]] * rated.size
    canaries = np.flatnonzero(member)
    users += np.repeat(CANARY_USERS + canaries, k).tolist()
    items += (CANARY_ITEMS + canaries[:, None] * k + np.arange(k)).reshape(-1).tolist()
    labels += [LABELS[1]] * (canaries.size * k)
    storage.write_table(
        pa.table(
            {"user_id": users, "item_id": items, "label": labels, "timestamp": [0] * len(users)}, schema=INTERACTIONS
        ),
        storage.join(folder, "interactions.parquet"),
    )
    catalog = np.r_[np.arange(1, size.background_items + 1), CANARY_ITEMS + np.arange(size.canaries * k)]
    storage.write_table(
        pa.table(
            {"item_id": catalog, "title": [f"item {i}" for i in catalog], "genres": [[] for _ in catalog]},
            schema=items_schema({"genres": "multivalent"}),
        ),
        storage.join(folder, "items.parquet"),
    )
    background = rng.normal(size=(size.canaries, size.dim))
    embeddings = []
    for step in range(1, steps + 1):
        vectors = np.vstack([background, np.tile(canary_embedding(step, size.dim, clip_u), (canaries.size, 1))])
        ids = np.r_[np.arange(1, size.canaries + 1), CANARY_USERS + canaries]
        path = storage.join(folder, f"embeddings-{step}.parquet")
        storage.write_table(
            pa.table({"user_id": ids, "embedding": [list(v) for v in vectors]}, schema=USER_EMBEDDINGS), path
        )
        embeddings.append(path)
    return Tables(storage.join(folder, "interactions.parquet"), storage.join(folder, "items.parquet"), embeddings)


@dataclass(frozen=True)
class Settings:
    """The audit's claim: the run's target epsilon over its releases, delta, outer steps, clips."""

    epsilon: float
    delta: float = 1e-5
    steps: int = 2
    clip_u: float = 1.0
    clip_y: float = 1.0
    wbar: float = 1.0


def write_centred(interactions: str, mean: float, out: str) -> str:
    """The stats job's rows: labels centred by the DP mean (pipelines.releases.mean.centred, as `ssp train`)."""
    from pipelines.releases.mean import centred
    from schemas import storage

    storage.write_table(centred(storage.read_table(interactions), mean, "rmse", None), out)
    return out


def stats_release(
    spark,
    rows: str,
    tables: Tables,
    *,
    counts: str,
    out: str,
    settings: Settings,
    privacy,
    stats_settings,
    step: int,
    ledger: str,
) -> dict:
    """Step `step`'s statistics through the Spark stats job, into the run's ledger and seed file."""
    from pipelines.engines import spark_stats as stats
    from pipelines.releases import stats_job

    job = stats_job.StatsJob(
        rows,
        tables.embeddings[step - 1],
        tables.items,
        counts,
        out,
        stats_settings,
        privacy,
        step=step,
        ledger_path=ledger,
        shards=2,
    )
    return stats.run(job, spark)


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


def canary_contributions(
    counts: str, mean: float, size: Size, settings: Settings, stats_settings, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """What each canary adds to its items' packed A and b at `step` when included, from the released
    counts (its weights) and the DP mean (its centred label), by the job's own kernel."""
    from pipelines.releases.stats_core import user_contributions
    from privacy.accumulator import pack_upper
    from schemas import storage

    k = size.items_per_canary
    table = storage.read_table(counts).sort_by("item_id")
    ids, values = table["item_id"].to_numpy(), table["count"].to_numpy()
    items = CANARY_ITEMS + np.arange(size.canaries * k)
    users = np.repeat(CANARY_USERS + np.arange(size.canaries), k)
    vectors = np.tile(canary_embedding(step, size.dim, settings.clip_u), (items.size, 1))
    labels = np.full(items.size, LABELS[1] - mean)
    _, rows = user_contributions(
        users, items, labels, vectors, values[np.searchsorted(ids, items)], settings=stats_settings
    )
    x, s = rows[:, : size.dim], rows[:, size.dim]
    a = pack_upper(x[:, :, None] * x[:, None, :])
    return a.reshape(size.canaries, k, -1), (s[:, None] * x).reshape(size.canaries, k, -1)


@dataclass
class Row:
    """One line of the table."""

    release: str
    claimed: float
    one_run: float
    gaussian: float
    seconds: float

    @property
    def bound(self) -> float:
        return max(self.one_run, self.gaussian)

    @property
    def exceeded(self) -> bool:
        return self.bound > self.claimed * (1 + 1e-9)


@contextlib.contextmanager
def planted(defect: str | None):
    """The product with a known defect, for the duration of the block only (module docstring)."""
    from pipelines.releases import counts, mean, stats_job
    from privacy.noise import add_noise
    from privacy.seeds import SeedFile

    with contextlib.ExitStack() as stack:
        if defect == "sensitivity":

            def halved(z, std, *args, **kwargs):
                return add_noise(z, std / 2, *args, **kwargs)

            prepare = stats_job.StatsJob.prepare

            def prepare_halved(self):
                self.releases = [
                    dataclasses.replace(spec, noise_multiplier=spec.noise_multiplier / 2) for spec in prepare(self)
                ]
                return self.releases

            stack.enter_context(mock.patch.object(counts, "add_noise", halved))
            stack.enter_context(mock.patch.object(mean, "add_noise", halved))
            stack.enter_context(mock.patch.object(stats_job.StatsJob, "prepare", prepare_halved))
        elif defect == "shared-noise":
            prepare, first = stats_job.StatsJob.prepare, []

            def prepare_shared(self):
                specs = prepare(self)
                first.extend(specs[:1] if not first else [])
                self.releases = [
                    dataclasses.replace(spec, seed=first[0].seed, release=first[0].release) for spec in specs
                ]
                return self.releases

            stack.enter_context(mock.patch.object(stats_job.StatsJob, "prepare", prepare_shared))
        elif defect == "seed-copy":
            stack.enter_context(mock.patch.object(SeedFile, "release_seed", lambda self, index: self.seed, create=True))
        yield


def audit(
    size: Size,
    settings: Settings,
    confidence: float,
    *,
    spark,
    work: str,
    seed: int | None = None,
    plant: str | None = None,
) -> list[Row]:
    """Run the releases on the canaries and score them; returns the table's rows."""
    from pipelines.engines.local import LocalEngine
    from pipelines.releases import release
    from pipelines.releases.counts import dp_counts
    from pipelines.releases.mean import dp_mean
    from pipelines.releases.release import PrivacySettings
    from pipelines.releases.stats_core import StatsSettings
    from privacy import accounting
    from privacy.ledger import Ledger
    from privacy.seeds import SeedFile
    from schemas import storage

    rng = np.random.default_rng(seed)
    member = rng.random(size.canaries) < 0.5
    run, copy = storage.join(work, "run"), storage.join(work, "copy")
    ledger_path = storage.join(run, "ledger.parquet")
    seed_path = release.default_seed_path(ledger_path)
    if seed is not None:  # a fixed test seed: the whole audit reproduces
        SeedFile.create(seed_path, np.random.default_rng(seed).bytes(32))
    privacy = PrivacySettings(
        epsilon=settings.epsilon, delta=settings.delta, outer_steps=settings.steps, gram_share=0.0
    )
    stats_settings = StatsSettings(size.dim, settings.clip_u, settings.clip_y, "user", settings.wbar)
    k = size.items_per_canary
    seconds: dict[str, float] = {}
    with planted(plant):
        logs.log(
            f"audit: {size.canaries} canaries ({int(member.sum())} included), {k} items each; claimed epsilon "
            f"{settings.epsilon:g} "
            f"at delta {settings.delta:g} over counts, mean and {settings.steps} stats releases"
            + (f"; planted defect: {plant}" if plant else "")
        )
        background = int(rng.integers(2**63))
        tables = write_data(storage.join(work, "data"), size, member, settings.steps, settings.clip_u, background)
        started = time.perf_counter()
        dp_counts(
            tables.interactions,
            tables.items,
            storage.join(run, "counts"),
            privacy,
            "user",
            k,
            ledger_path,
            engine=LocalEngine(),
        )
        seconds["counts"] = time.perf_counter() - started
        counts = storage.join(run, "counts", "counts.parquet")
        dp = dp_mean(
            tables.interactions,
            Ledger.open(ledger_path),
            release.open_seed_file(None, ledger_path),
            LABELS,
            "user",
            engine=LocalEngine(),
        )["mean"]
        rows = write_centred(tables.interactions, dp, storage.join(work, "data", "stats-rows.parquet"))
        shutil.copytree(run, copy)  # the seed-file copy: the run folder before its first stats release
        for step in range(1, settings.steps + 1):
            started = time.perf_counter()
            stats_release(
                spark,
                rows,
                tables,
                counts=counts,
                out=storage.join(run, "stats", f"step-{step}"),
                settings=settings,
                privacy=privacy,
                stats_settings=stats_settings,
                step=step,
                ledger=ledger_path,
            )
            seconds[f"step-{step}"] = time.perf_counter() - started
        started = time.perf_counter()
        other = write_data(
            storage.join(work, "copy-data"), size, np.zeros(size.canaries, bool), 1, settings.clip_u, background
        )
        other_rows = write_centred(other.interactions, dp, storage.join(work, "copy-data", "stats-rows.parquet"))
        stats_release(
            spark,
            other_rows,
            other,
            counts=storage.join(copy, "counts", "counts.parquet"),
            out=storage.join(copy, "stats", "step-1"),
            settings=settings,
            privacy=privacy,
            stats_settings=stats_settings,
            step=1,
            ledger=storage.join(copy, "ledger.parquet"),
        )
        seconds["copy"] = time.perf_counter() - started

    ledger = Ledger.open(ledger_path)
    multipliers, accountant, delta = ledger.budget["multipliers"], ledger.budget["accountant"], ledger.budget["delta"]

    def claimed(events) -> float:
        return accounting.epsilon_of(events, delta, accountant)

    scores: dict[str, np.ndarray] = {}
    claims: dict[str, float] = {}
    count_std = multipliers["counts"] * math.sqrt(k + 1)
    released = storage.read_table(counts).sort_by("item_id")
    at = np.searchsorted(released["item_id"].to_numpy(), CANARY_ITEMS + np.arange(size.canaries * k))
    scores["counts"] = llr(
        released["count"].to_numpy()[at].reshape(size.canaries, k), np.ones((size.canaries, k)), count_std
    )
    claims["counts"] = claimed([accounting.gaussian_event(multipliers["counts"])])
    std_a = multipliers["stats"] * settings.wbar * settings.clip_u**2
    std_b = multipliers["stats"] * settings.wbar * settings.clip_y * settings.clip_u
    stats_claim = claimed([accounting.gaussian_event(multipliers["stats"], 2)])
    steps = {}
    for step in range(1, settings.steps + 1):
        a, b = read_canary_stats(storage.join(run, "stats", f"step-{step}", "resample-0.parquet"), size)
        x_a, x_b = canary_contributions(counts, dp, size, settings, stats_settings, step)
        steps[step] = (a, b, x_a, x_b)
        scores[f"stats step {step}"] = llr(a, x_a, std_a) + llr(b, x_b, std_b)
        claims[f"stats step {step}"] = stats_claim
    if settings.steps >= 2:
        (a1, b1, xa1, xb1), (a2, b2, xa2, xb2) = steps[1], steps[2]
        scores["stats steps 1-2 (difference)"] = llr(a1 - a2, xa1 - xa2, math.sqrt(2) * std_a) + llr(
            b1 - b2, xb1 - xb2, math.sqrt(2) * std_b
        )
        claims["stats steps 1-2 (difference)"] = claimed([accounting.gaussian_event(multipliers["stats"], 4)])
    scores["all releases composed"] = sum(scores[name] for name in ("counts", *(f"stats step {s}" for s in steps)))
    claims["all releases composed"] = ledger.epsilon_spent()
    a_copy, b_copy = read_canary_stats(storage.join(copy, "stats", "step-1", "resample-0.parquet"), size)
    a1, b1, xa1, xb1 = steps[1]
    scores["seed-file copy, stats step 1"] = llr(a1 - a_copy, xa1, math.sqrt(2) * std_a) + llr(
        b1 - b_copy, xb1, math.sqrt(2) * std_b
    )
    claims["seed-file copy, stats step 1"] = stats_claim

    failure = (1 - confidence) / (2 * len(scores))  # Bonferroni over the rows and the two tests
    times = {
        "counts": seconds["counts"],
        "all releases composed": sum(v for name, v in seconds.items() if name != "copy"),
        "seed-file copy, stats step 1": seconds["copy"],
        "stats steps 1-2 (difference)": seconds.get("step-1", 0) + seconds.get("step-2", 0),
    }
    table = []
    for name, score in scores.items():
        gaussian = gdp_epsilon(gaussian_mu_bound(score, member, failure), delta, accountant)
        table.append(
            Row(
                name,
                claims[name],
                one_run_bound(score, member, delta, failure),
                gaussian,
                times.get(name, seconds.get(name.replace("stats step ", "step-"), 0.0)),
            )
        )
    return table


def describe(rows: list[Row], size: Size, confidence: float, plant: str | None, seconds: float) -> str:
    """The table as Markdown, with the verdict."""

    def number(value: float) -> str:
        return "inf" if math.isinf(value) else f"{value:.2f}"

    lines = [
        f"Privacy audit ({'planted defect: ' + plant if plant else 'the product'}; {size.canaries} canaries; every "
        "bound holds together "
        f"with confidence {confidence:g}; {seconds:.0f} s)",
        "",
        "| release | claimed epsilon | empirical lower bound | one-run | Gaussian | bound / claim | confidence | "
        "canaries | time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = row.bound / row.claimed if row.claimed > 0 else math.inf
        flag = " EXCEEDS" if row.exceeded else ""
        lines.append(
            f"| {row.release} | {number(row.claimed)} | {number(row.bound)}{flag} | {number(row.one_run)} | "
            f"{number(row.gaussian)} | "
            f"{number(ratio)} | {confidence:g} | {size.canaries} | {row.seconds:.1f} |"
        )
    exceeded = [row.release for row in rows if row.exceeded]
    lines += [
        "",
        f"FAIL: the lower bound exceeds the claimed epsilon for {', '.join(exceeded)}"
        if exceeded
        else "PASS: every lower bound is at or below its claimed epsilon",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssp audit",
        description="Empirical privacy audit of the real releases (counts, mean, Spark stats job) with canary users: "
        "a lower bound on epsilon per release and composed, next to the ledger's claim.",
        epilog="Exit status: 0 when every lower bound is at or below its claimed epsilon; "
        f"{EXIT_EXCEEDED} when one exceeds it (a privacy defect, or one planted with --plant); 2 on bad input.",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"small sizes for CI ({QUICK.canaries} canaries; default {FULL.canaries})"
    )
    parser.add_argument("--canaries", type=int, help="number of canary users (each included by a fair coin)")
    parser.add_argument(
        "--epsilon",
        type=float,
        default=4.0,
        help="the audited run's target epsilon over all its releases (default: %(default)s)",
    )
    parser.add_argument("--delta", type=float, default=1e-5, help="its delta (default: %(default)g)")
    parser.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence of the table's bounds, all together (default: %(default)s)",
    )
    parser.add_argument(
        "--plant",
        choices=PLANTS,
        help="self-test of the audit's power: plant this defect in the product for the duration of "
        "the audit (sensitivity: noise halved; shared-noise: the stats releases share one noise; seed-copy: noise "
        "keyed by "
        "seed and index only, as before per-input keys); the audit must then exit 1",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="FIXED TEST SEED of the canaries' coins and the run's noise (default: fresh from the OS)",
    )
    parser.add_argument(
        "--work", help="folder for the audit's data and run (default: a temporary folder, removed afterwards)"
    )
    parser.add_argument("--master", help="Spark master URL (default: local[*])")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: list[str] | None = None) -> int:
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
        if not 0 < args.confidence < 1:
            raise UserError(f"--confidence must be in (0, 1), got {args.confidence}")
        settings = Settings(args.epsilon, args.delta)
        from pipelines.releases.release import PrivacySettings

        PrivacySettings(epsilon=settings.epsilon, delta=settings.delta)  # the budget's own checks
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            work = args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="ssp-audit-"))
            if storage.exists(storage.join(work, "run")):
                raise UserError(f"--work {work} already holds an audit run; give an empty folder")
            spark = stack.enter_context(session("ssp-audit", args.master))
            rows = audit(size, settings, args.confidence, spark=spark, work=work, seed=args.seed, plant=args.plant)
    except (ValueError, SchemaError, storage.MissingTableError) as exc:
        print(f"ssp audit: error: {exc}", file=sys.stderr)
        return 2
    print(describe(rows, size, args.confidence, args.plant, time.perf_counter() - started))
    return EXIT_EXCEEDED if any(row.exceeded for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
