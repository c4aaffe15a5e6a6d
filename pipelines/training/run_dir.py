"""The run directory of `ssp train`: where each stage reads and writes, and the run manifest.

A run is a sequence of stages (prepare; per outer step s: user update, stats release, item update;
final user update; evaluate; publish) that may run in one process (`ssp train`) or as separate
tasks of a scheduler (infra/dags), each given only `--run RUN` (and `--step s`). What makes that
possible is this module: every path of a run is a function of RUN, and `RUN/manifest.json` records
the run's settings once (written by prepare, the one stage given the whole configuration), what
prepare produced (the data set, the catalog the statistics cover, the DP mean) and the steps done.

Privacy: `RUN/private/` holds the secret seed and everything computed from private data without
noise; the manifest itself holds only settings, paths and released values (the DP mean).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from pipelines.base.lock import run_lock
from pipelines.releases.counts import COUNTS_TABLE
from pipelines.training.settings import TrainConfig, check_recorded
from schemas import storage
from schemas.errors import UserError

MANIFEST = "manifest.json"


class Run:
    """The paths of a run directory."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def private(self, *parts: str) -> str:
        return storage.join(self.root, "private", *parts)

    def step(self, s: int, *parts: str) -> str:
        return storage.join(self.root, f"step-{s}", *parts)

    @property
    def manifest_path(self) -> str:
        return self.path(MANIFEST)

    @property
    def ledger(self) -> str:
        return self.path("ledger.parquet")

    @property
    def counts_dir(self) -> str:
        return self.path("counts")

    @property
    def counts(self) -> str:
        return storage.join(self.counts_dir, COUNTS_TABLE)

    @property
    def item_gram_dir(self) -> str:
        """The DP item Gram release (public)."""
        return self.path("item_gram")

    @property
    def centred(self) -> str:
        """The training rows with centred (regression) or unit (ranking) labels: private."""
        return self.private("train_centred.parquet")

    @property
    def stats_rows(self) -> str:
        """The centred rows of the items the statistics cover (what the stats job reads): private."""
        return self.private("stats_rows.parquet")

    @property
    def stats_items(self) -> str:
        """The catalog the statistics cover (public: a function of the items table and the DP counts)."""
        return self.path("train_items.parquet")

    @property
    def split(self) -> str:
        return self.private("split")

    def user_embeddings(self, s: int | None) -> str:
        """Private user embeddings of step s, or the final ones (s None) used for evaluation."""
        return (
            self.private("user_embeddings.parquet")
            if s is None
            else self.private(f"step-{s}", "user_embeddings.parquet")
        )

    def item_embeddings(self, s: int) -> str:
        """The item embeddings after step s (step 0: the initial encoder, public features only)."""
        return self.step(s, "item_embeddings.parquet")

    def checkpoint(self, s: int) -> str:
        """The folder of the encoder's checkpoint after step s (trainer.encoder.write_checkpoint)."""
        return self.step(s, "checkpoint")

    def stats(self, s: int) -> str:
        return self.step(s, "stats")

    def read_manifest(self) -> dict:
        """The manifest; a clear error when RUN holds no run (prepare has not run)."""
        if not storage.exists(self.manifest_path):
            raise storage.MissingTableError(
                f"{self.root} holds no run (no {MANIFEST}); start it with `ssp train --stage prepare --out {self.root} "
                "...`"
            )
        manifest = storage.read_json(self.manifest_path)
        shapes = {"config": dict, "prepared": dict, "steps_done": list}
        wrong = (
            [key for key, kind in shapes.items() if key in manifest and not isinstance(manifest[key], kind)]
            if isinstance(manifest, dict)
            else ["the document"]
        )
        if not wrong and not all(
            isinstance(s, int) and not isinstance(s, bool) for s in manifest.get("steps_done", [])
        ):
            wrong = ["steps_done"]
        if wrong:
            raise UserError(
                f"{self.manifest_path} is damaged: {wrong[0]} is not what `ssp train` records; restore it or start a "
                "new run"
            )
        return manifest

    def prepared(self) -> dict:
        """The manifest of a prepared run (its config and what prepare produced), its recorded
        settings checked as `ssp train` checks flags (a damaged manifest is refused, naming it)."""
        manifest = self.read_manifest()
        if "prepared" not in manifest:
            raise UserError(
                f"{self.root}: the prepare stage has not finished; run `ssp train --stage prepare --out {self.root} "
                "...` first"
            )
        if "config" not in manifest:
            raise UserError(
                f"{self.manifest_path} is damaged: it has no settings (config); restore it or start a new run"
            )
        check_recorded(self.manifest_path, manifest["config"])
        self.require_ledger(manifest["config"].get("seed_file"))
        return manifest

    def require_ledger(self, seed_file: str | None = None) -> None:
        """Refuse a prepared run whose ledger is gone, or lacks releases its seed file saw: those
        releases happened and still count, and a fresh ledger would hand their noise keys out again."""
        from pipelines.releases.release import check_ledger_complete
        from privacy.ledger import Ledger

        if not storage.exists(self.ledger):
            raise UserError(
                f"{self.root}: the run has made releases but its ledger {self.ledger} is missing; those releases still "
                "count, "
                "so it cannot go on: restore the ledger or start a new run"
            )
        check_ledger_complete(Ledger.open(self.ledger), seed_file or self.private("seed"))

    def write_manifest(self, manifest: dict) -> None:
        storage.write_json(manifest, self.manifest_path)

    def record_seconds(
        self, phase: str, seconds: float, kind: str = "seconds", started_at: float | None = None
    ) -> None:
        """Add a stage's wall time to the manifest's `seconds` ({phase: seconds}; a stage that runs
        again after an interruption adds to its figure), or with kind "kernel_seconds" the seconds
        its tasks spent in the stage's kernel (summed over tasks), or with "spark_jobs" the Spark jobs it
        started: where a run's time goes. `started_at` (`time.time()`): when the stage last started,
        in `phase_started_at`, where each stage sits in the run's timeline (the keys are sorted, not
        in run order)."""
        manifest = self.read_manifest()
        timings = manifest.setdefault(kind, {})
        timings[phase] = timings.get(phase, 0.0) + seconds
        if started_at is not None:
            manifest.setdefault("phase_started_at", {})[phase] = started_at
        self.write_manifest(manifest)

    def mark_step_done(self, s: int) -> dict:
        """Record outer step s as complete (its item update is written); returns the manifest."""
        manifest = self.read_manifest()
        manifest["steps_done"] = sorted(set(manifest["steps_done"]) | {s})
        manifest.setdefault("step_done_at", {})[str(s)] = time.time()
        self.write_manifest(manifest)
        return manifest


