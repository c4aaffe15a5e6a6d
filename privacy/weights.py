"""Per-example weights that bound each user's total contribution (the paper's budget allocation).

User level (Krichene et al. 2023, eqs. 11-12): from DP item counts n_j,
`w_i = wbar * n_j^e / sqrt(sum_{i' of the same user} n_j'^(2e))` with e = -1/4 by default, so that
`sum_{i of a user} w_i^2 = wbar^2` exactly: tail items get more weight, heavy users less per row.
e = 0 gives uniform weights wbar / sqrt(|user's rows|). Example level: w_i = 1.

Confidence (implicit feedback's repeats, Hu, Koren and Volinsky 2008): a row may carry c_i > 0,
`w_i = wbar * c_i n_j^e / sqrt(sum_{i'} (c_i' n_j'^e)^2)`, so a user's weights lean towards the items
the user came back to while their squares still sum to wbar^2: the sensitivity is unchanged.

Privacy: the counts must be DP (released) counts, never exact ones; the weights are then a function
of the user's own rows and released data, and the statistics' user-level sensitivity is wbar times
the clip bounds. Each (user, item) pair must appear once (duplicates are merged upstream).
"""

from __future__ import annotations

import numpy as np

from schemas.errors import UserError
from schemas.ids import IdIndex

DEFAULT_EXPONENT = -0.25
NORMALISER_CHUNK = 1 << 22  # rows per chunk of the normalisers' sums


def _check(wbar: float, exponent: float, counts: np.ndarray) -> None:
    if not np.isfinite(wbar) or wbar <= 0:
        raise UserError(f"wbar must be a finite number > 0, got {wbar}")
    if not np.isfinite(exponent):
        raise UserError(f"weight exponent must be finite, got {exponent}")
    if counts.size and (not np.all(np.isfinite(counts)) or counts.min() < 1.0):
        raise UserError("DP counts must be finite and floored at 1")


def _confidence(confidence: np.ndarray | None, size: int) -> np.ndarray:
    if confidence is None:
        return np.ones(size)
    confidence = np.asarray(confidence, dtype=np.float64)
    if (
        confidence.shape != (size,)
        or not np.all(np.isfinite(confidence))
        or (confidence.size and confidence.min() <= 0)
    ):
        raise UserError("row confidences must be finite numbers > 0, one per row")
    return confidence


def user_normalisers(
    user_ids: np.ndarray,
    row_counts: np.ndarray,
    exponent: float = DEFAULT_EXPONENT,
    known_users: np.ndarray | None = None,
    confidence: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(sorted user ids, each user's normaliser sum (c_i n_j^e)^2 over all of the user's rows).

    `known_users` (sorted, holding every user of the rows) replaces the sort of the rows' user
    ids by a lookup (schemas.ids); the sums are the same.
    """
    user_ids = np.asarray(user_ids)
    counts = np.asarray(row_counts, dtype=np.float64)
    if user_ids.shape != counts.shape:
        raise UserError(f"user_ids and row_counts must have one shape, got {user_ids.shape} and {counts.shape}")
    rows = np.arange(counts.size)
    if known_users is not None:
        return normalisers_at(
            IdIndex(known_users).positions(user_ids, "user"), rows, counts, known_users, exponent, confidence
        )
    users, group = np.unique(user_ids, return_inverse=True)
    return users, normalisers_at(group, rows, counts, users, exponent, confidence)[1]


def normalisers_at(
    positions: np.ndarray,
    item_at: np.ndarray,
    item_counts: np.ndarray,
    known_users: np.ndarray,
    exponent: float = DEFAULT_EXPONENT,
    confidence: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`user_normalisers` of rows given by positions: their users' in `known_users` (sorted) and
    their items' in `item_counts` (DP counts), for a caller that has looked both up already."""
    sums = NormaliserSums(item_counts, known_users, exponent)
    confidence = None if confidence is None else _confidence(confidence, np.shape(item_at)[0])
    for start in range(0, np.shape(item_at)[0], NORMALISER_CHUNK):  # a chunk at a time: memory flat with the rows
        chunk = slice(start, start + NORMALISER_CHUNK)
        sums.add(positions[chunk], item_at[chunk], None if confidence is None else confidence[chunk])
    return sums.result()


class NormaliserSums:
    """The users' normalisers summed batch by batch, for rows given by positions (`normalisers_at`).
    The power n^e is taken once per item rather than once per row (the same bits: the same
    operation on the same value), and each user's terms are added in the rows' order, so any
    batching gives the bits of one sum over every row."""

    def __init__(self, item_counts: np.ndarray, known_users: np.ndarray, exponent: float = DEFAULT_EXPONENT):
        counts = np.asarray(item_counts, dtype=np.float64)
        _check(1.0, exponent, counts)
        self.scales = counts**exponent
        self.squares = np.square(self.scales)
        self.known_users = known_users
        self.sums, self.present = np.zeros(known_users.size), np.zeros(known_users.size, bool)

    def add(self, positions: np.ndarray, item_at: np.ndarray, confidence: np.ndarray | None = None) -> None:
        terms = (
            self.squares[item_at]
            if confidence is None
            else np.square(_confidence(confidence, np.shape(item_at)[0]) * self.scales[item_at])
        )
        np.add.at(self.sums, positions, terms)  # in the rows' order, as one bincount of every row adds them
        self.present[positions] = True

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(the users with rows, their normalisers)."""
        return self.known_users[self.present], self.sums[self.present]


def user_level_weights(
    user_ids: np.ndarray,
    row_counts: np.ndarray,
    wbar: float,
    exponent: float = DEFAULT_EXPONENT,
    confidence: np.ndarray | None = None,
) -> np.ndarray:
    """Weights for rows given each row's user id and the DP count of its item (and its confidence).

    Rows may come in any order; the per-user normaliser is computed over all rows of each user
    present in the arrays (so a caller must pass all of a user's rows together).
    """
    users, norms = user_normalisers(user_ids, row_counts, exponent, confidence=confidence)
    return weights_from_normalisers(
        row_counts, norms[np.searchsorted(users, np.asarray(user_ids))], wbar, exponent, confidence
    )


def weights_from_normalisers(
    row_counts: np.ndarray,
    normalisers: np.ndarray,
    wbar: float,
    exponent: float = DEFAULT_EXPONENT,
    confidence: np.ndarray | None = None,
) -> np.ndarray:
    """`w_i = wbar * c_i n_j^e / sqrt(normaliser of the row's user)`, the normaliser being the sum of
    (c n^e)^2 over all of that user's rows (`user_normalisers`, with the same confidences)."""
    counts = np.asarray(row_counts, dtype=np.float64)
    _check(float(wbar), exponent, counts)
    return (
        float(wbar)
        * _confidence(confidence, counts.size)
        * counts**exponent
        / np.sqrt(np.asarray(normalisers, dtype=np.float64))
    )


def example_level_weights(n_rows: int) -> np.ndarray:
    """Example-level privacy: every row has weight 1 (wbar = 1)."""
    return np.ones(n_rows, dtype=np.float64)
