"""The users' Gram matrix G = sum_k Clip(u_k) Clip(u_k)^T, released once per outer step.

Implicit feedback (the ranking protocol trains on positives only) needs a penalty on the scores of
unobserved items, the "gravity" of implicit ALS: alpha * sum_k (u_k . v_j)^2 = alpha v_j^T G v_j for
every item j. G is a sum over users of one clipped term each, so removing a user changes it by at
most Gamma_u^2 (Frobenius): one Gaussian release with the run's "gram" noise multiplier (Sym noise
on the packed upper triangle, as for A_j), projected onto the PSD cone (post-processing).

Privacy: reads private user embeddings; releases one noised d x d matrix through the ledger.
"""

from __future__ import annotations

import numpy as np

from pipelines.base import logs
from pipelines.releases import release
from privacy import accounting
from privacy.accumulator import pack_upper, project_psd, unpack_upper
from privacy.clipping import clip_rows
from privacy.ledger import Ledger
from privacy.noise import add_noise, standard_normal
from privacy.seeds import SeedFile
from schemas import storage
from schemas.arrays import list_column_to_matrix


def dp_gram(user_embeddings: str, ledger: Ledger, seeds: SeedFile, dim: int, clip_u: float, step: int) -> np.ndarray:
    """Release the Gram matrix of step `step`'s user embeddings; returns it (d x d, PSD). The
    embeddings are streamed: memory grows with d, not with the number of users."""
    gram = np.zeros((dim, dim))
    for batch in storage.iter_batches(user_embeddings, columns=["embedding"]):
        u = clip_rows(list_column_to_matrix(batch.column("embedding"), dim, "user embedding"), clip_u)
        gram += u.T @ u
    multiplier = ledger.budget["multipliers"].get("gram", 0.0)
    description = {"clip_u": clip_u, "dim": dim, "inputs": {"user_embeddings": seeds.digest_table(user_embeddings)}}
    index = release.make_release(ledger, seeds, f"step-{step}/gram", accounting.gaussian_event(multiplier), description)
    packed = pack_upper(gram)
    if multiplier > 0:
        packed = add_noise(standard_normal(seeds.release_seed(index), index, np.array([0]), packed.size)[0], multiplier * clip_u**2, packed)  # on the noise's grid
    logs.log(f"gram step {step}: release {index}, noise multiplier {multiplier:.4g}")
    return unpack_upper(project_psd(packed[None, :], dim)[0], dim)
