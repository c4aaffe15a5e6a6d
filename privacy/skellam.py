"""Distributed noise: Skellam shares whose sum is exactly the calibrated noise, and its accounting.

Agarwal, Kairouz and Liu 2021 (the Skellam mechanism): clients that each add Sk(mu / n_min) to their
integer (fixed-point) vector give, summed by secure aggregation over n >= n_min survivors, exactly
Sk(n mu / n_min), at least the calibrated Sk(mu). `skellam_multiplier` finds the multiplier z_s whose
Skellam is, at every integer RDP order (accounting.INTEGER_ORDERS), no less private than the Gaussian
of multiplier z that the ledger records. Sampler: numpy's Poisson from a per-client PCG64 stream (a
deployment would use an exact integer sampler and the device's cryptographic generator).
docs/secure-aggregation.md ("Distributed noise") has the bound (their Theorem 3.5) and why it holds.

Privacy: no party sees a sum with less noise than Sk(mu): each vector is masked, the only sum anyone
sees is the total, and a round proceeds only with at least n_min of the planned clients
(pipelines.engines.federated refuses it otherwise). The run's accountant ('rdp-integer') composes the
recorded Gaussian on integer orders: an upper bound on the run's epsilon.
"""

from __future__ import annotations

import numpy as np

from privacy.accounting import INTEGER_ORDERS
from schemas.errors import UserError

MAX_SHARE_VARIANCE = 2.0**62  # numpy's Poisson takes means below about 9.2e18


def rdp(order: int, l1: float, l2: float, variance: float) -> float:
    """The Skellam mechanism's RDP at integer `order` > 1 (Agarwal et al. 2021, Theorem 3.5)."""
    return order * l2**2 / (2 * variance) + min(
        ((2 * order - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance)
    )


def dominates(skellam_multiplier: float, multiplier: float, parts: list[tuple[float, float]]) -> bool:
    """Whether Skellam noise of std skellam_multiplier * D2 on each part (L1, L2 sensitivities) is,
    at every integer order, at most as private-costly as a Gaussian of `multiplier` per part."""
    return all(
        rdp(a, l1, l2, (skellam_multiplier * l2) ** 2) <= a / (2 * multiplier**2)
        for l1, l2 in parts
        for a in INTEGER_ORDERS
    )


def skellam_multiplier(multiplier: float, parts: list[tuple[float, float]]) -> float:
    """The smallest z_s >= z (to 1e-12 relative) whose Skellam dominates the Gaussian of multiplier z
    on every part (`dominates`); refused when even 2z does not (sensitivities too small for integers)."""
    if not dominates(2 * multiplier, multiplier, parts):
        raise UserError(
            f"Skellam noise cannot match a Gaussian of noise multiplier {multiplier:g} at sensitivities {parts}: "
            "raise the fixed-point scale"
        )
    low, high = 1.0, 2.0
    while high - low > 1e-12:
        middle = (low + high) / 2
        low, high = (low, middle) if dominates(middle * multiplier, multiplier, parts) else (middle, high)
    return high * multiplier


def shares(size: int, variance: float, rng: np.random.Generator) -> np.ndarray:
    """One client's share: `size` i.i.d. Sk(variance) integers."""
    if not 0 <= variance <= MAX_SHARE_VARIANCE:
        raise UserError(
            f"a Skellam share's variance must be in [0, 2^62], got {variance:g}: lower the fixed-point scale"
        )
    if variance == 0:
        return np.zeros(size, dtype=np.int64)
    return rng.poisson(variance / 2, size).astype(np.int64) - rng.poisson(variance / 2, size).astype(np.int64)
