"""`ssp audit --plant`: known defects patched into the product, in this process and in Spark's Python workers.

A plant replaces functions of the product at the place where the release code looks them up, for
the duration of an audit only; the audit must then exit 1 (bench/audit.py). Each defect is planted
where the real code of that step runs: the noise, the clips and the weights of the statistics run
in the stats job's item tasks (Spark's Python workers, or this process on the local engine), the
counts', mean's, Gram's and item Gram's noise on the driver, the item Gram's rows where its sums
run (Spark's Python workers, or this process), the federated clients' Skellam shares in the
round's client step and DP-SGD's noise in the item update (both in this process: Beam's
DirectRunner runs the round here, TensorFlow the item update). `install` patches the process it runs in;
`worker_hook` writes a `sitecustomize.py` that runs `install` in every Python process started with
the folder on PYTHONPATH and $SSP_AUDIT_PLANT set: the audit puts both in the environment of the
JVM it starts, so Spark's Python workers (forked from its daemon, which imports sitecustomize) run
the planted code too. `installed()` says which plant a process holds (the audit asks a worker).

Privacy: none; a plant exists only in an audit's processes, never in a normal run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

ENV = "SSP_AUDIT_PLANT"
DEFECTS = {
    "bias-noise": "the statistics' noise scaled to clip_u, not sqrt(1 + k^2) clip_u, with the bias coordinate",
    "embedding-clip": "the user embeddings not clipped (statistics and Gram)",
    "label-clip": "the labels not clipped",
    "weights": "the user-level weights not normalised (every row weight wbar)",
    "halved-noise": "the counts', mean's, Gram's and central statistics' noise halved while the ledger records the "
    "calibrated multipliers",
    "shared-noise": "every statistics release draws the same noise",
    "seed-copy": "noise keyed by the seed and release index only (a copied run folder draws the same noise)",
    "skellam-noise": "every federated client's Skellam share at half its planned std (a quarter of its variance)",
    "dpsgd-noise": "DP-SGD's gradients not noised while the ledger records the planned multiplier",
    "item-gram-noise": "the item Gram's noise halved while the ledger records the planned multiplier",
    "item-gram-norm": "each user's row over the item Gram's items not scaled to unit norm (1 on each item)",
}
SHARED_KEY = b"\x00" * 32  # shared-noise: the one noise key of every statistics release

_installed: list = []  # (defect, undo functions) of this process


def installed() -> str | None:
    """The defect planted in this process, or None."""
    return _installed[0][0] if _installed else None


def _patches(defect: str) -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) of the defect."""
    from pipelines.engines import spark_stats
    from pipelines.releases import counts, gram, item_gram, mean, stats_core
    from privacy import accumulator
    from privacy.accumulator import packed_size
    from privacy.noise import add_noise
    from privacy.seeds import SeedFile

    finalize, item_shard = accumulator.finalize, spark_stats.item_shard
    if defect == "halved-noise":

        def halved(z, std, *args, **kwargs):
            return add_noise(z, std / 2, *args, **kwargs)

        def finalize_halved(item_ids, a_upper, b, spec, at=None):
            return finalize(
                item_ids, a_upper, b, dataclasses.replace(spec, noise_multiplier=spec.noise_multiplier / 2), at
            )

        return [
            (counts, "add_noise", halved),
            (mean, "add_noise", halved),
            (gram, "add_noise", halved),
            (accumulator, "finalize", finalize_halved),
        ]
    if defect == "shared-noise":

        def finalize_shared(item_ids, a_upper, b, spec, at=None):
            return finalize(item_ids, a_upper, b, dataclasses.replace(spec, seed=SHARED_KEY, release=0), at)

        return [(accumulator, "finalize", finalize_shared)]
    if defect == "skellam-noise":  # Beam and TensorFlow imported only for the plants that need them
        from pipelines.engines import federated

        client_noise = federated.client_noise

        def quarter_variance(keys, plan):
            return client_noise(
                keys, dataclasses.replace(plan, share_variance=tuple(v / 4 for v in plan.share_variance))
            )

        return [(federated, "client_noise", quarter_variance)]
    if defect == "dpsgd-noise":
        from trainer import dpsgd

        make_step = dpsgd._make_step

        def noiseless(model, config, noise_multiplier, *args):
            return make_step(model, config, 0.0, *args)

        return [(dpsgd, "_make_step", noiseless)]
    if defect == "item-gram-noise":
        return [(item_gram, "add_noise", lambda z, std, *args, **kwargs: add_noise(z, std / 2, *args, **kwargs))]
    if defect == "item-gram-norm":
        sums = item_gram.item_gram_sums

        def unscaled(users, item_ids, items):
            """The sums with each user's row multiplied back by sqrt(n_u): 1 on each of its n_u items."""
            users, item_ids = np.asarray(users, np.int64), np.asarray(item_ids, np.int64)
            listed = np.isin(item_ids, items)
            pairs = np.unique(np.stack([users[listed], item_ids[listed]]), axis=1)
            owners, n = np.unique(pairs[0], return_counts=True)
            per_row = n[np.searchsorted(owners, pairs[0])]
            total = np.zeros(packed_size(np.size(items)))
            for k in np.unique(per_row):
                total += k * sums(pairs[0][per_row == k], pairs[1][per_row == k], items)
            return total

        return [(item_gram, "item_gram_sums", unscaled)]
    if defect == "seed-copy":
        return [(SeedFile, "release_seed", lambda self, index: self.seed)]
    if defect == "bias-noise":

        def item_shard_unbiased(settings, specs, *args, **kwargs):
            if settings.bias:
                specs = [dataclasses.replace(spec, clip_u=settings.clip_u) for spec in specs]
            return item_shard(settings, specs, *args, **kwargs)

        return [(spark_stats, "item_shard", item_shard_unbiased)]
    if defect == "embedding-clip":

        def no_scales(vectors, clip):
            return np.ones(np.shape(vectors)[0])

        def unclipped_into(x, bound, out, head_bound=None, constant=0.0):
            head = out.shape[1] - (0 if head_bound is None else 1)
            out[:, :head] = x[:, :head]
            if head_bound is not None:
                out[:, head] = constant
            return out

        return [
            (stats_core, "row_scales", no_scales),
            (stats_core, "clip_rows_into", unclipped_into),
            (gram, "clip_rows", lambda rows, clip: np.asarray(rows, dtype=np.float64)),
        ]
    if defect == "label-clip":
        return [(stats_core, "clip_labels", lambda labels, clip: np.asarray(labels, dtype=np.float64))]
    if defect == "weights":

        def flat(row_counts, *args, **kwargs):
            wbar = args[1] if len(args) > 1 else kwargs.get("wbar", 1.0)
            return np.full(np.shape(row_counts)[0], float(wbar))

        def flat_user(user_ids, row_counts, wbar, *args, **kwargs):
            return np.full(np.shape(row_counts)[0], float(wbar))

        return [(stats_core, "weights_from_normalisers", flat), (stats_core, "user_level_weights", flat_user)]
    raise ValueError(f"unknown plant {defect!r}; one of {tuple(DEFECTS)}")


