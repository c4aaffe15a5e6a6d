"""Closed-form ridge solves per key: plain, weighted-lambda and with an implicit-feedback gravity term."""

import numpy as np
import pytest

from trainer.solve import ridge_solve


def test_solves_match_the_normal_equations():
    rng = np.random.default_rng(0)
    keys = np.array([3, 1, 3, 3, 1])
    v, y = rng.normal(size=(5, 2)), rng.normal(size=5)
    gravity = np.array([[2.0, 0.5], [0.5, 1.0]])
    for scale, extra in ((False, None), (True, None), (True, gravity)):
        unique, u = ridge_solve(keys, v, y, 0.3, scale_by_rows=scale, gravity=extra)
        assert unique.tolist() == [1, 3]
        for row, key in enumerate(unique):
            rows = keys == key
            lam = 0.3 * rows.sum() if scale else 0.3
            system = v[rows].T @ v[rows] + lam * np.eye(2) + (extra if extra is not None else 0)
            np.testing.assert_allclose(u[row], np.linalg.solve(system, v[rows].T @ y[rows]), rtol=1e-12)
    with pytest.raises(ValueError, match="lambda must be > 0"):
        ridge_solve(keys, v, y, 0.0)
