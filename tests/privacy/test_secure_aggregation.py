"""Secure aggregation's arithmetic: masks cancel, dropped clients' masks are recovered from Shamir
shares, a single input reveals nothing, and fixed point never grows a vector."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from privacy import secure_aggregation as secagg


def clients_with_keys(n, seed=b"s" * 32):
    ids = list(range(10, 10 + 3 * n, 3))
    keys = {i: secagg.ClientKeys(secagg.derive(seed, i.to_bytes(8, "big"))) for i in ids}
    return ids, keys, {i: k.public_key for i, k in keys.items()}


def run_round(n, dropped=frozenset(), size=50, k=None):
    """Every step of the protocol by hand: returns (the server's unmasked sum, the survivors' sum of x)."""
    ids, keys, public = clients_with_keys(n)
    graph = secagg.neighbours(np.array(ids), b"round", k)
    t = secagg.threshold(len(graph[ids[0]]))
    held = {i: {} for i in ids}
    for i in ids:
        for holder, share in secagg.setup_shares(i, keys[i], graph, t).items():
            held[holder][i] = share
    rng = np.random.default_rng(0)
    x = {i: secagg.encode(rng.normal(size=size), 2.0**20) for i in ids}
    survivors = set(ids) - set(dropped)
    masked = sum((secagg.masked_input(i, x[i], keys[i], graph, public) for i in survivors), np.zeros(size, np.uint64))
    revealed = {}
    for holder in survivors:
        for client, item in secagg.revealed_shares(holder, held[holder], survivors).items():
            revealed.setdefault(client, []).append(item)
    correction = np.zeros(size, np.uint64)
    for client in ids:
        kinds = {kind for kind, _, _ in revealed[client]}
        assert kinds == {"mask" if client in survivors else "key"}  # never both secrets of one client
        secret = secagg.shamir_rebuild({x_: share for _, x_, share in revealed[client][:t]})
        correction = correction + secagg.mask_correction(client, kinds.pop(), secret, size, graph, public, survivors)
    return masked - correction, sum((x[i] for i in survivors), np.zeros(size, np.uint64))


@pytest.mark.parametrize("n, dropped", [(3, ()), (12, ()), (40, ()), (40, (13, 40, 100)), (12, (19,))])
def test_the_server_recovers_exactly_the_survivors_sum(n, dropped):
    unmasked, expected = run_round(n, frozenset(dropped))
    np.testing.assert_array_equal(unmasked, expected)


def test_one_masked_input_looks_nothing_like_its_vector():
    ids, keys, public = clients_with_keys(8)
    graph = secagg.neighbours(np.array(ids), b"round")
    x = secagg.encode(np.ones(2000), 2.0**20)
    y = secagg.masked_input(ids[0], x, keys[ids[0]], graph, public)
    assert not np.any(y == x)
    top_bits = (y >> np.uint64(60)).astype(int)  # uniform on the ring: each of 16 top-bit patterns about 1/16 of entries
    assert np.all(np.abs(np.bincount(top_bits, minlength=16) / y.size - 1 / 16) < 0.03)


def test_the_graph_is_symmetric_regular_and_logarithmic():
    graph = secagg.neighbours(np.arange(1000), b"round")
    k = secagg.neighbour_count(1000)
    assert k == 20 and all(len(v) == k for v in graph.values())
    assert all(i in graph[j] for i, near in graph.items() for j in near)
    assert all(sorted(v) == [j for j in range(5) if j != i] for i, v in secagg.neighbours(np.arange(5), b"r").items())  # small: complete


def test_shamir_rebuilds_from_any_t_shares_and_not_from_fewer():
    secret = bytes(range(32))
    shares = secagg.shamir_shares(secret, list(range(100, 107)), t=4)
    points = {x + 1: shares[h] for x, h in enumerate(range(100, 107))}
    for chosen in ([1, 2, 3, 4], [7, 5, 3, 1], [2, 4, 6, 7, 1]):
        assert secagg.shamir_rebuild({x: points[x] for x in chosen}) == secret
    with pytest.raises(ValueError, match="too few or wrong shares"):
        secagg.shamir_rebuild({x: points[x] for x in [1, 2, 3]})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=30), st.integers(0, 30))
def test_fixed_point_truncation_never_grows_a_value_and_decodes_within_one_step(values, bits):
    x = np.array(values)
    scale = 2.0**bits
    back = secagg.decode(secagg.encode(x, scale), scale)
    assert np.all(np.abs(back) <= np.abs(x)) and np.all(np.abs(back - x) < 1 / scale)


def test_a_value_outside_the_ring_is_refused():
    with pytest.raises(ValueError, match="out of the ring"):
        secagg.encode(np.array([1e6]), 2.0**60)
