"""The users' Gram matrix release: exact without noise, noised at the stated scale, in the ledger."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.releases.gram import dp_gram
from pipelines.releases.stats_core import StatsSettings
from privacy.accumulator import upper_indices
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from schemas.tables import USER_EMBEDDINGS


def write_users(path, vectors):
    storage.write_table(
        pa.table(
            {"user_id": np.arange(len(vectors)), "embedding": list(np.asarray(vectors, float))}, schema=USER_EMBEDDINGS
        ),
        path,
    )


def test_exact_gram_of_clipped_embeddings_without_noise(tmp_path):
    write_users(str(tmp_path / "u.parquet"), [[3.0, 4.0], [0.5, 0.0]])
    ledger = Ledger.create(str(tmp_path / "ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 0.0})
    gram = dp_gram(
        str(tmp_path / "u.parquet"), ledger, SeedFile.create(str(tmp_path / "seed")), StatsSettings(2, 1.0, 1.0), step=1
    )
    clipped = np.array([[0.6, 0.8], [0.5, 0.0]])  # (3, 4) clipped to norm 1
    np.testing.assert_allclose(gram, clipped.T @ clipped, atol=1e-12)
    assert [row["name"] for row in Ledger.open(str(tmp_path / "ledger.parquet")).rows] == ["step-1/gram"]


def test_noise_scale_is_multiplier_times_clip_squared(tmp_path):
    write_users(str(tmp_path / "u.parquet"), np.zeros((3, 40)))
    seeds = SeedFile.create(str(tmp_path / "seed"), bytes(range(32)))
    ledger = Ledger.create(str(tmp_path / "ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 2.0})
    # zero embeddings: the released matrix is the noise, then projected onto the PSD cone;
    # its positive eigen-part keeps the scale: compare the top eigenvalue with a Wigner matrix's edge
    gram = dp_gram(str(tmp_path / "u.parquet"), ledger, seeds, StatsSettings(40, 0.5, 1.0), step=1)
    top = np.linalg.eigvalsh(gram)[-1]
    sigma = 2.0 * 0.5**2
    assert top == pytest.approx(2 * np.sqrt(40) * sigma, rel=0.25)
    rows, cols = upper_indices(40)
    assert np.all(np.linalg.eigvalsh(gram) > -1e-9) and gram[rows, cols].size == 820


def test_with_biases_the_gram_is_over_the_statistics_rows_and_its_noise_over_their_bound(tmp_path):
    """Users [u, 1, b_u] give rows [Clip(u), c] (c = k clip_u; b_u plays no part): G's corner is c^2
    times the users; the noise is scaled to (1 + k^2) clip_u^2, the rows' squared norm bound."""
    write_users(str(tmp_path / "u.parquet"), [[3.0, 4.0, 1.0, 0.7], [0.5, 0.0, 1.0, -2.0]])
    ledger = Ledger.create(str(tmp_path / "ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 0.0})
    settings = StatsSettings(3, 2.0, 1.0, bias=1.5)  # c = 3
    gram = dp_gram(str(tmp_path / "u.parquet"), ledger, SeedFile.create(str(tmp_path / "seed")), settings, step=1)
    rows = np.array([[1.2, 1.6, 3.0], [0.5, 0.0, 3.0]])  # (3, 4) clipped to norm 2
    np.testing.assert_allclose(gram, rows.T @ rows, atol=1e-12)
    write_users(str(tmp_path / "z.parquet"), np.zeros((3, 41)))
    ledger = Ledger.create(str(tmp_path / "noisy.parquet"), float("inf"), 1e-5, multipliers={"gram": 2.0})
    settings = StatsSettings(40, 0.5, 1.0, bias=0.75)  # rho^2 = (1 + 0.75^2) 0.25
    gram = dp_gram(
        str(tmp_path / "z.parquet"),
        ledger,
        SeedFile.create(str(tmp_path / "seed2"), bytes(range(32))),
        settings,
        step=1,
    )
    corner = np.zeros((40, 40))
    corner[-1, -1] = 3 * 0.375**2  # the users' c^2, the released matrix's only signal
    top = np.linalg.eigvalsh(gram - corner)[-1]
    assert top == pytest.approx(2 * np.sqrt(40) * 2.0 * (1 + 0.75**2) * 0.25, rel=0.25)


def test_removing_a_user_moves_the_biased_gram_by_at_most_the_bound(tmp_path):
    """Neighbouring data: one user removed changes G by at most rho^2 = (1 + k^2) clip_u^2 (Frobenius),
    equal for a user at the clip, whatever their embedding's size or bias."""
    users = [[0.3, -0.2, 1.0, 0.4], [30.0, 40.0, 1.0, -9.0], [0.0, 0.1, 1.0, 2.0]]
    settings = StatsSettings(3, 0.5, 1.0, bias=2.0)
    grams = []
    for name, rows in (("all", users), ("less", [users[0], users[2]])):
        write_users(str(tmp_path / f"{name}.parquet"), rows)
        ledger = Ledger.create(str(tmp_path / f"{name}-ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 0.0})
        grams.append(
            dp_gram(
                str(tmp_path / f"{name}.parquet"),
                ledger,
                SeedFile.create(str(tmp_path / f"{name}-seed")),
                settings,
                step=1,
            )
        )
    assert np.linalg.norm(grams[0] - grams[1]) == pytest.approx((1 + 2.0**2) * 0.5**2, rel=1e-12)
