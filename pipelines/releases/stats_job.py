"""The stats job's definition, shared by its Spark and Beam engines: flags, input checks, releases.

`StatsJob.prepare()` runs on the driver before any engine work: it validates every input in one
streamed pass (schemas, dimensions, every interaction's user has an embedding and its item is in
the catalog and has a DP count, no duplicate (user, item) pair, and a declared item-shard layout
kept by every row: `ItemShardLayout`), digests the inputs, and makes the
R releases of this step through the ledger (privacy budget) and the seed file (seed binding). The
engine then computes the statistics and writes one part file per shard of each resample's table
through `schemas.storage.StagedWrite`; `commit()` publishes the tables and the step summary.
Nothing is published when any check fails.

Outputs under `--out`: `resample-<k>.parquet` (k = 0..R-1, stats tables) and `release.json`
(written last: release indices, noise multiplier, epsilon spent).

Unit of privacy: the user (default), whose rows' weights have sum of squares <= wbar^2. `--unit
example` (weight 1 per row, sensitivity one row) is sound only when the user embeddings are given
and fixed, i.e. not computed from the same ratings: an embedding solved from a user's ratings (as
`ssp train`'s user update does) changes with any one of them, so removing one rating moves that
user's row in every item's statistics, not just one row. `ssp train` therefore has no example-level
mode; user-level DP implies example-level DP with the same epsilon and delta.

Privacy: every release of the job is recorded in the run's ledger and charged to its data source's
account before its noise is drawn (pipelines.releases.release).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipelines.base import logs
from pipelines.releases import release
from pipelines.releases.pairs import OrderedPairs, PairKeys, files_in_user_order
from pipelines.releases.stats_core import StatsSettings, declared_item_shards, shard_of
from privacy import accounting
from privacy.accumulator import NoiseSpec
from privacy.seeds import SeedFile
from privacy.weights import NormaliserSums
from schemas import SchemaError, storage
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import (
    validate_catalog,
    validate_counts,
    validate_interactions,
    validate_item_embeddings,
    validated_user_batches,
)

RELEASE_SUMMARY = "release.json"


def _validated(path: str, validate, table: pa.Table, **kwargs) -> pa.Table:
    """`validate(table)`, its error prefixed with the table's path."""
    try:
        return validate(table, **kwargs)
    except SchemaError as exc:
        raise SchemaError(exc.table, f"{exc.problem} (in {path})", exc.column, exc.row) from None


def resample_path(out: str, resample: int) -> str:
    return storage.join(out, f"resample-{resample}.parquet")


def stats_tables(out: str) -> list[str]:
    """The committed stats tables of a finished stats step, in resample order."""
    summary = storage.read_json(storage.join(out, RELEASE_SUMMARY))
    return [resample_path(out, k) for k in range(summary["resamples"])]


