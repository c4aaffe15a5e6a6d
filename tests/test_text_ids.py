"""A shop's log with text ids, as a new user has it: `ssp ingest` maps them (items in the public
catalog's key order, each user by a hash of its own id), `ssp train` and `ssp publish` run as on
integers, `ssp recommend` answers in the user's own ids and column names, and the publication's
serving SavedModel takes and returns the same text ids from plain TensorFlow. Removing one user from
the raw log leaves every other user's ingested rows as they were."""

import json
import os
import random
import re
import subprocess
import sys

import pyarrow.csv as pacsv
import pytest

from pipelines.data import generic
from schemas import storage
from ssp import cli

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
SERVING_CLIENT = """
import json, sys
import tensorflow as tf
histories = json.load(open(sys.argv[2]))
serve = tf.saved_model.load(sys.argv[1]).signatures["recommend"]
width = max(len(items) for items in histories.values())
padded = [items + [""] * (width - len(items)) for items in histories.values()]
out = serve(item_ids=tf.constant(padded, tf.string), k=tf.constant(5))
assert not any(name.split(".")[0] in ("trainer", "pipelines", "privacy", "schemas", "ssp") for name in sys.modules)
json.dump({user: [item.decode() for item in row] for user, row in zip(histories, out["item_ids"].numpy())}, sys.stdout)
"""


def shop(folder, skip_user=None):
    """A catalog of 80 SKUs (text, some all digits with leading zeros) and a click log of 240
    customers, text ids and integers mixed; `skip_user`: that customer's rows left out."""
    rng = random.Random(0)
    skus = [f"SKU-{i:03X}" if i % 4 else f"{i:05d}" for i in range(80)]
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["sku,name,brand"] + [f"{sku},Product {sku},b{i % 6}" for i, sku in enumerate(skus)]
    (folder / "catalog.csv").write_text("\n".join(lines) + "\n")
    clicks = ["customer,sku"]
    for u in range(240):
        customer = f"cust-{u:04d}" if u % 3 else str(5000 + u)
        weights = [1.0 / (1 + (i + u % 5) % 80) for i in range(80)]
        chosen = sorted(set(rng.choices(skus, weights, k=14)))  # drawn for every customer: the others' stay put
        if customer != skip_user:
            clicks += [f"{customer},{sku}" for sku in chosen]
    (folder / "clicks.csv").write_text("\n".join(clicks) + "\n")
    return skus


