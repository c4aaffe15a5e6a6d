"""The users' Gram matrix release: exact without noise, noised at the stated scale, in the ledger."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.releases.gram import dp_gram
from privacy.accumulator import upper_indices
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from schemas.tables import USER_EMBEDDINGS


def write_users(path, vectors):
    storage.write_table(pa.table({"user_id": np.arange(len(vectors)), "embedding": list(np.asarray(vectors, float))}, schema=USER_EMBEDDINGS), path)


def test_exact_gram_of_clipped_embeddings_without_noise(tmp_path):
    write_users(str(tmp_path / "u.parquet"), [[3.0, 4.0], [0.5, 0.0]])
    ledger = Ledger.create(str(tmp_path / "ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 0.0})
    gram = dp_gram(str(tmp_path / "u.parquet"), ledger, SeedFile.create(str(tmp_path / "seed")), 2, 1.0, step=1)
    clipped = np.array([[0.6, 0.8], [0.5, 0.0]])  # (3, 4) clipped to norm 1
    np.testing.assert_allclose(gram, clipped.T @ clipped, atol=1e-12)
    assert [row["name"] for row in Ledger.open(str(tmp_path / "ledger.parquet")).rows] == ["step-1/gram"]


def test_noise_scale_is_multiplier_times_clip_squared(tmp_path):
    write_users(str(tmp_path / "u.parquet"), np.zeros((3, 40)))
    seeds = SeedFile.create(str(tmp_path / "seed"), bytes(range(32)))
    ledger = Ledger.create(str(tmp_path / "ledger.parquet"), float("inf"), 1e-5, multipliers={"gram": 2.0})
    # zero embeddings: the released matrix is the noise, then projected onto the PSD cone;
    # its positive eigen-part keeps the scale: compare the top eigenvalue with a Wigner matrix's edge
    gram = dp_gram(str(tmp_path / "u.parquet"), ledger, seeds, 40, 0.5, step=1)
    top = np.linalg.eigvalsh(gram)[-1]
    sigma = 2.0 * 0.5**2
    assert top == pytest.approx(2 * np.sqrt(40) * sigma, rel=0.25)
    rows, cols = upper_indices(40)
    assert np.all(np.linalg.eigvalsh(gram) > -1e-9) and gram[rows, cols].size == 820