def install(defect: str):
    """Plant `defect` in this process (until `uninstall`)."""
    if _installed:
        raise RuntimeError(f"a plant is already installed: {installed()}")
    undo = []
    for target, name, replacement in _patches(defect):
        undo.append((target, name, target.__dict__.get(name)))
        setattr(target, name, replacement)
    _installed.append((defect, undo))


def uninstall() -> None:
    while _installed:
        _, undo = _installed.pop()
        for target, name, original in reversed(undo):
            setattr(target, name, original)


@contextlib.contextmanager
def planted(defect: str | None):
    """The product with `defect` planted in this process for the block (nothing for None)."""
    if defect is None:
        yield
        return
    install(defect)
    try:
        yield
    finally:
        uninstall()


SITECUSTOMIZE = """\
# written by bench/audit_plants.py for one `ssp audit --plant` run: plants the defect in this Python process
import os
import sys

if os.environ.get("SSP_AUDIT_PLANT"):
    try:
        from bench import audit_plants

        audit_plants.install(os.environ["SSP_AUDIT_PLANT"])
    except Exception as exc:  # a worker that cannot plant says so; the audit's probe refuses the run
        sys.stderr.write(f"ssp audit: plant not installed in {sys.argv[:1]}: {exc!r}\\n")
"""


def worker_hook(folder: str) -> str:
    """Write the sitecustomize.py that plants $SSP_AUDIT_PLANT into `folder`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as out:
        out.write(SITECUSTOMIZE)
    return folder


def worker_plant(spark) -> str | None:
    """The plant one of `spark`'s Python workers holds (a one-task job)."""

    def probe(_):
        from bench import audit_plants

        yield audit_plants.installed()

    return spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()[0]
