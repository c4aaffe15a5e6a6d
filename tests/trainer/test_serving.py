"""trainer.serving: the serving SavedModel, loaded in a clean TensorFlow process (no project import),
gives the same top k as trainer.recommend for every model layout (ratings with biases, ranking with
the popularity column, gravity and item biases, no biases), the DP popularity ranking to a user
with no catalog item, and each item's nearest neighbours by cosine."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from trainer import serving
from trainer.recommend import PublishedModel

CLEAN_CLIENT = """
import json, sys
import numpy as np
import tensorflow as tf
answers = []
for model_path, request_path in zip(sys.argv[1::2], sys.argv[2::2]):
    request = json.load(open(request_path))
    model = tf.saved_model.load(model_path)
    inputs = {"item_ids": tf.constant(request["item_ids"], tf.int64), "k": tf.constant(request["k"], tf.int32)}
    if "labels" in request:
        inputs["labels"] = tf.constant(request["labels"], tf.float32)
    out = model.signatures["recommend"](**inputs)
    similar = model.signatures["similar_items"](
        item_ids=tf.constant(request["similar"], tf.int64), k=tf.constant(2, tf.int32)
    )
    answers.append(
        {
            "item_ids": out["item_ids"].numpy().tolist(),
            "scores": np.nan_to_num(out["scores"].numpy(), nan=-1e300).tolist(),
            "similar": similar["item_ids"].numpy().tolist(),
            "similar_scores": similar["scores"].numpy().tolist(),
        }
    )