def require_steps(run: Run, manifest: dict, before: int) -> None:
    """Refuse to start work that needs outer steps 1..before-1 complete."""
    missing = [s for s in range(1, before) if s not in manifest["steps_done"]]
    if missing:
        raise UserError(
            f"{run.root}: outer step {missing[0]} is not done (steps done: {manifest['steps_done'] or 'none'}); "
            f"run its item update (`ssp item-update --run {run.root} --step {missing[0]}`) first"
        )


def config_of(run: Run, manifest: dict) -> TrainConfig:
    """The configuration a prepared run was started with (recorded once, by prepare)."""
    recorded = dict(manifest["config"])
    recorded.setdefault("biases", False)  # recorded before the model had biases: it has none
    recorded.setdefault("user_prior", 0.0)  # recorded before the user ridge had a fixed part
    if manifest.get("prepared", {}).get("dim") is not None:  # as prepare chose it (--dim-from-item-gram)
        recorded["dim"] = manifest["prepared"]["dim"]
    if recorded.pop("unit", "user") != "user":  # recorded by versions that had --unit
        raise UserError(
            f"{run.root} is an example-level run: training has no example-level mode (it was unsound); start a new run"
        )
    return TrainConfig.create(**recorded, out=run.root)


@contextmanager
def existing_run_lock(run_dir: str):
    """`run_lock` for the commands that work on a run prepare started (`--run RUN`): a folder that
    holds no run is refused with the run's own message before the lock would create anything there."""
    Run(run_dir).read_manifest()
    with run_lock(run_dir):
        yield


def catalog_counts(run: Run, space) -> np.ndarray:
    """The run's DP counts release in catalog order (1, the release's floor, for an item it lacks)."""
    table = storage.read_table(run.counts, columns=["item_id", "count"])
    counts = np.ones(space.size)
    counts[space.index_of(table["item_id"].to_numpy())] = table["count"].to_numpy()
    return counts
