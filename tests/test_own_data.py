"""A user's own data, end to end: generic Parquet tables with implicit feedback are ingested, trained
on (ranking protocol), published, and served by `ssp recommend` from the publication alone.

The data are planted: each user favours one brand and two tags, and clicks the items that match.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv  # noqa: F401 (pa.csv)
import pyarrow.parquet as pq
import pytest

from pipelines.training import prepare, settings, stages
from pipelines.training.publish import publish
from pipelines.training.run_dir import Run
from schemas import storage
from ssp import cli
from trainer import evaluate
from trainer.recommend import PublishedModel
from trainer.solve import confidence

BRANDS, TAGS = ["acme", "globex", "initech", "umbrella"], [f"t{k}" for k in range(8)]
OWN_DATA_DOC = Path(__file__).resolve().parents[1] / "docs" / "own-data.md"


# the last products of the catalog are left out of training: added after it, they are embedded from their features
HELD_OUT = 12


def planted_tables(folder: Path, users: int = 500, items: int = 160, seed: int = 0) -> tuple[Path, Path]:
    """clicks.parquet (customer, product, ts; no label: implicit feedback; a third of the customers
    played their first product twice, a third three times), products.parquet (the
    catalog trained on) and products_all.parquet (with the HELD_OUT products added after training),
    and tastes.parquet (each customer's planted brand)."""
    rng = np.random.default_rng(seed)
    brand = rng.integers(0, len(BRANDS), items)
    tags = [sorted(set(rng.choice(len(TAGS), 2).tolist())) for _ in range(items)]
    product = np.arange(1000, 1000 + items)
    price = (
        np.random.default_rng(seed + 1).lognormal(3.0, 0.6, items).round(2)
    )  # a quantity: ingested as a number, bucketed
    catalog = pa.table(
        {
            "product": product,
            "name": [f"p{p}" for p in product],
            "brand": [BRANDS[b] for b in brand],
            "tags": [[TAGS[t] for t in ts] for ts in tags],
            "year": rng.integers(2015, 2020, items),
            "price": price,
        }
    )
    rows, tastes = [], []
    for user in range(users):
        liked_brand, liked_tags = rng.integers(0, len(BRANDS)), set(rng.choice(len(TAGS), 2, replace=False).tolist())
        affinity = (brand == liked_brand) * 2.0 + np.array([len(liked_tags & set(ts)) for ts in tags]) + 0.05
        affinity[items - HELD_OUT :] = 0.0  # not yet in the catalog when the log was written
        chosen = rng.choice(items, size=int(rng.integers(8, 25)), replace=False, p=affinity / affinity.sum())
        rows += [(10_000 + user, int(product[j]), int(1_600_000_000 + rng.integers(0, 10**7))) for j in chosen]
        rows += [
            (10_000 + user, int(product[chosen[0]]), 1_700_000_000 + k) for k in range(user % 3)
        ]  # repeated plays: 1, 2 or 3 of the first
        tastes.append((10_000 + user, BRANDS[liked_brand]))
    customer, item, ts = map(np.array, zip(*rows, strict=True))
    clicks = pa.table({"customer": customer, "product": item, "ts": ts})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(clicks, folder / "clicks.parquet")
    pq.write_table(catalog.slice(0, items - HELD_OUT), folder / "products.parquet")
    pq.write_table(catalog, folder / "products_all.parquet")
    pq.write_table(
        pa.table({"user_id": [u for u, _ in tastes], "brand": [b for _, b in tastes]}), folder / "tastes.parquet"
    )
    return folder / "clicks.parquet", folder / "products.parquet"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The planted tables ingested, trained (ranking protocol, implicit feedback; on the local engine,
    which releases the Spark engine's bits: tests/pipelines/engines/test_local.py) and published."""
    root = tmp_path_factory.mktemp("own-data")
    clicks, products = planted_tables(root / "raw")
    assert (
        cli.main(
            [
                "ingest",
                "--interactions",
                str(clicks),
                "--catalog",
                str(products),
                "--user-col",
                "customer",
                "--item-col",
                "product",
                "--timestamp-col",
                "ts",
                "--title-col",
                "name",
                "--features",
                "brand:value,tags:bag,year:value,price:number",
                "--out",
                str(root / "data"),
            ]
        )
        == 0
    )
    config = settings.TrainConfig.create(
        data=str(root / "data"),
        out=str(root / "run"),
        protocol="recall",
        epsilon=8.0,
        outer_steps=2,
        epochs=3,
        dim=8,
        engine="local",
    )
    metrics = stages.run(config, progress=False)
    publish(Run(str(root / "run")), str(root / "published"))
    return root, metrics


def test_a_held_out_user_gets_the_evaluations_top_k_from_the_publication_alone(published):
    root, metrics = published
    assert metrics["test_recall_at_20"] > 0.3  # the planted taste is learnt (random: about 20/160)
    # DP popularity's Recall@20 beside it, from the run's own counts release (the same metric code, by the counts alone)
    assert (
        0 < metrics["test_popularity_recall_at_20"] < metrics["test_recall_at_20"]
        and len(metrics["test_popularity_recall_at_20_sliced"]) == 5
    )
    from pipelines.training.evaluation import describe

    assert (
        f"DP popularity (the run's counts release): test Recall@20 {metrics['test_popularity_recall_at_20']:.4f}; "
        f"same fifths" in describe(metrics)
    )
    model = PublishedModel.load(str(root / "published"))
    assert model.settings["positive_threshold"] is None and model.settings["protocol"] == "recall"
    # repeated plays: the split counts them, the ranking rows weigh their confidence, model.json carries the rule
    train = storage.read_table(str(root / "run" / "private" / "split" / "train.parquet"))
    assert set(train["label"].to_pylist()) == {1.0, 2.0, 3.0} and model.settings["confidence_alpha"] == 1.0
    rows = storage.read_table(str(root / "run" / "private" / "train_centred.parquet")).sort_by(
        [("user_id", "ascending"), ("item_id", "ascending")]
    )
    train = train.sort_by([("user_id", "ascending"), ("item_id", "ascending")])
    np.testing.assert_allclose(rows["label"].to_numpy(), confidence(train["label"].to_numpy(), 1.0))
    report = (root / "published" / "privacy.md").read_text()  # implicit feedback: interactions, not ratings
    assert "all the interactions of one user" in report and "how many users interacted with each" in report
    assert not re.search(r"\b(rated|ratings?)\b", report), re.search(r".*\b(rated|ratings?)\b.*", report).group(0)
    history = storage.read_table(str(root / "run" / "private" / "split" / "test_history.parquet"))
    targets = storage.read_table(str(root / "run" / "private" / "split" / "test_targets.parquet"))
    users = np.intersect1d(
        history["user_id"].to_numpy(), targets["user_id"].to_numpy()
    )  # the users the evaluation scores
    top = model.recommend(
        history.filter(pa.array(np.isin(history["user_id"].to_numpy(), users))), k=10, exclude_seen=True
    )
    assert set(top["user_id"].to_pylist()) == set(users.tolist()) and top.num_rows == 10 * users.size
    # the evaluation's own fold-in, given the recommended items as targets: every one is in its top 10
    run_items = storage.read_table(str(root / "run" / "item_embeddings.parquet")).sort_by("item_id")
    counts = storage.read_table(str(root / "run" / "counts" / "counts.parquet")).sort_by(
        "item_id"
    )  # the DP counts release
    assert model.settings["popularity_column"] and np.array_equal(
        counts["item_id"].to_numpy(), run_items["item_id"].to_numpy()
    )
    assert (
        model.settings["gravity"] == settings.FOLD_IN_GRAVITY
    )  # the ranked user's fold-in, as the run's evaluation folded in (not training's 0.1)
    vectors = evaluate.with_popularity(
        np.array(run_items["embedding"].to_pylist()), counts["count"].to_numpy()
    )  # the run's fold-in (the default)
    positions = lambda ids: np.searchsorted(run_items["item_id"].to_numpy(), ids)  # noqa: E731
    weights = confidence(
        history["label"].to_numpy(), model.settings["confidence_alpha"]
    )  # the history's repeats, as the run's evaluation weighs them
    report = evaluate.ranking_report(
        (history["user_id"].to_numpy(), positions(history["item_id"].to_numpy()), weights),
        (top["user_id"].to_numpy(), positions(top["item_id"].to_numpy())),
        vectors,
        model.settings["lambda_u"],
        item_buckets=np.zeros(vectors.shape[0], np.int64),
        gravity=model.settings["gravity"],
        confidence=True,
    )
    # the 10 recommended are the evaluation's first 10: every one found, each at its ideal rank
    assert report["recall_at_20"] == 1.0 and report["ndcg_at_100"] == pytest.approx(1.0)
    assert report["users"] == users.size
    scores = top["score"].to_numpy().reshape(users.size, 10)
    assert np.all(np.diff(scores, axis=1) <= 0)  # ranked best first


def test_the_batch_mode_reads_parquet_histories_and_writes_parquet(published, tmp_path):
    root, _ = published
    history = storage.read_table(str(root / "run" / "private" / "split" / "valid_history.parquet"))
    pq.write_table(history.select(["user_id", "item_id"]), tmp_path / "histories.parquet")
    assert (
        cli.main(
            [
                "recommend",
                "--model",
                str(root / "published"),
                "--history",
                str(tmp_path / "histories.parquet"),
                "--k",
                "5",
                "--out",
                str(tmp_path / "top.parquet"),
            ]
        )
        == 0
    )
    written = pq.read_table(tmp_path / "top.parquet")
    expected = PublishedModel.load(str(root / "published")).recommend(
        history.select(["user_id", "item_id"]), k=5, exclude_seen=True
    )
    assert written.equals(expected) and written.num_rows == 5 * len(set(history["user_id"].to_pylist()))


def test_a_new_catalog_item_is_embedded_from_its_features_and_scored(published, tmp_path):
    root, _ = published
    model = PublishedModel.load(str(root / "published"))
    products = pq.read_table(root / "raw" / "products.parquet")
    # a new item that copies catalog item 1000's public features embeds as the shared encoder says of it
    twin = pa.table(
        {
            "item_id": [5000],
            "brand": products["brand"][:1],
            "tags": products["tags"][:1],
            "year": products["year"][:1],
            "price": products["price"][:1],
        }
    )
    (tmp_path / "new.csv").write_text(
        "item_id,brand,tags,year,price\n5000,{},{},{},{}\n5001,newbrand,,2030,\n".format(
            products["brand"][0].as_py(),
            "|".join(products["tags"][0].as_py()),
            products["year"][0].as_py(),
            products["price"][0].as_py(),
        )
    )
    embedded = model.embed_new_items(twin)
    assert embedded.shape == (1, 8 + 1) and np.all(np.isfinite(embedded))  # d, then the popularity column
    # the column: the twin's popularity by features, the mean over its values of the mean DP count of the
    # catalog items holding each (the price by its published bucket), on the column's scale
    count = dict(zip(model.item_ids.tolist(), np.maximum(model.popularity, 1.0), strict=True))
    counts = np.array([count[item] for item in products["product"].to_pylist()])
    brand, tags, year, price = (products[name].to_pylist() for name in ("brand", "tags", "year", "price"))
    means = [counts[[b == brand[0] for b in brand]].mean(), counts[[y == year[0] for y in year]].mean()]
    means += [counts[[tag in bag for bag in tags]].mean() for tag in set(tags[0])]
    buckets = model.feature_popularity.filter(pa.compute.equal(model.feature_popularity["family"], "price"))
    (bucket,) = [row for row in buckets.to_pylist() if row["low"] <= price[0] < row["high"]]
    in_bucket = [p is not None and bucket["low"] <= p < bucket["high"] for p in price]
    assert bucket["mean_count"] == pytest.approx(counts[in_bucket].mean())
    scale = model.vectors[0, 8] / max(model.popularity[0], 1.0)
    assert embedded[0, 8] == pytest.approx(scale * np.mean([*means, bucket["mean_count"]]), rel=1e-9)
    # a user who clicked only items of the twin's brand gets the twin among their recommendations' scores
    same = products.filter(pa.compute.equal(products["brand"], products["brand"][0]))["product"].to_numpy()[:5]
    (tmp_path / "history.csv").write_text("user_id,item_id\n" + "".join(f"7,{item}\n" for item in same))
    out = tmp_path / "recs.parquet"
    assert (
        cli.main(
            [
                "recommend",
                "--model",
                str(root / "published"),
                "--history",
                str(tmp_path / "history.csv"),
                "--new-items",
                str(tmp_path / "new.csv"),
                "--k",
                "200",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    recs = pq.read_table(out)
    assert recs.num_rows == products.num_rows + 2 - 5 and {5000, 5001} <= set(recs["item_id"].to_pylist())
    twin_score = recs.filter(pa.compute.equal(recs["item_id"], 5000))["score"][0].as_py()
    user = model.fold_in(np.full(5, 7), np.searchsorted(model.item_ids, same), None)[1][0]
    assert twin_score == pytest.approx(float(user @ embedded[0]), rel=1e-5)


def test_items_held_out_of_training_are_embedded_from_their_features_and_ranked_by_taste(published):
    """The products added after training reach, through `embed_features` alone, the users whose
    planted brand they carry: they score higher for those users than for the others."""
    root, _ = published
    model = PublishedModel.load(str(root / "published"))
    products = pq.read_table(root / "raw" / "products_all.parquet")
    added = products.slice(products.num_rows - HELD_OUT).rename_columns(
        ["item_id", "name", "brand", "tags", "year", "price"]
    )
    assert not np.isin(added["item_id"].to_numpy(), model.item_ids).any()  # never trained on
    history = storage.read_table(str(root / "run" / "private" / "split" / "test_history.parquet"))
    users, vectors = model.fold_in(
        history["user_id"].to_numpy(), np.searchsorted(model.item_ids, history["item_id"].to_numpy()), None
    )
    scores = vectors @ model.embed_new_items(added).T  # (users, added items)
    tastes = pq.read_table(root / "raw" / "tastes.parquet")
    liked = np.array(tastes["brand"].to_pylist())[np.searchsorted(tastes["user_id"].to_numpy(), users)]
    matches = liked[:, None] == np.array(added["brand"].to_pylist())[None, :]
    wins = [
        scores[matches[:, j], j].mean() > scores[~matches[:, j], j].mean()
        for j in range(HELD_OUT)
        if matches[:, j].any()
    ]
    assert np.mean(wins) >= 0.9, wins


def test_the_documented_python_example_recommends_for_one_history(published, tmp_path, monkeypatch):
    root, _ = published
    block = re.search(r"```python\n(from trainer.recommend import.*?)```", OWN_DATA_DOC.read_text(), re.S)
    assert block, "docs/own-data.md lost its Python recommend example"
    (tmp_path / "published").symlink_to(root / "published")
    monkeypatch.chdir(tmp_path)
    result = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) >= 10  # a table of the top items


SERVING_CLIENT = """
import json, sys
import tensorflow as tf
histories = json.load(open(sys.argv[2]))
serve = tf.saved_model.load(sys.argv[1]).signatures["recommend"]
width = max(len(items) for items in histories.values())
padded = [items + [-1] * (width - len(items)) for items in histories.values()]
out = serve(item_ids=tf.constant(padded, tf.int64), k=tf.constant(10))
assert not any(name.split(".")[0] in ("trainer", "pipelines", "privacy", "schemas", "ssp") for name in sys.modules)
json.dump(dict(zip(histories, out["item_ids"].numpy().tolist())), sys.stdout)
"""


def test_the_recommend_signature_serves_ssp_recommends_top_k_from_plain_tensorflow(published, tmp_path):
    """The publication's `recommender/` SavedModel, loaded by a Python that imports TensorFlow alone
    (as TF Serving would), gives every held-out user the top 10 of the installed `ssp recommend`."""
    root, _ = published
    history = storage.read_table(str(root / "run" / "private" / "split" / "test_history.parquet")).select(
        ["user_id", "item_id"]
    )
    pq.write_table(history.rename_columns(["customer", "product"]), tmp_path / "history.parquet")
    ssp = Path(sys.executable).with_name("ssp")
    done = subprocess.run(
        [
            str(ssp),
            "recommend",
            "--model",
            str(root / "published"),
            "--history",
            str(tmp_path / "history.parquet"),
            "--user-col",
            "customer",
            "--item-col",
            "product",
            "--k",
            "10",
            "--out",
            str(tmp_path / "top.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    top = pa.csv.read_csv(tmp_path / "top.csv")
    users = history["user_id"].to_numpy()
    histories = {str(u): history["item_id"].to_numpy()[users == u].tolist() for u in np.unique(users)}
    (tmp_path / "histories.json").write_text(json.dumps(histories))
    served = subprocess.run(
        [
            sys.executable,
            "-c",
            SERVING_CLIENT,
            str(root / "published" / "recommender"),
            str(tmp_path / "histories.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert served.returncode == 0, served.stderr[-3000:]
    served = json.loads(served.stdout)
    assert len(served) == len(histories) > 20
    for user, items in served.items():
        assert items == top.filter(pa.compute.equal(top["customer"], int(user)))["product"].to_pylist(), user


def test_a_bad_history_is_one_clear_line(published, tmp_path, capsys):
    root, _ = published
    (tmp_path / "h.csv").write_text("customer,product\n1,2\n")
    assert cli.main(["recommend", "--model", str(root / "published"), "--history", str(tmp_path / "h.csv")]) == 2
    assert (
        "h.csv has no 'user_id' column (columns: customer, product); name its user id column with --user-col"
        in capsys.readouterr().err
    )
    assert cli.main(["recommend", "--model", str(root / "run"), "--history", str(tmp_path / "h.csv")]) == 2
    assert "is not a complete publication" in capsys.readouterr().err


def test_a_regression_run_on_implicit_feedback_is_refused_before_any_release(published, tmp_path):
    root, _ = published
    with pytest.raises(ValueError, match="implicit feedback"):
        prepare.prepare(
            settings.TrainConfig.create(data=str(root / "data"), out=str(tmp_path / "run"), epsilon=8.0), progress=False
        )
    assert not (tmp_path / "run" / "ledger.parquet").exists()


def test_a_new_item_whose_number_feature_is_not_a_number_is_one_line_naming_its_row(published, tmp_path):
    """Through the installed `ssp recommend`: refused before the encoder reads it (exit 2, one line, nothing
    written), as a catalog row is at ingest."""
    root, _ = published
    (tmp_path / "history.csv").write_text("user_id,item_id\n7,1000\n")
    (tmp_path / "new.csv").write_text("item_id,brand,tags,year,price\n5000,b,x,2020,9.5\n5001,b,x,2020,cheap\n")
    out = tmp_path / "recs.csv"
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("ssp")),
            "recommend",
            "--model",
            str(root / "published"),
            "--history",
            str(tmp_path / "history.csv"),
            "--new-items",
            str(tmp_path / "new.csv"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and not out.exists(), done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "ssp recommend: error: the new items' 'price' column is a number feature, but row 2 holds 'cheap'"
    ]


COUNTS_CLIENT = """
import json, sys
import tensorflow as tf
histories = json.load(open(sys.argv[2]))
model = tf.saved_model.load(sys.argv[1])
width = max(len(items) for items, _ in histories.values())
items = [row + [-1] * (width - len(row)) for row, _ in histories.values()]
counts = [row + [1.0] * (width - len(row)) for _, row in histories.values()]
with_counts = model.signatures["recommend_with_counts"](
    item_ids=tf.constant(items, tf.int64), counts=tf.constant(counts, tf.float32), k=tf.constant(10)
)
once = model.signatures["recommend"](item_ids=tf.constant(items, tf.int64), k=tf.constant(10))
json.dump([dict(zip(histories, out["item_ids"].numpy().tolist())) for out in (with_counts, once)], sys.stdout)
"""


def test_repeated_plays_weigh_the_same_in_the_serving_signature_as_in_ssp_recommend(published, tmp_path):
    """A history of one row per play (`ssp recommend` sums a pair's rows into its count) and the same
    history given once per item with its count to `recommend_with_counts` get the same top 10; the
    counts matter (`recommend`, each item once, ranks some users otherwise)."""
    root, _ = published
    history = storage.read_table(str(root / "run" / "private" / "split" / "test_history.parquet"))
    users, items = history["user_id"].to_numpy(), history["item_id"].to_numpy()
    plays = {}
    for user in np.unique(users):
        mine = items[users == user]
        plays[str(user)] = (
            mine.tolist(),
            [1.0 + 6.0 * (position == 0) + 2.0 * (position == 1) for position in range(mine.size)],
        )
    rows = [
        (int(user), item)
        for user, (mine, counts) in plays.items()
        for item, n in zip(mine, counts, strict=True)
        for _ in range(int(n))
    ]
    pq.write_table(
        pa.table({"customer": [u for u, _ in rows], "product": [i for _, i in rows]}), tmp_path / "plays.parquet"
    )
    ssp = Path(sys.executable).with_name("ssp")
    done = subprocess.run(
        [str(ssp), "recommend", "--model", str(root / "published"), "--history", str(tmp_path / "plays.parquet")]
        + ["--user-col", "customer", "--item-col", "product", "--k", "10", "--out", str(tmp_path / "top.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    top = pa.csv.read_csv(tmp_path / "top.csv")
    (tmp_path / "plays.json").write_text(json.dumps(plays))
    served = subprocess.run(
        [sys.executable, "-c", COUNTS_CLIENT, str(root / "published" / "recommender"), str(tmp_path / "plays.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert served.returncode == 0, served.stderr[-3000:]
    with_counts, once = json.loads(served.stdout)
    assert len(with_counts) == len(plays) > 20
    for user, items in with_counts.items():
        assert items == top.filter(pa.compute.equal(top["customer"], int(user)))["product"].to_pylist(), user
    assert any(once[user] != with_counts[user] for user in plays)