assert not any(name.split(".")[0] in ("trainer", "pipelines", "privacy", "schemas") for name in sys.modules)
json.dump(answers, sys.stdout)
"""


def serve(paths: list, requests: list[dict]) -> list[dict]:
    """The serving models' answers (the model in each PATH/model, to its request), from one fresh
    Python that imports TensorFlow alone (its import is most of the process's seconds)."""
    args = []
    for path, request in zip(paths, requests, strict=True):
        (path / "request.json").write_text(json.dumps(request))
        args += [str(path / "model"), str(path / "request.json")]
    done = subprocess.run(
        [sys.executable, "-c", CLEAN_CLIENT, *args],
        capture_output=True,
        text=True,
        cwd=str(paths[0]),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


LAYOUTS = {
    "ratings with biases": dict(protocol="rmse", biases=True, lambda_bias=3.0, gravity=0.0, popularity=False),
    "ratings without biases": dict(protocol="rmse", biases=False, lambda_bias=None, gravity=0.0, popularity=False),
    "ranking, popularity, gravity, biases": dict(
        protocol="recall", biases=True, lambda_bias=None, gravity=0.05, popularity=True
    ),
    "ranking without biases": dict(protocol="recall", biases=False, lambda_bias=None, gravity=0.0, popularity=True),
}


def exported(tmp_path, layout: str) -> dict:
    """A published model of `layout` exported for serving, and a request of three users to it."""
    tmp_path.mkdir()
    spec = LAYOUTS[layout]
    rng = np.random.default_rng(len(layout))
    n, d = 40, 4
    item_ids = np.sort(rng.choice(np.arange(100, 10_000), n, replace=False))
    vectors = rng.normal(size=(n, d))
    if spec["biases"]:
        vectors = np.hstack([vectors, rng.normal(size=(n, 1)), np.ones((n, 1))])
    counts = rng.integers(1, 500, n).astype(float)  # every publication ships the counts release
    settings = {
        "protocol": spec["protocol"],
        "dim": vectors.shape[1],
        "biases": spec["biases"],
        "lambda_bias": spec["lambda_bias"],
        "loss": "square",
        "lambda_u": 0.3,
        "user_prior": 2.0,
        "gravity": spec["gravity"],
        "dp_mean": 3.5 if spec["protocol"] == "rmse" else None,
        "rating_range": [0.5, 5.0] if spec["protocol"] == "rmse" else None,  # as publish writes it
        "positive_threshold": None,
        "encoder": "features",
        "feature_families": {},
        "popularity_column": spec["popularity"],
    }
    if spec["popularity"]:
        from trainer.evaluate import with_popularity

        vectors = with_popularity(vectors, counts, spec["biases"])
    model = PublishedModel(str(tmp_path), item_ids, vectors, settings, counts)
    serving.export(item_ids, vectors, settings, counts, str(tmp_path / "model"))
    # three users: 5 items (one repeated, one outside the catalog), 2 items, and none in the catalog (a new user)
    histories = [
        list(rng.choice(item_ids, 4, replace=False)) + [7],
        list(rng.choice(item_ids, 2, replace=False)),
        [1, 2],
    ]
    histories[0].append(histories[0][0])
    width = max(map(len, histories))
    labels = [list(rng.choice([1.0, 2.5, 4.0, 5.0], len(h))) for h in histories]
    request = {
        "item_ids": [[int(i) for i in h] + [-1] * (width - len(h)) for h in histories],
        "k": 6,
        "similar": [int(item_ids[3]), int(item_ids[0])],
    }
    rows = {
        "user_id": [u for u, h in enumerate(histories) for _ in h],
        "item_id": [int(i) for h in histories for i in h],
    }
    if spec["protocol"] == "rmse":
        request["labels"] = [lab + [0.0] * (width - len(lab)) for lab in labels]
        rows["label"] = [x for lab in labels for x in lab]
    return dict(
        folder=tmp_path,
        model=model,
        request=request,
        rows=rows,
        item_ids=item_ids,
        vectors=vectors,
        counts=counts,
        d=d,
        n=len(histories),
    )


def test_the_serving_signature_gives_ssp_recommends_top_k_in_a_clean_tensorflow(tmp_path):
    """Every layout's model, served by one clean TensorFlow process (its import is most of its time)."""
    cases = {layout: exported(tmp_path / f"layout-{k}", layout) for k, layout in enumerate(LAYOUTS)}
    answers = serve([case["folder"] for case in cases.values()], [case["request"] for case in cases.values()])
    for (layout, case), served in zip(cases.items(), answers, strict=True):
        check_served(layout, case, served)


def check_served(layout: str, case: dict, served: dict) -> None:
    """The clean TensorFlow's answer `served` is trainer.recommend's for `layout`'s model and request."""
    model, request, item_ids, vectors, counts, d = (
        case[key] for key in ("model", "request", "item_ids", "vectors", "counts", "d")
    )
    expected = model.recommend(pa.table(case["rows"]), k=6, exclude_seen=True)
    for user in range(case["n"]):
        mine = expected.filter(pa.compute.equal(expected["user_id"], user))
        assert served["item_ids"][user] == mine["item_id"].to_pylist(), (layout, user)
        np.testing.assert_allclose(
            served["scores"][user], mine["score"].to_numpy(), rtol=1e-9, atol=1e-9, err_msg=layout
        )
    # the new user: the DP popularity ranking
    assert served["item_ids"][2] == item_ids[np.argsort(-counts, kind="stable")[:6]].tolist(), layout
    # similar items: by the cosine of the trained directions, the item itself left out
    unit = vectors[:, :d] / np.linalg.norm(vectors[:, :d], axis=1, keepdims=True)
    for row, item in enumerate(request["similar"]):
        at = int(np.searchsorted(item_ids, item))
        cosine = unit @ unit[at]
        cosine[at] = -np.inf
        assert served["similar"][row] == item_ids[np.argsort(-cosine, kind="stable")[:2]].tolist(), layout
        np.testing.assert_allclose(served["similar_scores"][row], np.sort(cosine)[::-1][:2], rtol=1e-9, err_msg=layout)


def test_fewer_items_than_k_come_back_as_minus_one_and_bad_labels_or_ids_are_refused(tmp_path):
    import tensorflow as tf

    item_ids, vectors = np.array([10, 20, 30]), np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    settings = {
        "protocol": "rmse",
        "dim": 2,
        "biases": False,
        "lambda_bias": None,
        "loss": "square",
        "lambda_u": 1.0,
        "user_prior": 0.0,
        "gravity": 0.0,
        "dp_mean": 3.0,
        "rating_range": [0.5, 5.0],
        "popularity_column": False,
    }
    serving.export(item_ids, vectors, settings, None, str(tmp_path / "model"))
    model = tf.saved_model.load(str(tmp_path / "model"))
    out = model.signatures["recommend"](
        item_ids=tf.constant([[10, 20]], tf.int64), labels=tf.constant([[4.0, 3.0]]), k=tf.constant(3)
    )
    # by hand: u = (v10 v10^T + v20 v20^T + 2 I)^-1 (v10 * 1 + v20 * 0) = (1/3, 0); item 30 scores 3 + 1/3
    assert out["item_ids"].numpy().tolist() == [[30, -1, -1]]
    np.testing.assert_allclose(out["scores"].numpy()[0, 0], 3 + 1 / 3)
    assert np.isnan(out["scores"].numpy()[0, 1:]).all()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"outside the rating scale 0.5..5 of this model[\s\S]*40"):
        model.signatures["recommend"](
            item_ids=tf.constant([[10]], tf.int64), labels=tf.constant([[40.0]]), k=tf.constant(2)
        )
    # an id outside the catalog gets its own row of -1, the others their answer
    similar = model.signatures["similar_items"](item_ids=tf.constant([10, 777], tf.int64), k=tf.constant(1))
    assert similar["item_ids"].numpy().tolist() == [[30], [-1]]
    np.testing.assert_allclose(similar["scores"].numpy()[0], [1 / np.sqrt(2)])
    assert np.isnan(similar["scores"].numpy()[1]).all()
