"""The methods table: availability, tuning draws, cell configs."""

import numpy as np
import pytest

from bench import training


def test_draws_start_from_the_defaults_and_are_seeded_per_method_and_epsilon():
    draws = training.draws("ssp", 1.0, 5, {})
    assert draws[0] == {} and len(draws) == 5
    assert draws == training.draws("ssp", 1.0, 5, {})
    assert draws != training.draws("ssp", 5.0, 5, {}) and draws != training.draws("als", 1.0, 5, {})
    space = training.METHODS["ssp"].space
    for draw in draws[1:]:
        assert draw.keys() == space.keys() and all(draw[k] in space[k] for k in draw)


def test_caps_restrict_the_candidates_or_stand_in_for_them():
    for draw in training.draws("ssp", 1.0, 20, {"dim": 16, "outer_steps": 2})[1:]:
        assert draw["dim"] in (8, 16) and draw["outer_steps"] in (1, 2)
    # no non-private candidate is <= 8: the cap itself is the only choice
    assert {d["dim"] for d in training.draws("nonprivate-als", None, 10, {"dim": 8})[1:]} == {8}


def test_a_method_without_an_item_update_or_field_is_skipped_or_left_at_default(monkeypatch):
    monkeypatch.setitem(training.METHODS, "future", training.Method("Future", {"item_update": "future", "encoder": "id"}, {"dim": [8], "no_such_field": [1, 2]}))
    assert not training.available("future") and training.available("ssp") and training.available("als")
    assert training.untunable("future") == ["no_such_field"]
    assert all(d.keys() <= {"dim"} for d in training.draws("future", 1.0, 4, {}))


def test_select_keeps_table_order_and_refuses_unknown_names():
    assert training.select(None) == list(training.METHODS)
    assert training.select(["ssp", "als"]) == ["als", "ssp"]
    with pytest.raises(ValueError, match="unknown method"):
        training.select(["ssp", "nope"])


def test_cell_config_precedence_and_plain_numbers():
    config = training.cell_config("als", {"dim": 4, "epochs": 10, "item_update": "ssp"}, {"dim": np.int64(16)})
    # the draw beats the base, the base beats nothing of the method's; a field ALS does not tune is not set
    assert config == {"item_update": "als", "encoder": "id", "dim": 16} and type(config["dim"]) is int
    assert training.train_config(training.cell_params("/d", "rmse", "als", 5.0, config, 7), "/d", "/run").dim == 16


def test_mean_std_by_hand():
    assert training.mean_std([1.0, 3.0]) == (2.0, pytest.approx(np.sqrt(2)))
    assert training.mean_std([5.0]) == (5.0, 0.0)
