"""trainer.recommend on a hand-made publication: the fold-in, the ranking and the history rules,
against values computed by hand."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from schemas import storage
from schemas.tables import ITEM_EMBEDDINGS
from trainer.recommend import PublishedModel
from trainer.solve import logistic_solve


def publication(folder, protocol="rmse", threshold=None, counts=None, loss="square", biases=None) -> str:
    """Items 10, 20, 30 at e1, e2 and e1 + e2; lambda_u 1, no gravity, DP mean 3 (local or gs://);
    with `counts` (of items 10, 20, 30) the ranking fold-in's popularity column; with `biases` (of
    items 10, 20, 30) a model with biases, items [v, b_j, 1]."""
    path = str(folder)
    embeddings = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    if biases is not None:
        embeddings = [v + [b, 1.0] for v, b in zip(embeddings, [biases[2], biases[0], biases[1]], strict=True)]
    storage.write_table(
        pa.table({"item_id": [30, 10, 20], "embedding": embeddings}, schema=ITEM_EMBEDDINGS),
        storage.join(path, "item_embeddings.parquet"),
    )
    if counts is not None:
        storage.write_table(
            pa.table({"item_id": [20, 10, 30], "count": [counts[1], counts[0], counts[2]]}),
            storage.join(path, "counts.parquet"),
        )
    settings = {
        "protocol": protocol,
        "dim": 2 if biases is None else 4,
        "lambda_u": 1.0,
        "gravity": 0.0,
        "dp_mean": 3.0 if protocol == "rmse" else None,
        "rating_range": [0.5, 5.0],
        "positive_threshold": threshold,
        "encoder": "features",
        "feature_families": {},
        "popularity_column": counts is not None and protocol == "recall",
        "loss": loss,
        "biases": biases is not None,
        "lambda_bias": None,
    }
    storage.write_json(settings, storage.join(path, "model.json"))
    storage.write_json({"run": "r"}, storage.join(path, "_PUBLISHED"))
    return path


def test_a_rating_is_folded_in_by_the_ridge_and_the_best_unseen_items_come_first(tmp_path):
    model = PublishedModel.load(publication(tmp_path))
    # one rating 4 of item 10: target 4 - 3 = 1; u = (v v^T + 1 * 1 * I)^-1 v = (0.5, 0)
    users, u = model.fold_in(np.array([7]), np.array([0]), np.array([4.0]))
    np.testing.assert_allclose(u, [[0.5, 0.0]])
    history = pa.table({"user_id": [7], "item_id": [10], "label": [4.0]})
    top = model.recommend(history, k=2, exclude_seen=True)
    # the score is the predicted rating: DP mean 3 + u . v
    assert top.to_pydict() == {"user_id": [7, 7], "rank": [1, 2], "item_id": [30, 20], "score": [3.5, 3.0]}
    # with the history: items 10 and 30 tie at 0.5, the smaller id first
    assert model.recommend(history, k=2, exclude_seen=False)["item_id"].to_pylist() == [10, 30]


def test_the_ranking_protocol_folds_in_positives_and_excludes_every_seen_item(tmp_path):
    model = PublishedModel.load(publication(tmp_path, "recall", threshold=3.5))
    history = pa.table(
        {"user_id": [1, 1, 1], "item_id": [20, 30, 99], "label": [5.0, 2.0, 5.0]}
    )  # 30: not a positive; 99: not in the catalog
    _, u = model.fold_in(np.array([1]), np.array([1]), None)  # item 20 alone, target 1
    top = model.recommend(history, k=3, exclude_seen=True)
    assert top["item_id"].to_pylist() == [10] and top["score"].to_pylist() == pytest.approx([float(u[0] @ [1.0, 0.0])])
    np.testing.assert_allclose(u, [[0.0, 0.5]])


def test_an_implicit_models_history_counts_a_users_rows_of_one_item_as_training_does(tmp_path):
    """One row per play, one row with its play count as label, and the fold-in of the counts agree;
    weighing each row once (the rows as they came) would not."""
    path = publication(tmp_path, "recall")
    storage.write_json(
        {**storage.read_json(storage.join(path, "model.json")), "confidence_alpha": 1.0},
        storage.join(path, "model.json"),
    )
    model = PublishedModel.load(path)
    plays = pa.table({"user_id": [5, 5, 5, 5], "item_id": [10, 20, 10, 10]})
    counted = pa.table({"user_id": [5, 5], "item_id": [20, 10], "label": [1.0, 3.0]})
    _, u = model.fold_in(np.array([5, 5]), np.array([0, 1]), np.array([3.0, 1.0]))
    _, once = model.fold_in(np.array([5, 5, 5, 5]), np.array([0, 1, 0, 0]), np.ones(4))
    assert not np.allclose(u, once)
    expected = u[0] @ [1.0, 1.0]  # item 30, the only unseen one
    for history in (plays, counted):
        top = model.recommend(history, k=1)
        assert top["item_id"].to_pylist() == [30] and top["score"].to_pylist() == pytest.approx([expected])
    for bad, shown in ((0.5, "0.5"), (float("nan"), "nan"), (None, "empty")):
        with pytest.raises(
            ValueError, match=f"the history: row 2 has label {shown} \\(an implicit-feedback model reads"
        ):
            model.recommend(pa.table({"user_id": [5, 5], "item_id": [10, 20], "label": [2.0, bad]}))


def test_a_histories_count_column_is_named_with_count_col_and_an_unread_one_is_said_through_the_installed_command(
    tmp_path,
):
    """--count-col plays: the same top item and score as one row per play; without it the column is
    named as unread on stderr and each row counts once; --label-col on an implicit model and an
    unknown column are one error line."""
    path = publication(tmp_path / "published", "recall")
    storage.write_json(
        {**storage.read_json(storage.join(path, "model.json")), "confidence_alpha": 1.0},
        storage.join(path, "model.json"),
    )
    (tmp_path / "plays.csv").write_text("listener,track\n5,10\n5,20\n5,10\n5,10\n")
    (tmp_path / "counted.csv").write_text("listener,track,plays\n5,20,1\n5,10,3\n")
    ids = ("--user-col", "listener", "--item-col", "track")
    per_play = installed_ssp("recommend", "--model", path, "--history", tmp_path / "plays.csv", *ids, "--k", 1)
    counted = installed_ssp(
        "recommend", "--model", path, "--history", tmp_path / "counted.csv", *ids, "--k", 1, "--count-col", "plays"
    )
    assert per_play.returncode == counted.returncode == 0, per_play.stderr + counted.stderr
    _, u = PublishedModel.load(path).fold_in(np.array([5, 5]), np.array([0, 1]), np.array([3.0, 1.0]))
    expected = f"5,1,30,{u[0] @ [1.0, 1.0]:.6g}"  # item 30, the only unseen one
    assert per_play.stdout.splitlines() == counted.stdout.splitlines() == ["listener,rank,track,score", expected]
    unread = installed_ssp("recommend", "--model", path, "--history", tmp_path / "counted.csv", *ids, "--k", 1)
    assert unread.returncode == 0 and "column(s) plays not read, each row counts once" in unread.stderr
    assert unread.stdout.splitlines()[1] != expected
    one_error_line(
        installed_ssp(
            "recommend", "--model", path, "--history", tmp_path / "counted.csv", *ids, "--label-col", "plays"
        ),
        "--label-col",
        "implicit feedback",
        "--count-col",
    )
    one_error_line(
        installed_ssp("recommend", "--model", path, "--history", tmp_path / "counted.csv", *ids, "--count-col", "n"),
        "--count-col n",
        "no such column",
        "plays",
    )


def test_recommendations_carry_the_catalogs_titles_and_the_stdout_csv_quotes_them(tmp_path, capsys):
    path = publication(tmp_path, "recall")
    storage.write_table(
        pa.table({"item_id": [30, 10], "title": ['Heat, "the film"', "Up"]}), storage.join(path, "titles.parquet")
    )
    model = PublishedModel.load(path)
    top = model.recommend(pa.table({"user_id": [1], "item_id": [20]}), k=2)
    assert top["item_id"].to_pylist() == [30, 10] and top["title"].to_pylist() == ['Heat, "the film"', "Up"]
    untitled = model.recommend(pa.table({"user_id": [1], "item_id": [10]}), k=2)
    assert untitled["item_id"].to_pylist() == [30, 20] and untitled["title"].to_pylist() == ['Heat, "the film"', None]
    assert (
        "title"
        not in PublishedModel.load(publication(tmp_path / "plain", "recall"))
        .recommend(pa.table({"user_id": [1], "item_id": [20]}), k=2)
        .column_names
    )
    history = tmp_path / "history.csv"
    history.write_text("user_id,item_id\n1,20\n")
    result = installed_ssp("recommend", "--model", path, "--history", history, "--k", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == "user_id,rank,item_id,score,title"
    first, second = result.stdout.splitlines()[1:]
    assert first.startswith("1,1,30,") and first.endswith(',"Heat, ""the film"""')
    assert second.startswith("1,2,10,") and second.endswith(",Up")


