"""Secure aggregation's arithmetic: masks cancel, dropped clients' masks are recovered from Shamir
shares, a single input reveals nothing, fixed point never grows a vector, and the consistency check
stops a server that shows holders different survivor sets from unmasking one client."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    survivors = frozenset(ids) - set(dropped)
    masked = sum((secagg.masked_input(i, x[i], keys[i], graph, public) for i in survivors), np.zeros(size, np.uint64))
    signatures = {i: secagg.sign_survivors(keys[i], survivors, b"round") for i in survivors}
    signers = secagg.valid_signers(survivors, b"round", signatures, {i: k.verify_key for i, k in keys.items()})
    revealed = {}
    for holder in survivors:
        assert secagg.consistent(holder, survivors, signers, secagg.quorum(n, n - len(dropped)))
        for client, item in secagg.revealed_shares(holder, held[holder], survivors).items():
            revealed.setdefault(client, []).append(item)
    correction = np.zeros(size, np.uint64)
    for client in ids:
        kinds = {kind for kind, _, _ in revealed[client]}
        assert kinds == {"mask" if client in survivors else "key"}  # never both secrets of one client
        secret = secagg.shamir_rebuild({x_: share for _, x_, share in revealed[client][:t]})
        correction = correction + secagg.mask_correction(
            client, kinds.pop(), secret, size=size, graph=graph, public_keys=public, survivors=survivors
        )
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
    top_bits = (y >> np.uint64(60)).astype(
        int
    )  # uniform on the ring: each of 16 top-bit patterns about 1/16 of entries
    assert np.all(np.abs(np.bincount(top_bits, minlength=16) / y.size - 1 / 16) < 0.03)


def test_the_graph_is_symmetric_regular_and_logarithmic():
    graph = secagg.neighbours(np.arange(1000), b"round")
    k = secagg.neighbour_count(1000)
    assert k == 20 and all(len(v) == k for v in graph.values())
    assert all(i in graph[j] for i, near in graph.items() for j in near)
    assert all(
        sorted(v) == [j for j in range(5) if j != i] for i, v in secagg.neighbours(np.arange(5), b"r").items()
    )  # small: complete


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


N, C = 20, 0  # the partition attack's clients and the position of its victim


def partition_attack(checked: bool):
    """A malicious server against victim c, all N clients alive: it shows each holder h the survivor set
    without the neighbours of c that h holds shares of (c itself stays in). Then c's neighbours reveal
    their shares of c's self-mask seed b_c (c is alive in their sets) and the neighbours of each neighbour
    j of c reveal their shares of j's key sk_j (j dropped in their sets), from which the server computes
    every pairwise mask of c. Honest holders reveal when their set has at least the quorum (as before the
    check) and, with `checked`, when it passes the consistency check. Returns (x_c, what the server
    computes from y_c: x_c itself when the attack works, None when it lacks shares, shares revealed)."""
    ids, keys, public = clients_with_keys(N)
    graph = secagg.neighbours(np.array(ids), b"round")
    t, quorum, victim = secagg.threshold(len(graph[ids[0]])), secagg.quorum(N, N // 2), ids[C]
    held = {i: {} for i in ids}
    for i in ids:
        for holder, share in secagg.setup_shares(i, keys[i], graph, t).items():
            held[holder][i] = share
    x = secagg.encode(np.random.default_rng(1).normal(size=64), 2.0**20)
    y = secagg.masked_input(victim, x, keys[victim], graph, public)
    alive = frozenset(ids)
    shown = {h: alive - (set(graph[victim]) & set(graph[h])) if h != victim else alive for h in ids}
    signatures = {
        h: secagg.sign_survivors(keys[h], shown[h], b"round") for h in ids
    }  # each honest client signs the set it was shown
    verify_keys = {i: k.verify_key for i, k in keys.items()}
    revealed = {}
    for h in ids:
        if len(shown[h]) < quorum:
            continue
        if checked and not secagg.consistent(
            h, shown[h], secagg.valid_signers(shown[h], b"round", signatures, verify_keys), quorum
        ):
            continue
        for client, item in secagg.revealed_shares(h, held[h], shown[h]).items():
            revealed.setdefault(client, []).append(item)

    def rebuilt(client, kind):
        points = {x_: share for k, x_, share in revealed.get(client, []) if k == kind}
        return secagg.shamir_rebuild(dict(list(points.items())[:t])) if len(points) >= t else None

    count = sum(len(v) for v in revealed.values())
    b_c = rebuilt(victim, "mask")
    if b_c is None:
        return x, None, count
    unmasked = y - secagg.prg(b_c, x.size)
    for j in graph[victim]:
        sk_j = rebuilt(j, "key")
        if sk_j is None:
            return x, None, count
        mask = secagg.prg(secagg.pairwise_seed(sk_j, public[victim]), x.size)
        unmasked = unmasked - mask if j > victim else unmasked + mask
    return x, unmasked, count


def test_without_the_consistency_check_a_partitioning_server_unmasks_one_client():
    x, recovered, _ = partition_attack(checked=False)
    np.testing.assert_array_equal(recovered, x)


def test_with_the_consistency_check_no_client_reveals_under_a_partition():
    x, recovered, revealed = partition_attack(checked=True)
    assert recovered is None and revealed == 0


def test_a_set_passes_the_check_only_with_a_quorum_of_its_members_signatures_for_this_round():
    ids, keys, _ = clients_with_keys(7)
    verify_keys = {i: k.verify_key for i, k in keys.items()}
    alive, quorum = frozenset(ids), secagg.quorum(7, 5)
    assert quorum == 5
    signatures = {i: secagg.sign_survivors(keys[i], alive, b"round") for i in ids}
    assert secagg.valid_signers(alive, b"round", signatures, verify_keys) == 7 and secagg.consistent(
        ids[0], alive, 7, quorum
    )
    assert secagg.valid_signers(alive, b"another round", signatures, verify_keys) == 0  # bound to the round
    assert secagg.valid_signers(alive - {ids[6]}, b"round", signatures, verify_keys) == 0  # bound to exactly the set
    forged = {**signatures, ids[0]: secagg.sign_survivors(keys[ids[1]], alive, b"round")}  # another client's key
    assert secagg.valid_signers(alive, b"round", forged, verify_keys) == 6
    few = {i: signatures[i] for i in ids[:4]}
    assert not secagg.consistent(ids[0], alive, secagg.valid_signers(alive, b"round", few, verify_keys), quorum)
    assert not secagg.consistent(ids[6], alive - {ids[6]}, 7, quorum)  # a set that leaves the holder out
    assert secagg.quorum(10, 3) == 6 and secagg.quorum(10, 9) == 9  # more than half, and at least n_min
