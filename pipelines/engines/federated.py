"""Federated SSP2 (the paper's appendix, Algorithm "Federated SSP2"): one outer step's statistics
release with each user's device as a client, simulated as a Beam pipeline (clients are elements;
any runner).

Each client solves its user embedding from its own ratings and the broadcast item embeddings,
computes its clipped, weighted contribution to A_j, b_j of every catalog item (zeros where it rated
nothing, so its shape says nothing), encodes it in fixed point, adds its Skellam noise share
(privacy.skellam) and sends it masked by secure aggregation (privacy.secure_aggregation). The server
decodes the noised sum into a stats table of the same schema and release.json as the central stats
job, which the same item update consumes. docs/secure-aggregation.md ("One federated round") has the
planning, the round records, the fixed point and the trust model in full.

Privacy: the release is planned and recorded like the central one (one Gaussian event of the stats
multiplier z), composed by an RDP accountant on integer orders, with noise planned for
ceil((1 - max_dropout) n_low) clients, n_low the DP number of units less five of its std: every
published parameter comes from the DP count, none from the exact number of clients. Every round is recorded before it
starts in the run's seed file and on the release's charge in the data source's budget account, so a
second round of a release is refused (except after a round refused before any share was revealed).
Neighbouring data: one client's data replaced by an empty device's. The server sees masked vectors,
who took part and the noised sum; it must not hand out forged keys (the PKI is simulated).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pipelines.base import logs
from pipelines.base.lock import release_lock
from pipelines.engines.beam_release import ReadTable, pinned, rows_by_user
from pipelines.engines.prepare_beam import BeamEngine
from pipelines.releases import release, stats_job
from pipelines.releases.counts import dp_units, dp_units_std
from pipelines.releases.stats_core import release_metadata, stats_table, user_contributions
from privacy import accounting, skellam
from privacy import secure_aggregation as secagg
from privacy.accumulator import NoiseSpec, grouped_sums, packed_size
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import validate_item_embeddings
from trainer.solve import ridge_solve

ACCOUNTANT = "rdp-integer"
QUANTISATION_BITS = 16  # the fixed-point step is at most 2^-16 of the noise's std over n clients
SHAMIR_SHARE_BYTES = 66  # a share is an element of the field 2^521 - 1
LOW_STDS = 5  # the noise is planned for the DP number of units less 5 of its std (exceeded with chance 3e-7)
HIGH_STDS = 10  # the ring holds the DP number of units plus 10 of its std


class RoundRefusedError(UserError):
    """A round the clients or the server refused (too many dropouts, a secret too few could rebuild,
    survivor sets that failed the consistency check): one line for the user, nothing published."""


@dataclass(frozen=True)
class Plan:
    """The round's public parameters: fixed-point scale, Skellam multiplier and per-client variances."""

    clients: int
    min_clients: int  # the quorum: noise_clients, and more than half of the clients
    noise_clients: int  # the noise is planned for this many (public: from the DP number of units)
    items: int
    dim: int
    scale: float
    skellam_multiplier: float
    share_variance: tuple[float, float]  # (A entries, b entries), per client
    neighbours: int

    @property
    def width(self) -> int:
        """Ring elements per item: the packed A_j and b_j."""
        return packed_size(self.dim) + self.dim

    def upload_bytes(self) -> int:
        """What one client sends: its public and verification keys, two Shamir shares per neighbour
        at setup, the masked vector, its signature on the survivor set, one share per neighbour
        when unmasking."""
        return 32 + 32 + 3 * self.neighbours * SHAMIR_SHARE_BYTES + 8 * self.items * self.width + 64

    def to_json(self) -> dict:
        """Every parameter, for the release's fingerprint (a keyed hash: never published as is)."""
        return {
            "clients": self.clients,
            "min_clients": self.min_clients,
            "noise_clients": self.noise_clients,
            "scale": self.scale,
            "skellam_multiplier": self.skellam_multiplier,
            "share_variance": list(self.share_variance),
            "neighbours": self.neighbours,
            "upload_bytes_per_client": self.upload_bytes(),
        }

    def public_json(self) -> dict:
        """What release.json publishes: parameters planned from the DP number of units, nothing that
        gives the exact number of clients."""
        return {
            "scale": self.scale,
            "skellam_multiplier": self.skellam_multiplier,
            "noise_clients": self.noise_clients,
            "neighbours": self.neighbours,
            "upload_bytes_per_client": self.upload_bytes(),
        }


