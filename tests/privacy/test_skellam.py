"""Skellam shares and their accounting: the shares sum to the calibrated noise, the bound is the
paper's formula, and the recorded Gaussian is no more private than the Skellam at every integer order."""

import math

import numpy as np
import pytest

from privacy import accounting, skellam


def test_the_rdp_bound_is_agarwal_et_al_theorem_3_5_by_hand():
    # order 3, D1 = 10, D2 = 2, mu = 8: 3*4/16 + min((5*4 + 60)/256, 30/16) = 0.75 + 0.3125
    assert skellam.rdp(3, 10.0, 2.0, 8.0) == pytest.approx(1.0625)
    # mu = 1: the second branch 3*D1/(2 mu) = 15 wins the min over (20 + 60)/4 = 20
    assert skellam.rdp(3, 10.0, 2.0, 1.0) == pytest.approx(3 * 4 / 2 + 15)


@pytest.mark.parametrize("z, l2", [(0.5, 2.0**20), (2.0, 2.0**30), (1.3, 300.0)])
def test_the_skellam_multiplier_is_the_smallest_that_dominates_the_gaussian_at_every_integer_order(z, l2):
    parts = [(l2 * math.sqrt(1000), l2), (l2 * 30, l2 / 3)]
    z_s = skellam.skellam_multiplier(z, parts)
    assert z_s >= z and skellam.dominates(z_s, z, parts) and not skellam.dominates(z_s * (1 - 1e-9), z, parts)
    for l1, sens in parts:
        for order in accounting.INTEGER_ORDERS:
            assert skellam.rdp(order, l1, sens, (z_s * sens) ** 2) <= order / (2 * z**2)
    if l2 >= 2.0**20:  # at fixed-point scale the correction is negligible
        assert z_s / z - 1 < 1e-9


def test_sensitivities_too_small_for_integer_noise_are_refused():
    with pytest.raises(ValueError, match="raise the fixed-point scale"):
        skellam.skellam_multiplier(10.0, [(1e6, 1.0)])  # a huge L1 at unit L2: the correction outweighs any z_s <= 2z


def test_shares_sum_to_skellam_noise_of_the_total_variance():
    rng = np.random.default_rng(1)
    total = sum(skellam.shares(200_000, 50.0, rng) for _ in range(8))
    assert total.dtype == np.int64
    assert abs(total.mean()) < 0.1 and total.var() == pytest.approx(400.0, rel=0.02)
    # Sk(400): P(0) = e^-400 I_0(400), about 0.01994
    assert np.mean(total == 0) == pytest.approx(0.01994, rel=0.05)


def test_integer_orders_only_ever_overstate_epsilon():
    events = [accounting.gaussian_event(1.7, 2), accounting.gaussian_event(3.0)]
    assert accounting.epsilon_of(events, 1e-5, "rdp-integer") >= accounting.epsilon_of(events, 1e-5, "rdp")
    z = accounting.calibrate(5.0, 1e-5, accounting.stats_plan(2), "rdp-integer")
    assert accounting.epsilon_of(accounting.plan_events(z, accounting.stats_plan(2)), 1e-5, "rdp-integer") <= 5.0


def test_a_share_too_large_for_the_sampler_is_refused():
    with pytest.raises(ValueError, match="lower the fixed-point scale"):
        skellam.shares(3, 2.0**63, np.random.default_rng(0))
