"""Fixtures of the pipeline tests: a small synthetic data set for whole training runs."""

from __future__ import annotations

import pytest

SMALL_USERS, SMALL_ITEMS, SMALL_RATINGS = 400, 300, 15


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> str:
    """A synthetic data set of 6,000 ratings (`ssp synth`: power-law items, public features)."""
    from pipelines.data.synth import generate

    folder = str(tmp_path_factory.mktemp("data") / "small")
    generate(folder, users=SMALL_USERS, items=SMALL_ITEMS, ratings_per_user=SMALL_RATINGS, seed=1)
    return folder
