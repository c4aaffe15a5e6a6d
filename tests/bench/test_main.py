"""`python -m bench` end to end on a tiny MovieLens-1M folder (ratings.dat, movies.dat): the training
experiments run the real pipeline, share their cells, and resume without recomputing."""

import csv
import json

import matplotlib.pyplot as plt
import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import privacy_utility, resampling, training

GENRES = ["Action", "Comedy", "Drama", "Horror", "Romance", "Sci-Fi"]


def write_ml1m(folder, users=120, movies=60, per_user=20, seed=0):
    """A tiny ml-1m layout: `::`-separated ratings.dat and movies.dat (latin-1), integer stars from a
    planted model in which a movie's genres drive its factors."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    genre_factors = rng.normal(size=(len(GENRES), 3))
    lines, factors = [], []
    for movie in range(1, movies + 1):
        genres = rng.choice(len(GENRES), rng.integers(1, 3), replace=False)
        factors.append(genre_factors[genres].mean(axis=0))
        lines.append(f"{movie}::Movie {movie} ({1950 + movie % 50})::{'|'.join(GENRES[g] for g in genres)}")
    (folder / "movies.dat").write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    popularity = 1.0 / np.arange(1, movies + 1)
    ratings = []
    for user in range(1, users + 1):
        taste = rng.normal(size=3)
        for movie in rng.choice(movies, per_user, replace=False, p=popularity / popularity.sum()):
            stars = int(np.clip(np.rint(3.5 + taste @ factors[movie] + 0.5 * rng.normal()), 1, 5))
            ratings.append(f"{user}::{movie + 1}::{stars}::{978300000 + len(ratings)}")
    (folder / "ratings.dat").write_text("\n".join(ratings) + "\n")
    return folder


TINY_PU = {
    "epsilons": [5.0],
    "trials": 2,
    "base": {"epochs": 2, "outer_steps": 1, "dim": 4},
    "caps": {"dim": 8, "outer_steps": 1, "epochs": 2},
}
TINY_RESAMPLING = {
    "epsilons": [5.0],
    "resamples": [1, 2],
    "config": {"outer_steps": 1, "epochs": 2, "item_id_feature": False},
}


@pytest.fixture
def counted(monkeypatch):
    """Tiny sizes, and a record of every cell that really trains (the run itself untouched)."""
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: TINY_PU)
    monkeypatch.setattr(resampling, "sizes", lambda quick: TINY_RESAMPLING)
    calls = []
    real = training.run_cell
    monkeypatch.setattr(training, "run_cell", lambda out, params: calls.append(params) or real(out, params))
    return calls


@pytest.fixture
def local_cells(monkeypatch):
    """The cells' runs on the local engine (Spark's bits, tests/pipelines/engines/test_local.py), for the
    tests of what the harness does with many cells: a tiny run on the local engine takes a fraction of
    its time on Spark (the bench still finds the session's Spark, which its stages are handed). The
    single-cell tests below train on Spark, as the bench does."""
    real = training.train_config
    monkeypatch.setattr(training, "train_config", lambda *args: real(*args).replace(engine="local"))


def test_quick_commands_on_an_ml1m_folder_share_cells_and_resume(tmp_path, spark, counted, local_cells):
    data, out = str(write_ml1m(tmp_path / "ml-1m")), str(tmp_path / "out")
    common = ["--data", data, "--out", out, "--quick", "--seeds", "1", "--no-progress"]
    methods = ["--methods", "nonprivate-als", "als", "ssp"]
    assert bench_main.main(["privacy-utility", *common, *methods]) == 0
    # 3 methods x (2 trials + 1 test seed), the top line at one "epsilon"
    assert len(counted) == 9
    cells = json.loads((tmp_path / "out" / "results.json").read_text())["cells"]
    values = [c["value"] for c in cells.values()]
    assert all(v["trajectory"][-1]["test"] == pytest.approx(v["test"]) and len(v["test_sliced"]) == 5 for v in values)
    assert all(v["trajectory"][0]["seconds"] < v["trajectory"][-1]["seconds"] for v in values)
    spent = sorted(v["epsilon_spent"] or 0.0 for v in values)
    assert spent[:3] == [0.0] * 3 and spent[3:] == pytest.approx([5.0] * 6, abs=1e-3)  # the top line records no epsilon
    # the ml-1m folder was ingested once, under OUT/data
    assert len(list((tmp_path / "out" / "data").iterdir())) == 1 and not any(
        (tmp_path / "out" / "runs").glob("*/ledger.parquet")
    )

    with open(tmp_path / "out" / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["method"], r["epsilon"], r["n_seeds"]) for r in table] == [
        ("nonprivate-als", "inf", "1"),
        ("als", "5.0", "1"),
        ("ssp", "5.0", "1"),
    ]

    # reruns and the experiments that share the cells train nothing
    assert bench_main.main(["privacy-utility", *common, *methods]) == 0
    assert bench_main.main(["long-tail", *common, *methods]) == 0
    assert bench_main.main(["time-to-quality", *common, *methods]) == 0
    assert len(counted) == 9
    report = (tmp_path / "out" / "report.md").read_text()
    assert (
        report.index("## Privacy-utility")
        < report.index("## Time to quality")
        < report.index("## Quality on the long tail")
    )
    assert (
        "(privacy_utility_rmse.png)" in report
        and "(long_tail_rmse.png)" in report
        and "(time_to_quality_rmse.png)" in report
    )
    assert "tuned (privacy-utility)" in report and "**Who wins.** epsilon = 5:" in report
    assert "**Not run**" not in report  # every requested method is offered
    for png in ("privacy_utility_rmse.png", "long_tail_rmse.png", "time_to_quality_rmse.png"):
        assert plt.imread(str(tmp_path / "out" / png)).ndim == 3

    assert bench_main.main(["resampling", *common, "--methods", "ssp"]) == 0
    assert len(counted) == 11
    assert [c["config"]["resamples"] for c in counted[9:]] == [1, 2]
    assert "## Comparing SSP1 and SSP2" in (tmp_path / "out" / "report.md").read_text()


def test_recall_protocol_time_to_quality_with_defaults(tmp_path, spark, counted):
    """Without privacy-utility cells, time-to-quality runs AM-SSP at its defaults: on the ranking protocol here."""
    data, out = str(write_ml1m(tmp_path / "ml-1m", users=150)), str(tmp_path / "out")
    assert (
        bench_main.main(
            [
                "time-to-quality",
                "--data",
                data,
                "--out",
                out,
                "--quick",
                "--seeds",
                "1",
                "--no-progress",
                "--protocol",
                "recall",
                "--methods",
                "ssp",
            ]
        )
        == 0
    )
    assert (
        len(counted) == 1
        and counted[0]["protocol"] == "recall"
        and counted[0]["config"] == training.cell_config("ssp", TINY_PU["base"], {})
    )
    value = next(iter(json.loads((tmp_path / "out" / "results.json").read_text())["cells"].values()))
    assert value["experiment"] == "time-to-quality" and 0.0 <= value["value"]["test"] <= 1.0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Recall@20" in report and "defaults" in report and "**Ratio:** not computed" in report


def test_transfer_mode_on_generated_data_sets(tmp_path, spark, counted, local_cells, monkeypatch):
    """--tune-on A --data B, 1 trial per method: the studies run on A only, B runs the settings chosen on A."""
    from pipelines.data import synth

    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: {**TINY_PU, "trials": 1})
    a = synth.generate(str(tmp_path / "A"), users=120, items=40, ratings_per_user=10, seed=1).path
    b = synth.generate(str(tmp_path / "B"), users=120, items=40, ratings_per_user=10, seed=2).path
    out = str(tmp_path / "out")
    assert (
        bench_main.main(
            [
                "privacy-utility",
                "--tune-on",
                a,
                "--data",
                b,
                "--out",
                out,
                "--quick",
                "--seeds",
                "1",
                "--no-progress",
                "--methods",
                "none",
                "ssp",
                "--epsilons",
                "5",
            ]
        )
        == 0
    )
    trials = [p for p in counted if p["seed"] < training.TEST_SEED]
    tests = [p for p in counted if p["seed"] >= training.TEST_SEED]
    assert [(p["method"], p["data"]) for p in trials] == [("none", a), ("ssp", a)]
    assert [(p["method"], p["data"], p["config"]) for p in tests] == [(p["method"], b, p["config"]) for p in trials]
    with open(tmp_path / "out" / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["mode"], r["tuned_on"], r["method"], r["epsilon"]) for r in table] == [
        ("transfer", a, "none", "5.0"),
        ("transfer", a, "ssp", "5.0"),
    ]
    assert all(0 < float(r["epsilon_spent"]) <= 5.0 + 1e-6 for r in table)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "transfer mode: tuning costs" in report and "| AM-SSP | transfer: tuned on A | 5 |" in report


def test_dp_popularity_on_the_ranking_protocol(tmp_path, spark, counted):
    """DP popularity runs train.prepare only (the counts release): its epsilon spent is the counts' share."""
    data, out = str(write_ml1m(tmp_path / "ml-1m", users=150)), str(tmp_path / "out")
    assert (
        bench_main.main(
            [
                "privacy-utility",
                "--data",
                data,
                "--out",
                out,
                "--quick",
                "--seeds",
                "1",
                "--no-progress",
                "--protocol",
                "recall",
                "--methods",
                "dp-popularity",
                "--epsilons",
                "5",
            ]
        )
        == 0
    )
    assert [p["seed"] for p in counted] == [0, 1, training.TEST_SEED] and {p["method"] for p in counted} == {
        "dp-popularity"
    }
    values = [c["value"] for c in json.loads((tmp_path / "out" / "results.json").read_text())["cells"].values()]
    assert all(0.0 <= v["valid"] <= 1.0 and 0.0 <= v["test"] <= 1.0 and len(v["test_sliced"]) == 5 for v in values)
    assert all(0.0 < v["epsilon_spent"] < 2.5 for v in values)  # the counts release alone: a share of epsilon 5
    assert not list((tmp_path / "out" / "runs").glob("*/manifest.json"))  # run directories deleted once measured
    with open(tmp_path / "out" / "results.csv") as handle:
        (row,) = list(csv.DictReader(handle))
    assert (row["method"], row["label"], row["metric"]) == ("dp-popularity", "DP popularity", "Recall@20")


def test_unknown_method_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["privacy-utility", "--out", str(tmp_path), "--methods", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_implicit_als_reference_on_the_ranking_protocol(tmp_path, spark, counted):
    """The implicit-ALS reference has nothing to tune: one trial, then the test seed; it is non-private
    (no epsilon spent) and leaves no run directory."""
    data, out = str(write_ml1m(tmp_path / "ml-1m", users=150)), str(tmp_path / "out")
    assert (
        bench_main.main(
            [
                "privacy-utility",
                "--data",
                data,
                "--out",
                out,
                "--quick",
                "--seeds",
                "1",
                "--no-progress",
                "--protocol",
                "recall",
                "--methods",
                "ials",
                "dp-popularity",
                "--epsilons",
                "5",
            ]
        )
        == 0
    )
    assert [p["seed"] for p in counted if p["method"] == "ials"] == [0, training.TEST_SEED]
    assert not list((tmp_path / "out" / "runs").glob("*/manifest.json"))
    with open(tmp_path / "out" / "results.csv") as handle:
        rows = {r["method"]: r for r in csv.DictReader(handle)}
    assert (rows["ials"]["label"], rows["ials"]["epsilon"], rows["ials"]["epsilon_spent"]) == (
        "implicit ALS (non-private, id)",
        "inf",
        "inf",
    )
    assert 0.0 < float(rows["ials"]["mean"]) <= 1.0