@dataclass
class StatsJob:
    """One outer step's stats release: inputs, settings, budget, where it goes."""

    interactions: str
    user_embeddings: str
    items: str
    counts: str
    out: str
    settings: StatsSettings
    privacy: release.PrivacySettings
    step: int = 1
    ledger_path: str | None = None
    seed_file: str | None = None
    shards: int = 4
    expansion: str | None = (
        None  # --loss logistic: the item embeddings the quadratic approximation is taken around (public)
    )
    releases: list[NoiseSpec] = field(default_factory=list)
    catalog: np.ndarray | None = None  # sorted catalog item ids, by prepare()
    catalog_counts: np.ndarray | None = None  # their DP counts
    rows: int = 0
    units: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # the interactions' (file, row group, rows), by prepare(): engines' work units
    normalisers: tuple[np.ndarray, np.ndarray] | None = None  # (user ids, sum of n^(2e) over each user's rows)
    unit_shards: tuple[int, np.ndarray] | None = (
        None  # by prepare(), when the files declare it and every row agrees: (S, each unit's item shard of S or -1)
    )
    digests: dict[str, str] = field(default_factory=dict)  # content digests of the inputs, by prepare()

    def __post_init__(self):
        if not isinstance(self.step, int) or self.step < 1:
            raise UserError(f"--step must be a positive integer, got {self.step}")
        if not isinstance(self.shards, int) or self.shards < 1:
            raise UserError(f"--shards must be a positive integer, got {self.shards}")
        release.check_bounds(
            self.settings, noised=self.privacy.noise_multiplier != 0
        )  # infinite clip norms only without noise
        if (self.settings.loss == "logistic") != (self.expansion is not None):
            raise UserError(
                "the logistic loss's statistics need the item embeddings to expand around (and only they do)"
            )
        self.ledger_path = self.ledger_path or storage.join(self.out, "ledger.parquet")

    @classmethod
    def from_args(cls, args: argparse.Namespace, job_of_run=None) -> StatsJob | None:
        """The job the flags describe: a prepared run's own (--run RUN --step S: `job_of_run(RUN, S)`,
        its tables, settings and budget plan from its manifest as `ssp train` runs it, given by the
        entry points: pipelines.training.stats_stage.stats_job_of_run; None when the run's step has
        nothing to release), or one given table by table."""

        def flag(name: str) -> str:
            return "--" + name.replace("_", "-")

        if getattr(args, "run", None):
            given = [flag(name) for name in (*JOB_FLAGS, *BUDGET_FLAGS) if getattr(args, name, None) is not None]
            if given:
                raise UserError(
                    f"with --run the run's manifest gives the tables, settings and budget: drop {', '.join(given)}"
                )
            if args.step is None:
                raise UserError("with --run give --step S, the outer step whose statistics to release")
            if job_of_run is None:
                raise UserError(
                    "--run RUN is taken by `ssp stats`, pipelines/stats.py and python -m pipelines.beam_stats"
                )
            return job_of_run(args.run, args.step)
        missing = [flag(name) for name in JOB_FLAGS if getattr(args, name) is None]
        if missing:
            raise UserError(
                f"give {', '.join(missing)}, or --run RUN --step S for a run prepared by `ssp train --stage prepare`"
            )
        settings = StatsSettings(
            args.dim,
            args.clip_u,
            args.clip_y,
            args.unit,
            args.wbar if args.unit == "user" else 1.0,
            args.weight_exponent,
            bias=args.bias,
            confidence=args.confidence,
        )
        return cls(
            args.interactions,
            args.user_embeddings,
            args.items,
            args.counts,
            args.out,
            settings,
            release.privacy_settings(args),
            1 if args.step is None else args.step,
            args.ledger,
            args.seed_file,
            args.shards,
        )

    def release_name(self, resample: int) -> str:
        return f"step-{self.step}/stats/r{resample}"

    def _check_inputs(self, seeds: SeedFile) -> dict[str, str]:
        """Validate all inputs (one streamed pass over the interactions); return their digests."""
        items = _validated(self.items, validate_catalog, storage.read_table(self.items, columns=["item_id"]))[
            "item_id"
        ].to_numpy()  # unique int64 ids
        self.catalog = np.sort(items)
        counts = _validated(self.counts, validate_counts, storage.read_table(self.counts))
        missing = np.setdiff1d(self.catalog, counts["item_id"].to_numpy())
        if missing.size:
            raise UserError(
                f"{self.counts}: no DP count for {missing.size} catalog item(s) (e.g. {missing[0]}); counts must "
                "cover the catalog"
            )
        embeddings = ThreadPoolExecutor(max_workers=1)  # the user embeddings' checks and digest, beside the rows'
        validated = embeddings.submit(_validated_and_digested, self.user_embeddings, seeds, self.settings.user_dim)
        embeddings.shutdown(wait=False)
        plain = _plain_user_ids(self.user_embeddings)
        known_users = validated.result()[0] if plain is None else plain
        if np.any(known_users[1:] < known_users[:-1]):  # a run's user embeddings come sorted
            known_users = np.sort(known_users)
        count_of = counts.sort_by("item_id")
        self.catalog_counts = count_of["count"].to_numpy()[
            np.searchsorted(count_of["item_id"].to_numpy(), self.catalog)
        ]
        catalog_index, user_index = IdIndex(self.catalog), IdIndex(known_users)
        self.units = storage.row_groups(self.interactions)
        total = sum(rows for _, _, rows in self.units)  # from the files' footers
        normalisers = (
            NormaliserSums(self.catalog_counts, known_users, self.settings.weight_exponent)
            if self.settings.unit == "user" or self.settings.loss == "logistic"
            else None
        )  # the weights' per-user normalisers, for engines that group rows by item
        filled = 0
        layout = ItemShardLayout.of(self.interactions, self.units, self.catalog)
        pairs = (
            OrderedPairs(self.catalog.size, layout.catalog_shard)
            if layout is not None and files_in_user_order(self.interactions)
            else PairKeys(total, known_users.size, self.catalog.size)
        )  # a run's stats rows come in order: no key kept

        def checked_batches():
            nonlocal filled
            for batch in storage.iter_batches(self.interactions, columns=["user_id", "item_id", "label", "timestamp"]):
                table = _validated(self.interactions, validate_interactions, pa.Table.from_batches([batch]))
                users, rated = table["user_id"].to_numpy(), table["item_id"].to_numpy()
                item_positions, in_catalog = catalog_index.lookup(rated)
                if not in_catalog.all():
                    raise UserError(
                        f"{self.interactions}: interactions refer to items missing from the catalog (e.g. "
                        f"{rated[~in_catalog][0]})"
                    )
                user_positions, known = user_index.lookup(users)
                if not known.all():
                    raise UserError(
                        f"{self.user_embeddings}: missing user embeddings for {np.unique(users[~known]).size} "
                        f"user(s) of the interactions (e.g. {users[~known][0]})"
                    )
                pairs.add(user_positions, item_positions)
                if layout is not None:
                    layout.check(item_positions, filled)
                if normalisers is not None:
                    normalisers.add(
                        user_positions,
                        item_positions,
                        table["label"].to_numpy() if self.settings.confidence else None,
                    )
                filled += rated.size
                yield from table.to_batches()

        # the other tables' digests, and reading and checking ahead, beside the digest of the rows (numpy and Arrow
        # release the GIL)
        with pairs, ThreadPoolExecutor(max_workers=1) as pool:
            counts_digest = pool.submit(seeds.digest_table, self.counts)
            interactions_digest = seeds.digest_batches(storage.read_ahead(checked_batches()))
            _, embeddings_digest = validated.result()  # the embeddings' own refusal, if any (their ids were read alone)
            counts_digest = counts_digest.result()
            if filled != total:
                raise UserError(f"{self.interactions}: {filled} rows read where the files' footers declare {total}")
            found = pairs.duplicates()
        repeated, first = found or self._spilled_duplicates(user_index, catalog_index, total)
        if repeated:
            user, item = first
            raise UserError(
                f"{self.interactions}: {repeated} duplicate (user, item) pair(s), e.g. user "
                f"{known_users[user]} item {self.catalog[item]}; "
                "each pair must appear once (its weight bounds the user's contribution)"
            )
        self.rows = filled
        self.unit_shards = layout.result() if layout is not None else None
        if normalisers is not None and self.rows:
            self.normalisers = normalisers.result()
        digests = {
            "interactions": interactions_digest,
            "user_embeddings": embeddings_digest,
            "counts": counts_digest,
            "items": seeds.digest_batches(pa.table({"item_id": self.catalog}).to_batches()),
        }
        if self.expansion is not None:
            expansion = _validated(
                self.expansion, validate_item_embeddings, storage.read_table(self.expansion), dim=self.settings.dim
            )
            missing = np.setdiff1d(self.catalog, expansion["item_id"].to_numpy())
            if missing.size:
                raise UserError(
                    f"{self.expansion}: no expansion point for {missing.size} catalog item(s) (e.g. {missing[0]})"
                )
            digests["expansion"] = seeds.digest_table(self.expansion)
        return digests

    def _spilled_duplicates(self, user_index: IdIndex, catalog_index: IdIndex, total: int) -> tuple:
        """`PairKeys.duplicates` of every row, read again: rows that broke `OrderedPairs`' order."""
        with PairKeys(total, user_index.ids.size, catalog_index.ids.size) as pairs:
            for batch in storage.read_ahead(storage.iter_batches(self.interactions, columns=["user_id", "item_id"])):
                pairs.add(
                    user_index.lookup(batch.column("user_id").to_numpy())[0],
                    catalog_index.lookup(batch.column("item_id").to_numpy())[0],
                )
            return pairs.duplicates()

    def prepare(self) -> list[NoiseSpec]:
        """Check the inputs and make this step's R releases (ledger, seed binding); no output yet."""
        seeds = release.open_seed_file(
            self.seed_file, self.ledger_path
        )  # its digests key the fingerprints (written only when bound)
        self.digests = digests = self._check_inputs(seeds)
        ledger = self.privacy.open_ledger(
            self.ledger_path, self.settings.unit, self.interactions
        )  # a new ledger charges its data source's account
        release.check_counts_release(ledger, seeds, self.counts, digests["counts"])
        multiplier = ledger.multipliers["stats"]
        event = accounting.gaussian_event(multiplier, 2)  # A and b
        description = {"settings": self.settings.to_json(), "inputs": digests}
        self.releases = []
        clip_u, clip_y = self.settings.noise_clips()
        for resample in range(self.privacy.resamples):
            index = release.make_release(ledger, seeds, self.release_name(resample), event, description)
            self.releases.append(
                NoiseSpec(multiplier, self.settings.wbar, clip_u, clip_y, seeds.release_seed(index), index)
            )
        self._ledger = ledger
        logs.log(
            f"stats step {self.step}: releases {[spec.release for spec in self.releases]}, noise multiplier "
            f"{multiplier:.4g}, "
            f"epsilon spent {ledger.epsilon_recorded():.4g} of {ledger.budget['epsilon']:g}"
        )
        return self.releases

    def staged_writes(self) -> list[storage.StagedWrite]:
        """One staged table per resample (picklable, for the workers)."""
        if not hasattr(self, "_staged"):
            self._staged = [storage.StagedWrite(resample_path(self.out, k)) for k in range(len(self.releases))]
        return self._staged

    def commit(self, written: list[list[str]], rows: list[int]) -> dict:
        """Publish each resample's parts, then the step summary; returns the summary."""
        storage.remove(storage.join(self.out, RELEASE_SUMMARY))
        if any(count != self.catalog.size for count in rows):
            for staged, names in zip(self.staged_writes(), written, strict=False):
                staged.abort(names)
            raise RuntimeError(
                f"stats for {rows} items written, expected every catalog item ({self.catalog.size}) in each table"
            )
        for staged, names, count in zip(self.staged_writes(), written, rows, strict=True):
            staged.commit(names, count)
        summary = {
            "step": self.step,
            "resamples": len(self.releases),
            "releases": [spec.release for spec in self.releases],
            "noise_multiplier": self.releases[0].noise_multiplier,
            "settings": self.settings.to_json(),
            "items": int(self.catalog.size),
            "epsilon_spent": self._ledger.epsilon_recorded(),
            "ledger": self.ledger_path,
        }
        storage.write_json(summary, storage.join(self.out, RELEASE_SUMMARY))
        return summary