def ingest(folder):
    command = [SSP, "ingest", "--interactions", str(folder / "clicks.csv"), "--catalog", str(folder / "catalog.csv")]
    command += ["--user-col", "customer", "--item-col", "sku", "--title-col", "name", "--features", "brand:value"]
    done = subprocess.run([*command, "--out", str(folder / "data"), "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "data"


def test_text_ids_train_publish_recommend_and_serve_in_the_users_own_ids(tmp_path):
    skus = shop(tmp_path)
    data = ingest(tmp_path)
    keys = storage.read_table(str(data / "item_keys.parquet"))
    assert keys["item_key"].to_pylist() == sorted(skus) and keys["item_id"].to_pylist() == list(range(1, 81))
    run, published = tmp_path / "run", tmp_path / "published"
    argv = ["train", "--data", str(data), "--out", str(run), "--protocol", "recall", "--epsilon", "8"]
    assert cli.main([*argv, "--engine", "local", "-q"]) == 0
    page = (run / "report.html").read_text()
    shown = re.findall(r"<small>\(([^)]*)\)</small>", page)  # the examples' items
    assert len(shown) >= 10 and set(shown) <= set(skus)  # named by the catalog's own ids
    users = re.findall(r"<h3>User ([^<]*)</h3>", page)  # and the users by theirs (the data set's private map)
    assert len(users) == 3 and all(re.fullmatch(r"cust-\d{4}|5\d{3}", user) for user in users), users
    named = storage.read_table(str(data / "user_keys.parquet"))
    assert sorted(named["user_key"].to_pylist()) == sorted(f"cust-{u:04d}" for u in range(240) if u % 3)
    assert named["user_id"].to_pylist() == [generic.user_key_id(key) for key in named["user_key"].to_pylist()]
    assert cli.main(["publish", "--run", str(run), "--to", str(published)]) == 0
    assert (published / "item_keys.parquet").exists()
    (tmp_path / "history.csv").write_text(
        "customer,sku\ncust-0001,SKU-001\ncust-0001,00004\n5003,SKU-002\n5003,00008\n5003,SKU-005\nnewbie,NOPE\n"
    )
    done = subprocess.run(
        [SSP, "recommend", "-v", "--model", str(published), "--history", str(tmp_path / "history.csv")]
        + ["--user-col", "customer", "--item-col", "sku", "--k", "5", "--out", str(tmp_path / "top.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "items outside the catalog: NOPE" in done.stderr  # named as the history wrote it
    top = pacsv.read_csv(
        tmp_path / "top.csv",
        convert_options=pacsv.ConvertOptions(column_types={"customer": "string", "sku": "string"}),
    )
    assert top.column_names == ["customer", "rank", "sku", "score", "title"]
    by_user = {}
    for row in top.to_pylist():
        by_user.setdefault(row["customer"], []).append(row["sku"])
        assert row["title"] == f"Product {row['sku']}"
    assert sorted(by_user) == ["5003", "cust-0001", "newbie"] and all(len(v) == 5 for v in by_user.values())
    assert set().union(*by_user.values()) <= set(skus)
    assert not {"SKU-001", "00004"} & set(by_user["cust-0001"]) and not {"SKU-002", "00008"} & set(by_user["5003"])
    (tmp_path / "new.csv").write_text("sku,brand\nSKU-001,b1\n")  # a new item that is a catalog key already
    again = subprocess.run(
        [SSP, "recommend", "--model", str(published), "--history", str(tmp_path / "history.csv")]
        + ["--user-col", "customer", "--item-col", "sku", "--new-items", str(tmp_path / "new.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and again.stdout == "" and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1].endswith("new item 'SKU-001' is already in the model's catalog")
    histories = {"cust-0001": ["SKU-001", "00004"], "5003": ["SKU-002", "00008", "SKU-005"]}
    (tmp_path / "histories.json").write_text(json.dumps(histories))
    served = subprocess.run(
        [sys.executable, "-c", SERVING_CLIENT, str(published / "recommender"), str(tmp_path / "histories.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout) == {user: by_user[user] for user in histories}


@pytest.mark.parametrize("removed", ["cust-0002", "5006"])
def test_removing_one_customer_leaves_every_other_customers_ingested_rows(tmp_path, removed):
    """User ids are mapped user by user (a hash of the id alone, or the integer itself): the
    neighbouring log's ingest differs by the removed customer's rows only."""
    shop(tmp_path / "full")
    shop(tmp_path / "neighbour", skip_user=removed)
    rows = []
    for folder in ("full", "neighbour"):
        table = storage.read_table(str(ingest(tmp_path / folder) / "interactions.parquet"))
        rows.append(sorted(zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True)))
    gone = int(removed) if removed.isdigit() else generic.user_key_id(removed)
    assert [row for row in rows[0] if row[0] != gone] == rows[1]
    assert len(rows[0]) > len(rows[1])


def test_a_text_catalog_with_a_repeated_key_is_one_line_from_the_installed_ingest(tmp_path):
    shop(tmp_path)
    catalog = tmp_path / "catalog.csv"
    catalog.write_text(catalog.read_text() + "SKU-001,Again,b1\n")
    done = subprocess.run(
        [SSP, "ingest", "--interactions", str(tmp_path / "clicks.csv"), "--catalog", str(catalog)]
        + ["--user-col", "customer", "--item-col", "sku", "--title-col", "name", "--features", "brand:value"]
        + ["--out", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("column 'sku' holds 'SKU-001' more than once; item ids must be unique")
    )
    assert not (tmp_path / "data").exists()  # nothing written