def planned_population(counts_path: str) -> tuple[int, int]:
    """The public range of the round's client count: the counts release's DP number of units less
    and plus LOW_STDS and HIGH_STDS of its noise std (the noise is planned over the low end, the ring
    over the high one)."""
    count, std = dp_units(counts_path), dp_units_std(counts_path)
    return max(3, count - math.ceil(LOW_STDS * std)), count + math.ceil(HIGH_STDS * std)


def plan_round(job: stats_job.StatsJob, multiplier: float, clients: int, max_dropout: float, items: int) -> Plan:
    """The fixed-point scale s (a power of two), z_s and the shares' variances, planned from the DP
    number of units (`planned_population`); only the quorum, which the server needs anyway, uses the
    exact number of `clients`."""
    settings = job.settings
    if settings.loss != "square":
        raise UserError(
            f"--loss {settings.loss} has no federated release yet (its negatives span every item: each client's "
            "vector would too)"
        )
    if not (math.isfinite(settings.clip_u) and math.isfinite(settings.clip_y)):
        raise UserError("a federated release needs finite --clip-u and --clip-y (they bound what fits in the ring)")
    if not 0 <= max_dropout < 1:
        raise UserError(f"the tolerated dropout must be in [0, 1), got {max_dropout}")
    low, high = planned_population(job.counts)
    if not low <= clients <= high:  # more than LOW_STDS or HIGH_STDS of the units' noise away: a defect, not chance
        raise UserError(
            f"{job.counts}: the round has {clients} clients, outside the range {low}-{high} its DP number of units "
            "plans for; the counts release is not of this round's users"
        )
    d, p = settings.dim, packed_size(settings.dim)
    sensitivity = (
        settings.wbar * settings.clip_u**2,
        settings.wbar * settings.clip_y * settings.clip_u,
    )  # A, b: one user, L2
    largest = max(sensitivity)
    noise_clients = math.ceil((1 - max_dropout) * low)
    min_clients = secagg.quorum(clients, noise_clients)
    ring_bound = 2.0**62 / (
        high * largest + 40 * max(multiplier, 1.0) * largest
    )  # every client's most, plus 40 std of noise
    wanted = 2.0**QUANTISATION_BITS * low / (multiplier * min(sensitivity)) if multiplier > 0 else ring_bound
    scale = 2.0 ** math.floor(math.log2(min(wanted, ring_bound)))
    neighbours = secagg.neighbour_count(high)  # the DP count can fall far below the clients: its high end cannot
    if multiplier == 0:
        return Plan(clients, min_clients, noise_clients, items, d, scale, 0.0, (0.0, 0.0), neighbours)
    parts = [
        (math.sqrt(items * size) * scale * s, scale * s) for size, s in zip((p, d), sensitivity, strict=True)
    ]  # (L1, L2) of the integer vectors
    z_s = skellam.skellam_multiplier(multiplier, parts)
    variances = tuple((z_s * l2) ** 2 / noise_clients for _, l2 in parts)
    return Plan(clients, min_clients, noise_clients, items, d, scale, z_s, variances, neighbours)


def client_secret(round_secret: bytes, client: int) -> secagg.ClientKeys:
    """A simulated device's own secret (see privacy.secure_aggregation)."""
    secret = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=b"ssp federated client " + int(client).to_bytes(8, "big", signed=True),
    ).derive(round_secret)
    return secagg.ClientKeys(secret)


def client_noise(keys: secagg.ClientKeys, plan: Plan) -> np.ndarray:
    """The client's Skellam share over its whole vector (A entries, then b entries, per item)."""
    rng = np.random.default_rng(int.from_bytes(keys.noise_seed, "big"))
    p = packed_size(plan.dim)
    noise = np.empty((plan.items, plan.width), dtype=np.int64)
    noise[:, :p] = skellam.shares(plan.items * p, plan.share_variance[0], rng).reshape(plan.items, p)
    noise[:, p:] = skellam.shares(plan.items * plan.dim, plan.share_variance[1], rng).reshape(plan.items, plan.dim)
    return noise.reshape(-1)


def public_round_seed(round_secret: bytes) -> bytes:
    """The round's public seed: the neighbour graph's shuffle and the simulated dropouts."""
    return secagg.derive(round_secret, b"public round seed")