def _validated_and_digested(path: str, seeds: SeedFile, dim: int) -> tuple[np.ndarray, str]:
    """(the user ids, the keyed digest) of user embeddings in one streamed read: each batch, as
    stored, passes to the digest once `validated_user_batches` has checked it (errors name the path)."""
    stored: list[pa.RecordBatch] = []
    ids: list[np.ndarray] = []

    def read():
        for batch in storage.iter_batches(path):
            stored.append(batch)
            yield batch

    def checked():
        for table in validated_user_batches(read(), dim):
            ids.append(table["user_id"].to_numpy())
            yield stored.pop()

    digest = _validated(path, seeds.digest_batches, checked())
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), digest


def _plain_user_ids(path: str) -> np.ndarray | None:
    """The user_id column of user embeddings read alone, when it is int64 without nulls (else None:
    `_validated_and_digested` reads the whole table and names the problem)."""
    if not storage.table_files(path):
        return None
    schema = storage.read_schema(path)
    if "user_id" not in schema.names or schema.field("user_id").type != pa.int64():
        return None
    ids = storage.read_table(path, columns=["user_id"])["user_id"]
    return None if ids.null_count else ids.to_numpy()


class ItemShardLayout:
    """The check of a table's declared layout (stats_core.ITEM_SHARDS: each row group one item shard
    of S) against its rows, as prepare() reads them: kept only if every row agrees, so that an engine
    may give each shard's row groups to a task as they are, with no shuffle."""

    def __init__(self, shards: int, units: list[tuple[str, int, int]], catalog: np.ndarray):
        self.shards = shards
        self.ends = np.cumsum([rows for _, _, rows in units])  # each unit's end, in rows read
        self.of_unit = np.full(len(units), -1)
        self.catalog_shard = shard_of(catalog, shards)
        self.agrees = True

    @classmethod
    def of(cls, path: str, units: list[tuple[str, int, int]], catalog: np.ndarray) -> ItemShardLayout | None:
        shards = declared_item_shards(path)
        return None if shards is None else cls(shards, units, catalog)

    def check(self, item_positions: np.ndarray, start: int) -> None:
        """The rows start, start + 1, ... (in `row_groups` order), by their items' catalog positions."""
        shard = self.catalog_shard[item_positions]
        first = int(np.searchsorted(self.ends, start, side="right"))
        inside = self.ends[first : int(np.searchsorted(self.ends, start + shard.size, side="left"))] - start
        for unit, part in enumerate(np.split(shard, inside), start=first):
            if part.size:
                low = part.min()
                self.agrees &= bool(low == part.max() and self.of_unit[unit] in (-1, low))
                self.of_unit[unit] = low

    def result(self) -> tuple[int, np.ndarray] | None:
        if not self.agrees:
            logs.warn(
                "the interactions' files declare item shards their rows do not keep: reading them through a shuffle"
            )
        return (self.shards, self.of_unit) if self.agrees else None


