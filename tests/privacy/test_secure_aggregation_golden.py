"""Golden vectors of secure aggregation's masks: the PRG's words and one client's masked input for
fixed client secrets, written down once. A change of the key derivation, the key agreement, the PRG
or the mask signs changes them (and would break a round between devices on different versions)."""

from __future__ import annotations

import numpy as np

from privacy import secure_aggregation as secagg

KEYS = {client: secagg.ClientKeys(bytes([client]) * 32) for client in range(3)}
PUBLIC = {client: keys.public_key for client, keys in KEYS.items()}
GRAPH = {0: [1, 2], 1: [0, 2], 2: [0, 1]}
X = np.arange(4, dtype=np.uint64)


def test_prg_words_are_pinned():
    assert secagg.prg(bytes(range(32)), 3).tolist() == [
        7645359380336737593,
        5281276197874154893,
        14729830432180286858,
    ]


def test_one_masked_input_is_pinned():
    assert secagg.masked_input(1, X, KEYS[1], GRAPH, PUBLIC).tolist() == [
        659303015672154100,
        4500593189338958785,
        15573372666985583211,
        4463569316960812869,
    ]


def test_the_pinned_pairwise_masks_cancel_in_the_sum():
    total = sum((secagg.masked_input(i, X, KEYS[i], GRAPH, PUBLIC) for i in KEYS), np.zeros(4, np.uint64))
    self_masks = sum((secagg.prg(KEYS[i].self_mask_seed, 4) for i in KEYS), np.zeros(4, np.uint64))
    assert (total - self_masks).tolist() == [0, 3, 6, 9]