def dropped_clients(clients: np.ndarray, round_seed: bytes, dropout: float) -> frozenset:
    """The clients that drop out after setup in the simulation: each with probability `dropout`, by a keyed hash."""
    return frozenset(
        int(c)
        for c in clients
        if int.from_bytes(secagg.derive(round_seed, int(c).to_bytes(8, "big", signed=True))[:4], "big")
        < dropout * 2**32
    )


@dataclass(frozen=True)
class Broadcast:
    """What the distributor sends every client: the item embeddings, the stats catalog and its DP counts (all
    public)."""

    embeddings: tuple[IdIndex, np.ndarray]
    gram: np.ndarray | None
    catalog: IdIndex
    counts: np.ndarray


def client_contribution(
    user: int,
    solve_rows: tuple[np.ndarray, np.ndarray],
    stats_rows: tuple[np.ndarray, np.ndarray],
    broadcast: Broadcast,
    *,
    settings,
    lambda_u: float,
    plan: Plan,
) -> np.ndarray:
    """The client's real vector: its embedding solved from its own rows, then its clipped, weighted
    A_j, b_j terms at its items' catalog positions (zero elsewhere), shape (items * width)."""
    index, vectors = broadcast.embeddings
    items, labels = solve_rows
    _, u = ridge_solve(
        np.full(items.size, user),
        vectors[index.positions(items, "item with an embedding")],
        labels,
        lambda_u,
        scale_by_rows=True,
        gravity=broadcast.gram,
        confidence=settings.confidence,
    )
    out = np.zeros((plan.items, plan.width))
    rated, rated_labels = stats_rows
    if (
        np.unique(rated).size != rated.size
    ):  # its weights bound the client's contribution only with each pair once, as the central job requires
        raise UserError(
            f"client {user} has repeated (user, item) pairs in its statistics rows; each pair must appear once"
        )
    if rated.size:
        at = broadcast.catalog.positions(rated, "stats catalog item")
        keys, rows = user_contributions(
            np.full(rated.size, user),
            at,
            rated_labels,
            np.repeat(u, rated.size, axis=0),
            broadcast.counts[at],
            settings=settings,
        )
        positions, a_upper, b = grouped_sums(keys, rows)
        out[positions, : packed_size(plan.dim)] = a_upper
        out[positions, packed_size(plan.dim) :] = b
    return out.reshape(-1)


class ClientRound(beam.DoFn):
    """A client's masked input, or nothing when it drops out after setup (simulated)."""

    def __init__(
        self,
        broadcast: Broadcast,
        settings,
        lambda_u: float,
        plan: Plan,
        *,
        round_secret: bytes,
        graph: dict,
        dropped: frozenset,
    ):
        self.broadcast, self.settings, self.lambda_u, self.plan = broadcast, settings, lambda_u, plan
        self.round_secret, self.graph, self.dropped = round_secret, graph, dropped

    def process(self, element, public_keys):
        user, grouped = element
        if user in self.dropped:
            return
        solve = _concatenated(grouped["solve"])
        if not solve[0].size:
            raise UserError(f"client {user} has statistics rows but no rows to solve its embedding on")
        x = client_contribution(
            user,
            solve,
            _concatenated(grouped["stats"]),
            self.broadcast,
            settings=self.settings,
            lambda_u=self.lambda_u,
            plan=self.plan,
        )
        keys = client_secret(self.round_secret, user)
        encoded = secagg.encode(
            x * (1 - 1e-9), self.plan.scale
        )  # the margin absorbs the float rounding of the clipped norms
        noised = encoded + client_noise(keys, self.plan).view(np.uint64)
        yield user, secagg.masked_input(user, noised, keys, self.graph, public_keys)


