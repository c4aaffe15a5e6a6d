"""The methods table: availability, search spaces, the seeded TPE suggestions, cell configs, the DP popularity ranker's
ranking metrics by hand, the ranking-only cells' records."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench import training
from schemas import storage
from trainer import evaluate


def objective(draw: dict) -> float:
    """A fake validation RMSE of a draw: best near lambda_u = 0.01, dim 16, ridge 0.1."""
    return (
        1.0
        + (math.log10(draw.get("lambda_u", 0.1)) + 2) ** 2
        + 0.1 * (draw.get("dim", 8) != 16)
        + (math.log10(draw.get("ridge", 0.1)) + 1) ** 2
    )


def run_study(name, seed, trials, caps=None, startup=3, epsilon=1.0):
    """The draws of a study against the fake objective, through the same suggest/tuned_values path as
    privacy_utility.study."""
    caps = caps or {}
    history, draws = [], []
    for _ in range(trials):
        draw = training.suggest(name, seed, history, caps, True, startup)
        config = training.cell_config(name, {}, draw)
        draws.append(draw)
        history.append(
            (training.tuned_values(name, config, caps), objective(training.tuned_values(name, config, caps)))
        )
    return draws


def test_seeded_tpe_gives_the_same_suggestions_twice_and_starts_from_the_defaults():
    draws = run_study("ssp", 7, 9)
    assert draws[0] == {} and len(draws) == 9
    assert draws == run_study("ssp", 7, 9)  # past the 3 random startup trials: TPE proper, still the same
    assert draws[1:] != run_study("ssp", 8, 9)[1:]
    space = training.search_space("ssp", {})
    for draw in draws[1:]:
        assert draw.keys() == space.keys() and all(space[k].contains(v) for k, v in draw.items())
        assert all(type(v) in (int, float) for v in draw.values())  # plain JSON numbers
    # the study seed is a function of (method, epsilon)
    assert (
        training.study_seed("ssp", 1.0)
        == training.study_seed("ssp", 1.0)
        != training.study_seed("ssp", 5.0)
        != training.study_seed("als", 5.0)
    )


def test_tpe_uses_the_finished_trials():
    """After the random startup, suggestions depend on the values told: another objective, other draws."""
    history = [(training.tuned_values("als", training.cell_config("als", {}, {}), {}), 1.0)]
    rng = np.random.default_rng(0)
    for _ in range(6):
        draw = training.suggest("als", 3, history, {}, True, 3)
        history.append((draw, float(rng.uniform())))
    flipped = [(params, -v) for params, v in history]
    assert training.suggest("als", 3, history, {}, True, 3) != training.suggest("als", 3, flipped, {}, True, 3)
    # a failed trial (no value) is told as failed, not as a number
    assert (
        training.suggest("als", 3, history + [(history[-1][0], None)], {}, True, 3).keys()
        == training.search_space("als", {}).keys()
    )


NAMED = {  # the ranges the benchmark promises (field -> (low, high, log))
    "lambda_u": (1e-3, 1.0, True),
    "clip_u": (0.05, 2.0, True),
    "clip_y": (0.5, 3.0, False),
    "ridge": (1e-3, 3.0, True),
    "noise_ridge": (0.01, 3.0, True),
    "residual_penalty": (0.1, 30.0, True),
    "learning_rate": (1e-3, 0.1, True),
    "epochs": (5, 200, True),
    "outer_steps": (1, 4, False),
    "dpsgd_learning_rate": (1e-3, 0.3, True),
    "dpsgd_epochs": (1, 20, None),
    "dpsgd_clip": (0.1, 10.0, True),
}


def test_search_spaces_contain_the_named_ranges():
    wanted = {
        "ssp": [
            "lambda_u",
            "clip_u",
            "clip_y",
            "ridge",
            "noise_ridge",
            "residual_penalty",
            "learning_rate",
            "epochs",
            "outer_steps",
        ],
        "dpsgd": ["lambda_u", "clip_u", "clip_y", "outer_steps", "dpsgd_learning_rate", "dpsgd_epochs", "dpsgd_clip"],
        "als": ["lambda_u", "clip_u", "clip_y", "ridge", "noise_ridge", "outer_steps"],
        "cmf": [
            "lambda_u",
            "clip_u",
            "clip_y",
            "ridge",
            "noise_ridge",
            "outer_steps",
            "feature_weight",
            "feature_ridge",
        ],
        "none": ["lambda_u", "outer_steps"],
    }
    for name, keys in wanted.items():
        space = training.METHODS[name].space
        for key in keys:
            dim = space[key]
            assert isinstance(dim, training.Range), (name, key)
            if key in NAMED:
                low, high, log = NAMED[key]
                assert dim.low <= low and dim.high >= high, (name, key, dim)
                assert log is None or dim.log == log, (name, key, dim)
        assert set(space["dim"].values) >= {8, 16, 32, 64}
    assert set(training.METHODS["dpsgd"].space["dpsgd_batch_size"].values) == {32, 64, 128, 256, 512}
    assert (
        isinstance(training.METHODS["dpsgd"].space["dpsgd_epochs"], training.Range)
        and training.METHODS["dpsgd"].space["dpsgd_epochs"].integer
    )
    assert training.METHODS["ssp"].space["epochs"].integer and training.METHODS["ssp"].space["epochs"].log
    # the residual penalty is AM-SSP's alone; the starting point tunes the user side only
    assert [n for n, m in training.METHODS.items() if "residual_penalty" in m.space and m.private] == ["ssp"]
    assert set(training.METHODS["none"].space) == {"dim", "lambda_u", "outer_steps"}
    assert training.METHODS["none"].overrides["item_update"] == "none" and training.available("none")
    # every tuned field is a TrainConfig field, so nothing is silently left at a default
    assert all(not training.untunable(n) for n in training.METHODS)
    # ranges hold the method's defaults: trial 0 is a point of the space the sampler is told
    for name in training.METHODS:
        config = training.cell_config(name, {}, {})
        for protocol in training.METHODS[name].protocols:
            tuned = training.tuned_values(name, config, {}, protocol=protocol)
            assert tuned.keys() == training.search_space(name, {}, protocol).keys(), (name, protocol)
    # AM-SSP's share of the item Gram is tuned for a ranking (its default 0.5 inside), never for ratings
    assert training.tuned_values("ssp", {}, {}, protocol="recall")["item_gram_share"] == 0.5
    assert "item_gram_share" not in training.search_space("ssp", {}, "rmse")


def test_dp_popularity_and_implicit_als_are_ranking_methods():
    method = training.METHODS["dp-popularity"]
    assert (
        method.protocols == ("recall",)
        and method.kind == "popularity"
        and method.private
        and training.available("dp-popularity")
    )
    reference = training.METHODS["ials"]
    assert (
        reference.protocols == ("recall",)
        and reference.kind == "ials"
        and not reference.private
        and not reference.space
    )
    ranking_only = ("dp-popularity", "ials", "ease", "gram")
    for name in ranking_only:
        assert training.runs_under(name, "recall") and not training.runs_under(name, "rmse")
    assert all(training.runs_under(n, "rmse") for n in training.METHODS if n not in ranking_only)
    assert training.METHODS["ease"].kind == "ease" and not training.METHODS["ease"].private
    assert training.METHODS["gram"].private and training.available("gram")
    with pytest.raises(ValueError, match="recall protocol only"):
        training.popularity_cell("/nowhere", training.cell_params("/d", "rmse", "dp-popularity", 1.0, {}, 0))
    with pytest.raises(ValueError, match="recall protocol only"):
        training.reference_cell("/nowhere", training.cell_params("/d", "rmse", "ials", None, {}, 0))


def test_the_ranking_only_cells_record_every_ranking_metric(tmp_path):
    """The DP popularity and implicit-ALS cells, run for real on a small MovieLens-like set: the primary
    metric (tuned on) is Recall@20, and every metric of trainer.metrics.RANKING is kept beside it."""
    from pipelines.data import synth
    from trainer.metrics import RANKING

    data = synth.generate(str(tmp_path / "ml"), users=300, like="movielens").path
    cells = {}
    for name, epsilon in (("dp-popularity", 5.0), ("ials", None), ("ease", None)):
        params = training.cell_params(data, "recall", name, epsilon, training.cell_config(name, {}, {}), 0)
        cells[name] = training.run_cell(str(tmp_path / "out"), params)
    for name, cell in cells.items():
        assert [list(cell["ranking"][part]) for part in ("valid", "test")] == [list(RANKING)] * 2, name
        assert (cell["valid"], cell["test"]) == (
            cell["ranking"]["valid"]["recall_at_20"],
            cell["ranking"]["test"]["recall_at_20"],
        )
        assert all(0 < v <= 1 for part in cell["ranking"].values() for v in part.values()), name
    # DP popularity gives every user the same list (less their history): its top 20s cover fewer items
    popularity, ials, ease = (cells[n]["ranking"]["test"] for n in ("dp-popularity", "ials", "ease"))
    assert popularity["coverage_at_20"] < min(ials["coverage_at_20"], ease["coverage_at_20"])
    assert ease["recall_at_20"] > popularity["recall_at_20"]


def test_caps_restrict_the_ranges_or_stand_in_for_them():
    space = training.search_space("ssp", {"dim": 16, "outer_steps": 2, "epochs": 10})
    assert space["dim"].values == (8, 16) and (space["outer_steps"].low, space["outer_steps"].high) == (1, 2)
    assert (space["epochs"].low, space["epochs"].high) == (5, 10)
    for draw in run_study("ssp", 1, 8, caps={"dim": 16, "outer_steps": 2, "epochs": 10})[1:]:
        assert draw["dim"] in (8, 16) and draw["outer_steps"] in (1, 2) and 5 <= draw["epochs"] <= 10
    # a cap below every candidate is the only choice
    assert training.search_space("nonprivate-als", {"dim": 4})["dim"].values == (4,)
    assert str(training.Range(1e-3, 1.0, log=True)) == "log 0.001..1" and str(training.Choice((8, 16))) == "{8, 16}"


def test_a_method_without_an_item_update_or_field_is_skipped_or_left_at_default(monkeypatch):
    monkeypatch.setitem(
        training.METHODS,
        "future",
        training.Method(
            "Future",
            {"item_update": "future", "encoder": "id"},
            {"dim": training.Choice((8,)), "no_such_field": training.Range(1, 2)},
        ),
    )
    assert not training.available("future") and training.available("ssp") and training.available("als")
    assert training.untunable("future") == ["no_such_field"]
    assert training.search_space("future", {}).keys() == {"dim"}


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
    # what the sampler is told of the defaults: TrainConfig's at the cell's epsilon and protocol (d = 16
    # private at epsilon 10, 8 at epsilon 1 for ratings, 16 at epsilon 1 for ranking, 32 non-private)
    assert training.tuned_values("als", training.cell_config("als", {}, {}), {})["dim"] == 16
    assert training.tuned_values("als", training.cell_config("als", {}, {}), {}, epsilon=1.0)["dim"] == 8
    assert (
        training.tuned_values("als", training.cell_config("als", {}, {}), {}, epsilon=1.0, protocol="recall")["dim"]
        == 16
    )
    assert training.tuned_values("nonprivate-als", training.cell_config("nonprivate-als", {}, {}), {})["dim"] == 32


def test_mean_std_by_hand():
    assert training.mean_std([1.0, 3.0]) == (2.0, pytest.approx(np.sqrt(2)))
    assert training.mean_std([5.0]) == (5.0, 0.0)


def write_part(folder, part, history, targets):
    for kind, pairs in (("history", history), ("targets", targets)):
        users, items = zip(*pairs, strict=True)
        pq.write_table(
            pa.table({"user_id": pa.array(users, pa.int64()), "item_id": pa.array(items, pa.int64())}),
            folder / f"{part}_{kind}.parquet",
        )


def test_dp_popularity_recall_equals_a_hand_computation(tmp_path):
    # 25 items (ids 101..125); DP counts: item i has count 130 - i, except ties: 118, 119, 120 all 9.5, and 121, 122
    # both 9
    catalog = np.arange(101, 126)
    counts = {int(i): float(130 - i) for i in catalog}
    counts.update({118: 9.5, 119: 9.5, 120: 9.5, 122: 9.0})
    train_items = np.repeat(catalog, 3)
    # valid: user 1's history is the 3 most counted items, so its top 20 is items 104..123 (ties 118-120 all in);
    # targets 104 (in), 124 (out), 125 (out): 1 / min(20, 3) = 1/3.
    # user 2: history 110; top 20 = 101..109, 111..120, then one of the tied 121, 122: the lower index, 121;
    # targets 121 (in: the tie goes to the lower index), 124 (out): 1/2
    write_part(
        tmp_path, "valid", [(1, 101), (1, 102), (1, 103), (2, 110)], [(1, 104), (1, 124), (1, 125), (2, 121), (2, 124)]
    )
    # test: user 3's history 101..105; top 20 = 106..125; 1 target, 125 (in): 1. User 4: history 125; top 20 = 101..120;
    # targets 120 (in), 121, 122, 123 (out): 1 / min(20, 4) = 1/4. User 5 has no history: not evaluated.
    write_part(
        tmp_path,
        "test",
        [(3, i) for i in range(101, 106)] + [(4, 125)],
        [(3, 125), (4, 120), (4, 121), (4, 122), (4, 123), (5, 101)],
    )
    order = np.array(list(counts))
    got = training.popularity_ranking(
        str(tmp_path), catalog, train_items, order[::-1], np.array([counts[i] for i in order[::-1]])
    )
    assert got["valid"]["recall_at_20"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert got["test"]["recall_at_20"] == pytest.approx((1 + 1 / 4) / 2) and got["test"]["users"] == 2
    # the counts order is the id order (ties: the lower id): rank r holds the r-th item outside the history.
    # Every target is within 50: Recall@50 1. NDCG@100, d_r = 1 / log2(r + 2): valid user 1 ranks 104..125
    # (targets at ranks 0, 20, 21; IDCG of 3), user 2 ranks 101..109, 111..125 (121 at 19, 124 at 22);
    # test user 3 ranks 106..125 (125 at 19), user 4 ranks 101..124 (120..123 at 19..22)
    d = 1 / np.log2(np.arange(2, 102))
    assert got["valid"]["recall_at_50"] == got["test"]["recall_at_50"] == 1.0
    assert got["valid"]["ndcg_at_100"] == pytest.approx(
        ((d[0] + d[20] + d[21]) / d[:3].sum() + (d[19] + d[22]) / d[:2].sum()) / 2
    )
    assert got["test"]["ndcg_at_100"] == pytest.approx((d[19] + d[19:23].sum() / d[:4].sum()) / 2)
    # coverage of the top 20: valid 104..123, 101..109 and 111..121 (23 of 25); test 106..125 and 101..120 (all)
    assert got["valid"]["coverage_at_20"] == pytest.approx(23 / 25) and got["test"]["coverage_at_20"] == 1.0
    # the same numbers as trainer.metrics on the explicit count scores (the metric every method is scored with)
    from trainer import metrics

    scores = np.array([[counts[i] for i in catalog]] * 2)
    hist = np.zeros((2, 25), bool)
    targ = np.zeros((2, 25), bool)
    hist[0, :5], hist[1, 24] = True, True
    targ[0, 24] = True
    targ[1, [19, 20, 21, 22]] = True
    assert np.mean(metrics.recall_at_k_per_user(scores, hist, targ, 20)) == pytest.approx(got["test"]["recall_at_20"])
    # per popularity bucket, buckets from the training counts as for every method (all equal here: by item id)
    buckets = evaluate.popularity_buckets(catalog, train_items)
    assert list(buckets[:5]) == [0] * 5 and len(got["test"]["sliced"]) == training.BUCKETS
    with pytest.raises(ValueError, match="positive DP count"):
        training.popularity_ranking(str(tmp_path), catalog, train_items, catalog[:-1], np.ones(24))


def test_each_cell_has_its_own_budget_account_registry(tmp_path, monkeypatch):
    """Cells of one experiment train on one generated data set: in a shared registry the second cell's
    own account (or a rerun's) would be refused. Each cell gets a fresh registry; the caller's is restored."""
    from privacy.lifetime_budget import ACCOUNTS_ENV, BudgetAccount, accounts_home

    monkeypatch.setenv(ACCOUNTS_ENV, str(tmp_path / "shared"))
    BudgetAccount.for_source("source-digest")  # the user's own registry already knows the data source
    for cell in ("a", "b", "a"):  # two cells, then a rerun of the first
        with training.own_budget_accounts(str(tmp_path / "runs" / cell)) as account:
            assert accounts_home() == str(tmp_path / "runs" / f"{cell}.accounts")
            assert BudgetAccount.for_source("source-digest", account).path == storage.canonical(account)
        assert not (tmp_path / "runs" / f"{cell}.accounts").exists()
    assert accounts_home() == str(tmp_path / "shared")
    with pytest.raises(ValueError, match="already has its budget account"):  # what a cell met before
        BudgetAccount.for_source("source-digest", str(tmp_path / "elsewhere.json"))
