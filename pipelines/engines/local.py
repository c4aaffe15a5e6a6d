"""The local engine: a run's row work in this process, no JVM (pipelines.engines.engine).

For small tables, and what `ssp train` uses for a log under its local threshold whatever the run's
engine. Each operation is the math the Spark engine's tasks run, over the whole table at once: the
split, counts and mean of pipelines.data.splits, pipelines.releases.counts and pipelines.releases.mean;
the statistics release as pipelines.engines.spark_stats's reduce tasks compute it, a shard at a
time (the same tables, bit for bit); the user update as pipelines.engines.user_solves's tasks.

Privacy: reads private interactions and writes private tables into the run directory; the
statistics release is pipelines.releases.stats_job's (noise on every catalog item, through the ledger).
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pyarrow as pa

from pipelines.data import splits
from pipelines.engines import spark_stats, user_solves
from pipelines.releases import train_sums
from pipelines.releases.counts import exact_aggregates, read_rows
from pipelines.releases.mean import CentredOutput, centred, kept, weighted_sums
from pipelines.releases.stats_core import shard_of
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS


class LocalEngine:
    """Every operation of pipelines.engines.engine.Engine, in this process."""

    name = "local"
    solves_users_in_release = False

    def split(self, interactions: str, rule: splits.SplitRule, out: str) -> tuple[dict, int]:
        """`splits.make_split`'s tables of `rule`, written into `out`; returns (sizes, eligible users)."""
        table = storage.read_table(interactions)
        if table.num_rows == 0:
            raise UserError(f"{interactions} has no interactions to split")
        eligible = rule.eligible_users(table) if rule.protocol == "recall" else 0
        parts = rule.apply(table)
        for name, part in parts.items():
            storage.write_table(part, storage.join(out, f"{name}.parquet"))
        return splits.sizes_of(parts), eligible

    def __init__(self):
        self._checked: tuple[str, tuple[np.ndarray, np.ndarray]] | None = (
            None  # the rows the last check read, for the aggregates after it
        )

    def check_count_rows(self, interactions: str, catalog: np.ndarray) -> None:
        """`counts.read_rows`'s refusals; the rows it read are kept for `count_aggregates`."""
        self._checked = (interactions, read_rows(interactions, catalog))

    def count_aggregates(
        self, interactions: str, catalog: np.ndarray, unit: str, max_items_per_user: int, key: int
    ) -> tuple[np.ndarray, int]:
        """`counts.exact_aggregates` of every row (read once: those `check_count_rows` read just before)."""
        checked, self._checked = self._checked, None
        rows = checked[1] if checked is not None and checked[0] == interactions else read_rows(interactions, catalog)
        return exact_aggregates(*rows, catalog, unit, max_items_per_user, key)

    def train_sums(self, interactions: str, request: train_sums.TrainSumsRequest) -> train_sums.TrainSums:
        """The prepare stage's sums (pipelines.releases.train_sums), each operation in turn."""
        return train_sums.one_by_one(self, interactions, request)

    def item_gram_sums(self, interactions: str, items: np.ndarray) -> np.ndarray:
        """`item_gram.item_gram_sums` of every row at once."""
        from pipelines.releases.item_gram import item_gram_sums

        table = storage.read_table(interactions, columns=["user_id", "item_id"])
        return item_gram_sums(table["user_id"].to_numpy(), table["item_id"].to_numpy(), items)

    def mean_sums(
        self, interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float
    ) -> tuple[float, float]:
        """`mean.weighted_sums` of every row."""
        return weighted_sums(interactions, rating_range, unit, user_cap)

    def write_centred(
        self,
        train: str,
        outputs: list[CentredOutput],
        mean: float,
        protocol: str,
        confidence_alpha: float | None = None,
    ) -> None:
        """`mean.centred` over every row of `train`, in one pass, written to each output (a path and
        the items it keeps)."""
        with ExitStack() as stack:
            writers = [
                (stack.enter_context(storage.TableWriter(output.path, INTERACTIONS)), output.keep_items)
                for output in outputs
            ]
            for batch in storage.iter_batches(train):
                every = centred(pa.Table.from_batches([batch]), mean, protocol, None, confidence_alpha)
                for writer, keep_items in writers:
                    writer.write(kept(every, keep_items))

    def release_stats(self, job) -> dict:
        """The statistics release of `job` (pipelines.releases.stats_job.StatsJob): every item shard's
        reduce task of the Spark job, one after another, over the rows read here."""
        specs = job.prepare()
        staged = job.staged_writes()
        lookups = spark_stats.row_lookups(job)
        shards = spark_stats.shard_count(job)
        embeddings, expansion = spark_stats.job_inputs(job)
        users, rated, labels = spark_stats.read_shard(job.units)  # every row: one shard's reader reads them all
        shard = shard_of(rated, shards)
        written = []
        for k in range(shards):
            mine = shard == k
            for record in spark_stats.item_shard(
                job.settings,
                specs,
                staged,
                embeddings=embeddings,
                lookups=lookups,
                shards=shards,
                shard=k,
                rows=(users[mine], rated[mine], labels[mine]),
                expansion=expansion,
            ):
                written += pa.Table.from_batches([record]).to_pylist()
        return spark_stats.commit_written(job, specs, written)

    def user_update(
        self, interactions: str, item_embeddings: str, out: str, solve: user_solves.UserSolve
    ) -> user_solves.Solved:
        """The user update (pipelines.engines.user_solves), with the Spark tasks' bits."""
        return user_solves.run_local(interactions, item_embeddings, out, solve)