def test_a_ranking_model_folds_in_with_the_dp_counts_as_one_more_column(tmp_path):
    model = PublishedModel.load(publication(tmp_path, "recall", counts=[1.0, 2.0, 2.0]))
    # the trained columns' RMS norm is sqrt(2) (Frobenius 2, d 2) and the counts' norm 3: column sqrt(2)/3 (1, 2, 2)
    p = np.sqrt(2) / 3 * np.array([1.0, 2.0, 2.0])
    np.testing.assert_allclose(model.vectors, np.c_[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], p])
    # item 10 alone, target 1, lambda_u 1 x 1 row: u = (x x^T + I)^-1 x with x = (1, 0, p_10), that is x / (1 + |x|^2)
    x = np.array([1.0, 0.0, p[0]])
    _, u = model.fold_in(np.array([4]), np.array([0]), None)
    np.testing.assert_allclose(u, [x / (1 + x @ x)])
    top = model.recommend(pa.table({"user_id": [4], "item_id": [10]}), k=2, exclude_seen=True)
    assert top["item_id"].to_pylist() == [30, 20] and top["score"].to_pylist() == pytest.approx(
        [u[0] @ [1.0, 1.0, p[2]], u[0] @ [0.0, 1.0, p[1]]]
    )


def test_a_ranking_model_with_item_biases_holds_each_users_bias_at_zero_and_keeps_the_bias_pair_last(tmp_path):
    """Items [v, b_j, 1] with the popularity column after v: [v, p_j, b_j, 1]. Item 10 alone, target 1:
    the user solves x = (v, p) against 1 - b_10 with ridge 1, x / (1 + |x|^2) (1 - b_10), and is
    [u, 1, 0]: every score is u . (v, p) + b_j."""
    model = PublishedModel.load(publication(tmp_path, "recall", counts=[1.0, 2.0, 2.0], biases=[0.25, -0.5, 0.75]))
    p = np.sqrt(2) / 3 * np.array([1.0, 2.0, 2.0])  # the embedding's RMS norm, as without biases
    np.testing.assert_allclose(
        model.vectors, np.c_[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], p, [0.25, -0.5, 0.75], np.ones(3)]
    )
    x = np.array([1.0, 0.0, p[0]])
    _, u = model.fold_in(np.array([4]), np.array([0]), None)
    np.testing.assert_allclose(u, [np.r_[x / (1 + x @ x) * (1 - 0.25), 1.0, 0.0]])
    top = model.recommend(pa.table({"user_id": [4], "item_id": [10]}), k=2, exclude_seen=True)
    scores = {30: u[0, :3] @ [1.0, 1.0, p[2]] + 0.75, 20: u[0, :3] @ [0.0, 1.0, p[1]] - 0.5}
    assert top["item_id"].to_pylist() == [30, 20] and top["score"].to_pylist() == pytest.approx(
        [scores[30], scores[20]]
    )