def _concatenated(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class RingSum(beam.CombineFn):
    """The sum of uint64 vectors modulo 2^64 (None when there are none)."""

    def create_accumulator(self):
        return None

    def add_input(self, total, vector):
        return vector.copy() if total is None else total + vector

    def merge_accumulators(self, totals):
        present = [t for t in totals if t is not None]
        return None if not present else sum(present[1:], present[0].copy())

    def extract_output(self, total):
        return total


def honest_server(holder: int, survivors: frozenset) -> frozenset:
    """The survivor set the server shows `holder` in the consistency check: an honest server shows
    every holder the true one (a malicious one shows each holder its own)."""
    return survivors


@dataclass(frozen=True)
class PartitioningServer:
    """A simulated malicious server (`--federated-server partition`): it shows each holder the
    survivor set without the neighbours of `victim` whose shares it holds, so the holders would
    reveal those neighbours' keys (every pairwise mask with the victim) while the victim's own
    neighbours, shown sets with the victim, reveal its self-mask: together the victim's vector,
    with only its own 1/n_min share of the noise. The consistency check must stop it."""

    victim: int
    graph: tuple  # (client, its neighbours) pairs

    def __call__(self, holder: int, survivors: frozenset) -> frozenset:
        graph = dict(self.graph)
        return survivors if holder == self.victim else survivors - (set(graph[self.victim]) & set(graph[holder]))


SERVERS = secagg.SERVERS


def simulated_server(kind: str, graph: dict) -> Callable[[int, frozenset], frozenset]:
    """The server a round simulates: honest, or partitioning the holders against the lowest client id."""
    if kind not in SERVERS:
        raise UserError(f"--federated-server must be one of {SERVERS}, got {kind!r}")
    if kind == "honest":
        return honest_server
    return PartitioningServer(min(graph), tuple((client, tuple(near)) for client, near in sorted(graph.items())))


class Reveal(beam.DoFn):
    """A surviving holder's unmasking message: its shares for the survivor set the server showed it
    (secagg.revealed_shares), only if that set passes the consistency check; otherwise its id, to
    the REFUSED output."""

    REFUSED = "refused"

    def __init__(self, server, round_id: bytes, quorum: int):
        self.server, self.round_id, self.quorum = server, round_id, quorum

    def start_bundle(self):
        self.signers = {}  # a set shown to many holders is verified once per bundle (every holder would find the same)

    def process(self, element, alive, signatures, verify_keys):
        holder, held = element
        if holder not in alive:  # dropped out: takes no part in the later rounds
            return
        shown = self.server(holder, alive)
        if shown not in self.signers:
            self.signers[shown] = secagg.valid_signers(shown, self.round_id, signatures, verify_keys)
        if secagg.consistent(holder, shown, self.signers[shown], self.quorum):
            yield from secagg.revealed_shares(holder, dict(held), shown).items()
        else:
            yield beam.pvalue.TaggedOutput(self.REFUSED, holder)


class RoundResult(NamedTuple):
    """What the server holds after a round (round_sums)."""

    masked: np.ndarray  # the sum of the survivors' masked vectors
    corrections: np.ndarray  # the sum of the mask corrections it could rebuild
    survivors: int
    unrecovered: list[int]  # clients whose secret fewer than t neighbours revealed
    revealed: int  # shares revealed
    refusals: int  # surviving holders that revealed nothing: their survivor set failed the consistency check


def _rebuild(element, size: int, graph: dict, public_keys: dict, survivors: set, t: int):
    """One client's revealed shares -> (client, its mask correction), or (client, None) with fewer than t."""
    client, revealed = element
    revealed = list(revealed)
    if len(revealed) < t:
        return client, None
    kind = revealed[0][0]
    secret = secagg.shamir_rebuild({x: share for _, x, share in revealed[:t]})
    return client, secagg.mask_correction(
        client, kind, secret, size=size, graph=graph, public_keys=public_keys, survivors=survivors
    )


@dataclass
class FederatedJob:
    """One outer step's federated release: the central job's tables, settings and budget, plus what
    the clients need to solve their embeddings and the simulated round's dropout."""

    stats: stats_job.StatsJob
    solve_rows: str  # every training row, centred: a client solves its embedding on its own
    item_embeddings: str  # the broadcast
    lambda_u: float
    gravity: float = 0.0
    dropout: float = 0.0  # share of clients that drop out after setup (simulated, drawn from the round seed)
    max_dropout: float = 0.1  # the noise is planned for (1 - max_dropout) n clients
    round_secret: bytes | None = None  # the simulated devices' secrets' root (None: fresh, never stored)
    scratch: str | None = (
        None  # a private folder the workers and this process share (None: a local temporary one, for the DirectRunner)
    )
    server: str | Callable[[int, frozenset], frozenset] = (
        "honest"  # the survivor set the server shows each holder: one of SERVERS (simulated), or a callable
    )


def broadcast_of(job: FederatedJob) -> tuple[np.ndarray, Broadcast]:
    """The stats catalog (sorted ids) and what the distributor sends every client for it."""
    central = job.stats
    catalog = np.sort(storage.read_table(central.items, columns=["item_id"])["item_id"].to_numpy())
    counts = storage.read_table(central.counts).sort_by("item_id")
    count_of = counts["count"].to_numpy()[np.searchsorted(counts["item_id"].to_numpy(), catalog)]
    embeddings = validate_item_embeddings(storage.read_table(job.item_embeddings), dim=central.settings.dim)
    vectors = list_column_to_matrix(embeddings["embedding"], central.settings.dim, "item embedding")
    return catalog, Broadcast(
        (IdIndex(embeddings["item_id"].to_numpy()), vectors),
        job.gravity * vectors.T @ vectors if job.gravity > 0 else None,
        IdIndex(catalog),
        count_of,
    )


def run(job: FederatedJob, pipeline_options: PipelineOptions | None = None) -> dict:
    """Run the round; publish the stats table and release.json; returns the step summary."""
    central = job.stats
    if central.settings.bias:
        raise UserError(
            f"{central.out}: the federated round has no biases yet (its clients solve no bias); prepare the run with "
            "--no-biases"
        )
    if not 0 <= job.dropout < 1:
        raise UserError(f"--federated-dropout must be in [0, 1), got {job.dropout}")
    catalog, broadcast = broadcast_of(job)
    clients = np.unique(
        np.concatenate(
            [batch.column("user_id").to_numpy() for batch in storage.iter_batches(job.solve_rows, columns=["user_id"])]
        )
    )
    if clients.size < 3:
        raise UserError(f"secure aggregation needs at least 3 clients, {job.solve_rows} has {clients.size}")
    ledger = central.privacy.open_ledger(central.ledger_path, central.settings.unit)
    if ledger.budget["accountant"] != ACCOUNTANT and central.privacy.noise_multiplier != 0:
        raise UserError(
            "a federated release is accounted by RDP on integer orders (its Skellam bound's domain): the run's "
            "ledger uses "
            f"{ledger.budget['accountant']!r}; start the run with the federated engine, whose accountant is "
            f"{ACCOUNTANT!r}"
        )
    multiplier = ledger.multipliers["stats"]
    plan = plan_round(central, multiplier, int(clients.size), job.max_dropout, int(catalog.size))
    round_secret = job.round_secret or os.urandom(32)
    round_seed = public_round_seed(round_secret)
    graph = secagg.neighbours(clients, round_seed, plan.neighbours)
    dropped = dropped_clients(clients, round_seed, job.dropout)
    seeds = release.open_seed_file(central.seed_file, central.ledger_path)
    inputs = {
        name: seeds.digest_table(path)
        for name, path in (
            ("interactions", central.interactions),
            ("solve_rows", job.solve_rows),
            ("item_embeddings", job.item_embeddings),
            ("counts", central.counts),
            ("items", central.items),
        )
    }
    release.check_counts_release(
        ledger, seeds, central.counts, inputs["counts"]
    )  # the weights' counts must be this run's release, as centrally
    description = {"settings": central.settings.to_json(), "federated": plan.to_json(), "inputs": inputs}
    index = release.make_release(
        ledger, seeds, central.release_name(0), accounting.gaussian_event(multiplier, 2), description
    )
    logs.log(
        f"federated step {central.step}: release {index}, {plan.clients} clients ({len(dropped)} drop out, at least "
        f"{plan.min_clients} needed), "
        f"{plan.neighbours} neighbours each, fixed-point scale 2^{int(math.log2(plan.scale))}, Skellam multiplier "
        f"{plan.skellam_multiplier:.6g}"
    )
    account = ledger.account()
    with (
        release_lock(ledger.path),
        release_lock(account.path) if account else contextlib.nullcontext(),
    ):  # beside the release's binding
        seeds.start_round(index)  # refused if a round of it ran, whatever became of the output folder
        if account is not None:
            account.start_round(ledger.identity, index)  # and in any copy of the run folder: the account is outside it
    result = round_sums(
        job, broadcast, plan, round_secret=round_secret, graph=graph, dropped=dropped, options=pipeline_options
    )
    if (
        result.survivors < plan.min_clients and not result.revealed
    ):  # the server learned nothing: recorded so, the round may run again
        with release_lock(ledger.path), release_lock(account.path) if account else contextlib.nullcontext():
            seeds.round_unrevealed(index)
            if account is not None:
                account.round_unrevealed(ledger.identity, index)
        raise RoundRefusedError(
            f"federated step {central.step}: {result.survivors} of {plan.clients} clients answered, fewer than the "
            f"{plan.min_clients} the noise is planned for (--federated-max-dropout {job.max_dropout:g}); round "
            "refused, "
            "nothing published (the clients revealed nothing: run the command again)"
        )
    if result.refusals:
        raise RoundRefusedError(
            f"federated step {central.step}: {result.refusals} client(s) revealed nothing, the survivor sets the "
            "server showed "
            "them failed the consistency check; round refused, nothing published"
        )
    if result.unrecovered:
        raise RoundRefusedError(
            f"federated step {central.step}: too few neighbours revealed the secrets of {len(result.unrecovered)} "
            "client(s) "
            f"(e.g. {result.unrecovered[0]}) to unmask the sum; round refused, nothing published"
        )
    total = secagg.decode(result.masked - result.corrections, plan.scale).reshape(plan.items, plan.width)
    p = packed_size(plan.dim)
    spec = NoiseSpec(
        multiplier,
        central.settings.wbar,
        central.settings.clip_u,
        central.settings.clip_y,
        seeds.release_seed(index),
        index,
    )
    storage.remove(storage.join(central.out, stats_job.RELEASE_SUMMARY))
    storage.write_table(
        stats_table(catalog, total[:, :p], total[:, p:], release_metadata(central.settings, spec, 0)),
        stats_job.resample_path(central.out, 0),
    )
    summary = {
        "step": central.step,
        "resamples": 1,
        "releases": [index],
        "noise_multiplier": multiplier,
        "settings": central.settings.to_json(),
        "items": int(catalog.size),
        "epsilon_spent": ledger.epsilon_spent(),
        "ledger": central.ledger_path,
        "federated": {**plan.public_json(), "max_dropout": job.max_dropout, "dp_units": dp_units(central.counts)},
    }  # no exact client count
    storage.write_json(summary, storage.join(central.out, stats_job.RELEASE_SUMMARY))
    return summary


def round_sums(
    job: FederatedJob,
    broadcast: Broadcast,
    plan: Plan,
    *,
    round_secret: bytes,
    graph: dict,
    dropped: frozenset,
    options,
) -> RoundResult:
    """The Beam pipeline of the round. Every survivor signs the survivor set `job.server` shows it,
    and reveals its shares only if that set passes the consistency check (secagg.consistent)."""
    size, t = plan.items * plan.width, secagg.threshold(plan.neighbours)
    settings, round_id = job.stats.settings, public_round_seed(round_secret)
    server = simulated_server(job.server, graph) if isinstance(job.server, str) else job.server
    with tempfile.TemporaryDirectory(prefix="ssp-federated-") as local:
        out = storage.join(job.scratch or local, f".round-{uuid.uuid4().hex}")

        def save(name, value):  # the round's few results, through a file every worker can reach (gs:// on a cluster)
            storage.StagedFile(np.asarray(value).tobytes(), f"{out}-{name}").publish()

        def load(name, dtype):
            fs, inner = storage.filesystem(f"{out}-{name}")
            with fs.open(inner, "rb") as handle:
                values = np.frombuffer(handle.read(), dtype=dtype)
            fs.rm(inner)
            return values

        with beam.Pipeline(options=pinned(options)) as pipeline:
            solve = (
                pipeline
                | "ReadSolveRows" >> ReadTable(job.solve_rows, ["user_id", "item_id", "label"])
                | "SolveByUser" >> beam.FlatMap(rows_by_user)
            )
            stats = (
                pipeline
                | "ReadStatsRows" >> ReadTable(job.stats.interactions, ["user_id", "item_id", "label"])
                | "StatsByUser" >> beam.FlatMap(rows_by_user)
            )
            clients = {"solve": solve, "stats": stats} | "Clients" >> beam.CoGroupByKey()
            keys = clients | "Keys" >> beam.Map(lambda element: (element[0], client_secret(round_secret, element[0])))
            public_keys = keys | "PublicKeys" >> beam.MapTuple(lambda user, k: (user, k.public_key))
            verify_keys = keys | "VerifyKeys" >> beam.MapTuple(lambda user, k: (user, k.verify_key))
            held = (
                keys
                | "SetupShares"
                >> beam.FlatMapTuple(
                    lambda user, k: [
                        (holder, (user, share)) for holder, share in secagg.setup_shares(user, k, graph, t).items()
                    ]
                )
                | "ByHolder" >> beam.GroupByKey()
            )
            masked = clients | "MaskedInput" >> beam.ParDo(
                ClientRound(
                    broadcast, settings, job.lambda_u, plan, round_secret=round_secret, graph=graph, dropped=dropped
                ),
                beam.pvalue.AsDict(public_keys),
            )
            survivors = (
                masked
                | "Survivors" >> beam.Keys()
                | "SurvivorSet" >> beam.combiners.ToList()
                | "AsSet" >> beam.Map(frozenset)
            )
            _ = (
                masked
                | "Vectors" >> beam.Values()
                | "Sum" >> beam.CombineGlobally(RingSum())
                | "SaveSum" >> beam.Map(lambda v: save("sum", v if v is not None else np.zeros(size, np.uint64)))
            )
            _ = survivors | "SaveSurvivors" >> beam.Map(
                lambda alive: save("survivors", np.asarray(sorted(alive), np.int64))
            )
            signatures = (
                masked
                | "Signers" >> beam.Keys()  # each survivor signs the set it was shown; the server forwards them all
                | "SignSurvivors"
                >> beam.Map(
                    lambda user, alive: (
                        user,
                        secagg.sign_survivors(client_secret(round_secret, user), server(user, alive), round_id),
                    ),
                    beam.pvalue.AsSingleton(survivors),
                )
            )
            shares, refusals = held | "Reveal" >> beam.ParDo(
                Reveal(server, round_id, plan.min_clients),
                beam.pvalue.AsSingleton(survivors),
                beam.pvalue.AsDict(signatures),
                beam.pvalue.AsDict(verify_keys),
            ).with_outputs(Reveal.REFUSED, main="shares")
            _ = (
                shares
                | "CountShares" >> beam.combiners.Count.Globally()
                | "SaveRevealed" >> beam.Map(lambda n: save("revealed", np.int64(n)))
            )
            _ = (
                refusals
                | "CountRefusals" >> beam.combiners.Count.Globally()
                | "SaveRefusals" >> beam.Map(lambda n: save("refusals", np.int64(n)))
            )
            rebuilt = (
                shares
                | "ByClient" >> beam.GroupByKey()
                | "Rebuild"
                >> beam.Map(
                    _rebuild, size, graph, beam.pvalue.AsDict(public_keys), beam.pvalue.AsSingleton(survivors), t
                )
            )
            _ = (
                rebuilt
                | "Corrections" >> beam.Values()
                | "Rebuilt" >> beam.Filter(lambda v: v is not None)
                | "SumCorrections" >> beam.CombineGlobally(RingSum())
                | "SaveCorrections"
                >> beam.Map(lambda v: save("corrections", v if v is not None else np.zeros(size, np.uint64)))
            )
            _ = (
                rebuilt
                | "Unmasked" >> beam.Filter(lambda r: r[1] is not None)
                | "UnmaskedIds" >> beam.Keys()
                | "AllUnmasked" >> beam.combiners.ToList()
                | "SaveUnmasked" >> beam.Map(lambda ids: save("unmasked", np.asarray(sorted(ids), np.int64)))
            )
        alive = load("survivors", np.int64)
        missing = np.setdiff1d(
            np.asarray(sorted(graph), np.int64), load("unmasked", np.int64)
        )  # survivors and dropped alike need a correction
        return RoundResult(
            load("sum", np.uint64),
            load("corrections", np.uint64),
            int(alive.size),
            missing.tolist(),
            int(load("revealed", np.int64)[0]),
            int(load("refusals", np.int64)[0]),
        )


class FederatedEngine(BeamEngine):
    """The federated engine (pipelines.engines.engine): the prepare stage and the user update for
    evaluation on Beam (the trusted side's, as for the Beam engine); each statistics release a round
    of this module, `rounds(job)` its FederatedJob (the run's clients, settings and dropout). Its
    clients solve their own embeddings inside the release: no user update before it."""

    name = "federated"
    solves_users_in_release = True

    def __init__(
        self,
        rounds: Callable[[stats_job.StatsJob], FederatedJob] | None,
        options: PipelineOptions | None = None,
        scratch: str | None = None,
    ):
        super().__init__(options, scratch=scratch)
        self.rounds = rounds

    def release_stats(self, job: stats_job.StatsJob) -> dict:
        if self.rounds is None:
            raise UserError(
                "the federated engine releases the statistics of a training run's steps (ssp train --engine "
                "federated), not of explicit tables"
            )
        return run(self.rounds(job), self.options)