JOB_FLAGS = (
    "interactions",
    "user_embeddings",
    "items",
    "counts",
    "out",
    "dim",
    "clip_u",
    "clip_y",
)  # without --run: required
BUDGET_FLAGS = (
    "epsilon",
    "noise_multiplier",
    "ledger",
    "seed_file",
    "budget_account",
    "account_cap",
    "account_window_days",
)  # with --run: the run's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The stats job's flags (both engines): --run RUN --step S, or the tables and settings by hand."""
    parser.add_argument(
        "--run",
        help="a run prepared by `ssp train --stage prepare`: its tables, settings and budget plan come from its "
        "manifest, as `ssp train` would run this job (give only --step; the flags below are for a job outside a run)",
    )
    parser.add_argument("--interactions", help="interactions table (private; required without --run)")
    parser.add_argument(
        "--user-embeddings",
        help="user embeddings table (private): user_id, embedding of length --dim (d + 1 with --bias; required "
        "without --run)",
    )
    parser.add_argument(
        "--items", help="items table: the public catalog; every item gets a noised row (required without --run)"
    )
    parser.add_argument(
        "--counts", help="DP item counts table (a release of `ssp counts`), for the weights (required without --run)"
    )
    parser.add_argument("--out", help="output folder: resample-<k>.parquet and release.json (required without --run)")
    parser.add_argument(
        "--dim",
        type=int,
        help="dimension d of the released statistics (required without --run; with --bias, d - 1 embedding "
        "coordinates and the bias)",
    )
    parser.add_argument(
        "--clip-u", type=float, help="Gamma_u: user embeddings are clipped to this L2 norm (required without --run)"
    )
    parser.add_argument(
        "--clip-y", type=float, help="Gamma_y: labels are clipped to [-Gamma_y, Gamma_y] (required without --run)"
    )
    parser.add_argument(
        "--unit",
        choices=("user", "example"),
        default="user",
        help="unit of privacy (default: %(default)s). example is sound only when --user-embeddings are given and "
        "fixed, "
        "not computed from these ratings (as the user update of `ssp train` computes them): a user's embedding "
        "depends on "
        "all of the user's ratings, so one rating moves the user's row in every item's statistics",
    )
    parser.add_argument(
        "--wbar",
        type=float,
        default=1.0,
        help="user level: bound on each user's sum of squared weights, squared root (default: %(default)s)",
    )
    parser.add_argument(
        "--weight-exponent",
        type=float,
        default=-0.25,
        help="weights grow as DP count^exponent (0: uniform; default: %(default)s)",
    )
    parser.add_argument(
        "--bias",
        type=float,
        default=0.0,
        metavar="C",
        help="> 0: user vectors are [u, 1, b_u] (d + 1 values): release [Clip(u), C x clip_u] with labels y - b_u, "
        "so each item's "
        "bias is fitted with its embedding (default: 0, no biases)",
    )
    parser.add_argument(
        "--confidence",
        action="store_true",
        help="the labels are each row's confidence (the ranking protocol: implicit "
        "feedback's repeats): a row weighs its confidence within its user's weight budget, with label 1 (default: "
        "labels are labels)",
    )
    parser.add_argument(
        "--step", type=int, help="outer step this release belongs to (default: 1; with --run: required)"
    )
    parser.add_argument("--shards", type=int, default=4, help="part files per stats table (default: %(default)s)")
    release.add_privacy_arguments(parser)


def run_and_report(compute) -> int:
    """An engine's entry point: run `compute()` (returns the step summary, or None when a run's step
    has nothing to release), print it; bad input is one line on stderr and exit status 2."""
    try:
        summary = compute()
    except (ValueError, storage.MissingTableError) as exc:
        print(f"stats: error: {exc}", file=sys.stderr)
        return 2
    if summary is not None:
        print(describe(summary))
    return 0


def describe(summary: dict) -> str:
    return (
        f"stats step {summary['step']}: {summary['resamples']} table(s) of {summary['items']:,} items, releases "
        f"{summary['releases']}, "
        f"noise multiplier {summary['noise_multiplier']:.4g}; epsilon spent {summary['epsilon_spent']:.4g} (ledger "
        f"{summary['ledger']})"
    )