def test_a_logistic_model_folds_in_with_every_item_a_negative_as_its_evaluation(tmp_path):
    model = PublishedModel.load(publication(tmp_path, "recall", loss="logistic"))
    users, u = model.fold_in(np.array([4, 4]), np.array([0, 2]), None)
    expected_users, expected = logistic_solve(np.array([4, 4]), model.vectors[[0, 2]], model.vectors, 1.0)
    np.testing.assert_array_equal(users, expected_users)
    np.testing.assert_allclose(u, expected)
    ridge = PublishedModel.load(publication(tmp_path / "square", "recall")).fold_in(
        np.array([4, 4]), np.array([0, 2]), None
    )[1]
    assert not np.allclose(u, ridge)


def test_a_regression_model_needs_the_ratings_and_a_bad_k_is_refused(tmp_path):
    model = PublishedModel.load(publication(tmp_path))
    with pytest.raises(ValueError, match="needs a label column"):
        model.recommend(pa.table({"user_id": [1], "item_id": [10]}))
    with pytest.raises(ValueError, match="--k must be a positive number"):
        model.recommend(pa.table({"user_id": [1], "item_id": [10], "label": [4.0]}), k=0)
    with pytest.raises(ValueError, match="the history: row 1 has label nan"):
        model.recommend(pa.table({"user_id": [1], "item_id": [10], "label": [float("nan")]}))
    with pytest.raises(ValueError, match="cannot embed new items"):
        model.embed_new_items(pa.table({"item_id": [5]}))
    assert json.load(open(tmp_path / "model.json"))["dim"] == 2


