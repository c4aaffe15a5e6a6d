"""The users' Gram matrix G = sum_k x_k x_k^T, released once per outer step, over the rows the
statistics use: x_k = Clip(u_k), or with biases [Clip(u_k), c] (stats_core.biased_user_rows).

Implicit feedback (the ranking protocol trains on positives only) needs a penalty on the scores of
unobserved items, the "gravity" of implicit ALS: alpha * sum_k (x_k . v_j)^2 = alpha v_j^T G v_j for
every item j (with biases v_j holds the item's bias too, and G's corner entry is c^2 times the
number of users). G is a sum over users of one clipped term each, so removing a user changes it by
at most rho^2 (Frobenius; rho = Gamma_u, or sqrt(1 + k^2) Gamma_u with biases): one Gaussian release
with the run's "gram" noise multiplier (Sym noise on the packed upper triangle, as for A_j),
projected onto the PSD cone (post-processing).

Privacy: reads private user embeddings; releases one noised d x d matrix through the ledger.
"""

from __future__ import annotations

import numpy as np

from pipelines.base import logs
from pipelines.releases import release
from pipelines.releases.stats_core import StatsSettings, biased_user_rows
from privacy import accounting
from privacy.accumulator import pack_upper, project_psd, unpack_upper
from privacy.clipping import clip_rows
from privacy.ledger import Ledger
from privacy.noise import add_noise, standard_normal
from privacy.seeds import SeedFile
from schemas import storage
from schemas.arrays import list_column_to_matrix


def dp_gram(user_embeddings: str, ledger: Ledger, seeds: SeedFile, settings: StatsSettings, step: int) -> np.ndarray:
    """Release the Gram matrix of step `step`'s user embeddings, over the statistics' rows of
    `settings` (its d and clip; with its bias coordinate, the users are [u, 1, b_u] and the rows
    [Clip(u), c]); returns it (d x d, PSD). The embeddings are streamed: memory grows with d, not
    with the number of users."""
    dim, bias = settings.dim, bool(settings.bias)
    gram = np.zeros((dim, dim))
    for batch in storage.iter_batches(user_embeddings, columns=["embedding"]):
        u = list_column_to_matrix(batch.column("embedding"), dim + 1 if bias else dim, "user embedding")
        x = biased_user_rows(u, settings)[0] if bias else clip_rows(u, settings.clip_u)
        gram += x.T @ x
    multiplier = ledger.multipliers.get("gram", 0.0)
    rho = settings.noise_clips()[0] if bias else settings.clip_u  # the rows' norm bound
    description = {
        "clip_u": settings.clip_u,
        "dim": dim,
        "bias": float(settings.bias),
        "inputs": {"user_embeddings": seeds.digest_table(user_embeddings)},
    }
    index = release.make_release(ledger, seeds, f"step-{step}/gram", accounting.gaussian_event(multiplier), description)
    packed = pack_upper(gram)
    if multiplier > 0:
        packed = add_noise(
            standard_normal(seeds.release_seed(index), index, np.array([0]), packed.size)[0],
            multiplier * rho**2,
            packed,
        )  # on the noise's grid
    logs.log(f"gram step {step}: release {index}, noise multiplier {multiplier:.4g}")
    return unpack_upper(project_psd(packed[None, :], dim)[0], dim)