def test_a_publication_and_histories_on_gcs(gcs_path):
    from ssp import cli

    model = publication(f"{gcs_path}/published")
    storage.write_table(pa.table({"user_id": [7], "item_id": [10], "label": [4.0]}), f"{gcs_path}/history.parquet")
    assert (
        cli.main(
            [
                "recommend",
                "--model",
                model,
                "--history",
                f"{gcs_path}/history.parquet",
                "--k",
                "2",
                "--out",
                f"{gcs_path}/top.parquet",
            ]
        )
        == 0
    )
    assert storage.read_table(f"{gcs_path}/top.parquet")["item_id"].to_pylist() == [30, 20]


def test_a_counts_release_naming_an_item_without_an_embedding_is_one_line_through_the_installed_command(tmp_path):
    path = publication(tmp_path / "published", "recall", counts=[1.0, 2.0, 2.0])
    storage.write_table(
        pa.table({"item_id": [10, 20, 99], "count": [1.0, 2.0, 3.0]}), storage.join(path, "counts.parquet")
    )
    (tmp_path / "history.csv").write_text("user_id,item_id\n1,10\n")
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    result = subprocess.run(
        [installed, "recommend", "--model", path, "--history", str(tmp_path / "history.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr.strip().splitlines()[-1].startswith("ssp recommend: error: ")
        and "counts.parquet" in result.stderr
        and "99" in result.stderr
    )
    assert "Traceback" not in result.stderr


def installed_ssp(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ssp"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(result: subprocess.CompletedProcess, *names: str) -> None:
    """Exit 2, no traceback, nothing on stdout, the last stderr line the error naming each of `names`."""
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("ssp recommend: error: ") and all(name in line for name in names), (names, line)


def test_bad_histories_and_new_items_are_one_line_through_the_installed_command(tmp_path):
    """An empty item id (a user with no history), a header alone, string ids, a rating outside the model's scale, a
    --new-items table keyed by another column, an --out that is neither .csv nor .parquet."""
    model = publication(tmp_path / "published")
    (tmp_path / "empty.csv").write_text("user_id,item_id,label\n1,10,4\n2,,3\n")
    one_error_line(
        installed_ssp("recommend", "--model", model, "--history", tmp_path / "empty.csv"),
        "empty.csv",
        "row 2",
        "item_id",
        "empty value",
    )
    (tmp_path / "header.csv").write_text("user_id,item_id,label\n")
    one_error_line(
        installed_ssp("recommend", "--model", model, "--history", tmp_path / "header.csv"), "header.csv", "no rows"
    )
    (tmp_path / "strings.csv").write_text("user_id,item_id,label\nann,sku-10,4\n")  # a catalog of integer ids
    one_error_line(
        installed_ssp("recommend", "--model", model, "--history", tmp_path / "strings.csv"),
        "strings.csv",
        "'item_id'",
        "'sku-10'",
        "not integer ids",
    )
    (tmp_path / "scale.csv").write_text("user_id,item_id,label\n1,10,4\n1,20,40\n")
    one_error_line(
        installed_ssp("recommend", "--model", model, "--history", tmp_path / "scale.csv"),
        "scale.csv",
        "row 2",
        "label 40",
        "0.5..5",
    )
    (tmp_path / "history.csv").write_text("user_id,item_id,label\n1,10,4\n")
    (tmp_path / "new.csv").write_text("sku,brand\n50,acme\n")
    one_error_line(
        installed_ssp(
            "recommend", "--model", model, "--history", tmp_path / "history.csv", "--new-items", tmp_path / "new.csv"
        ),
        "new.csv",
        "'item_id'",
        "sku, brand",
        "--item-col",
    )
    one_error_line(
        installed_ssp(
            "recommend", "--model", model, "--history", tmp_path / "history.csv", "--out", tmp_path / "top.txt"
        ),
        "top.txt",
        ".csv",
        ".parquet",
    )
    assert not (tmp_path / "top.txt").exists()


def test_own_column_names_csv_out_seen_items_and_a_new_user_through_the_installed_command(tmp_path):
    """--user-col / --item-col; seen items left out unless --include-seen; --out by extension; a user
    whose history names no catalog item gets the DP popularity ranking (scored by the DP counts), with
    a note and the unknown items counted on stderr, listed with -v."""
    model = publication(tmp_path / "published", counts=[5.0, 9.0, 7.0])  # a ratings model shipping its DP counts
    (tmp_path / "h.csv").write_text("customer,sku,label\n7,10,4\n8,99,5\n8,98,2\n")
    result = installed_ssp(
        "recommend",
        "--model",
        model,
        "--history",
        tmp_path / "h.csv",
        "--user-col",
        "customer",
        "--item-col",
        "sku",
        "--k",
        "2",
        "--out",
        tmp_path / "top.csv",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "top.csv").read_text().splitlines() == [
        '"customer","rank","sku","score"',  # the history's own column names
        "7,1,30,3.5",
        "7,2,20,3",  # u = (0.5, 0): DP mean 3 + u . v, item 10 (seen) left out
        "8,1,20,9",
        "8,2,30,7",
    ]  # no catalog item: the DP popularity ranking
    assert (
        "2 history row(s) name 2 item(s) outside the model's catalog" in result.stderr
        and "-v lists them" in result.stderr
    )
    assert "1 user(s) with no catalog item to fold in: the DP popularity ranking" in result.stderr
    verbose = installed_ssp(
        "recommend",
        "-v",
        "--model",
        model,
        "--history",
        tmp_path / "h.csv",
        "--user-col",
        "customer",
        "--item-col",
        "sku",
        "--include-seen",
        "--k",
        "1",
    )
    assert verbose.returncode == 0 and "items outside the catalog: 98, 99" in verbose.stderr
    assert verbose.stdout.splitlines() == [
        "customer,rank,sku,score",  # the history's own column names
        "7,1,10,3.5",
        "8,1,20,9",
    ]  # item 10 ties 30 at 3.5, the smaller id first
