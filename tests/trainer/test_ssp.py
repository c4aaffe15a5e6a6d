"""SSP trainer: Proposition 1 (gradient), ALS reproduction, sparse gradients, stats checks, SSP1."""

import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from pipelines.releases.stats_core import stats_table
from privacy.accumulator import augment, grouped_sums, pack_upper, unpack_upper
from schemas import storage
from schemas.tables import items_schema
from trainer import ssp
from trainer.encoder import ItemEncoder, export
from trainer.features import FeatureSpace

ITEMS = pa.table(
    {
        "item_id": [10, 20, 30, 40, 50],
        "title": ["a", "b", "c", "d", "e"],
        "genres": [["x", "y"], ["y"], ["x", "x", "z"], [], ["z"]],
        "year": [1990, 1990, None, 2000, 2010],
    },
    schema=items_schema({"genres": "multivalent", "year": "univalent"}),
)


def random_examples(rng, n, d, m):
    return rng.integers(0, m, n), rng.normal(size=(n, d)), rng.normal(size=n)


def test_ssp_gradient_equals_gradient_of_exact_squared_loss():
    """Proposition 1, for the features encoder (embeddings -> hidden concat -> dense)."""
    tf.keras.utils.set_random_seed(0)
    space = FeatureSpace.from_items(ITEMS)
    encoder = ItemEncoder(space, dim=3, kind="features", family_dim=4)
    rng = np.random.default_rng(0)
    positions, u, y = random_examples(rng, 40, 3, space.size)
    keys, a_upper, b = grouped_sums(positions, augment(u, y))
    with tf.GradientTape(persistent=True) as tape:
        v_rows = tf.cast(encoder(tf.constant(positions)), tf.float64)
        exact = 0.5 * tf.reduce_sum((tf.reduce_sum(v_rows * u, axis=1) - y) ** 2)
        mean = ssp.ssp_loss(
            encoder,
            tf.constant(keys),
            ssp.dense_product(tf.constant(unpack_upper(a_upper, 3), tf.float32)),
            tf.constant(b, tf.float32),
        )
        summed = mean * keys.size
    for g_exact, g_ssp, var in zip(
        tape.gradient(exact, encoder.trainable_variables),
        tape.gradient(summed, encoder.trainable_variables),
        encoder.trainable_variables,
        strict=True,
    ):
        g_exact, g_ssp = tf.convert_to_tensor(g_exact).numpy(), tf.convert_to_tensor(g_ssp).numpy()
        assert np.abs(g_exact).max() > 0, var.name
        np.testing.assert_allclose(g_ssp, g_exact, rtol=2e-4, atol=2e-5, err_msg=var.name)


def test_embedding_gradients_are_sparse():
    space = FeatureSpace.from_items(ITEMS)
    encoder = ItemEncoder(space, dim=2)
    with tf.GradientTape() as tape:
        loss = ssp.ssp_loss(
            encoder, tf.constant([0, 1]), ssp.dense_product(tf.eye(2, batch_shape=[2])), tf.ones((2, 2))
        )
    grads = dict(
        zip(
            [v.name for v in encoder.trainable_variables], tape.gradient(loss, encoder.trainable_variables), strict=True
        )
    )
    tables = [name for name in grads if "embeddings" in name]
    assert tables and all(isinstance(grads[name], tf.IndexedSlices) for name in tables)
    year = next(grads[name] for name in tables if name.startswith("year"))
    assert sorted(set(year.indices.numpy().tolist())) == [1]  # both items have year 1990: one row touched


def write_stats(path, item_ids, a_upper, b, d, **meta):
    metadata = {
        "d": d,
        "noise_multiplier": 0.0,
        "clip_u": 1.0,
        "clip_y": 1.0,
        "wbar": 1.0,
        "release": 0,
        "resample": 0,
        **meta,
    }
    storage.write_table(stats_table(np.asarray(item_ids), a_upper, b, metadata), path)


def test_id_encoder_reproduces_closed_form_als_item_solve(tmp_path):
    tf.keras.utils.set_random_seed(1)
    space = FeatureSpace.from_items(ITEMS)
    d, ridge = 3, 0.5
    rng = np.random.default_rng(1)
    positions, u, y = random_examples(rng, 60, d, space.size)
    keys, a_upper, b = grouped_sums(positions, augment(u, y))
    write_stats(str(tmp_path / "s.parquet"), space.item_ids[keys], a_upper, b, d)
    encoder = ItemEncoder(space, dim=d, kind="id")
    config = ssp.SSPConfig(epochs=1500, batch_size=8, learning_rate=0.02, ridge=ridge, psd_projection=False)
    losses = ssp.train(encoder, [str(tmp_path / "s.parquet")], config, progress=False)
    assert losses[-1] < losses[0]
    als = np.linalg.solve(unpack_upper(a_upper, d) + ridge * np.eye(d), b[..., None])[..., 0]
    np.testing.assert_allclose(encoder.embed_all()[keys], als, rtol=1e-3, atol=1e-3)


def test_psd_projection():
    rng = np.random.default_rng(2)
    m = rng.normal(size=(6, 4, 4))
    sym = (m + np.swapaxes(m, 1, 2)) / 2
    projected = unpack_upper(ssp.project_psd(pack_upper(sym), 4), 4)
    assert np.linalg.eigvalsh(projected).min() > -1e-10
    psd = m @ np.swapaxes(m, 1, 2)
    np.testing.assert_allclose(unpack_upper(ssp.project_psd(pack_upper(psd), 4), 4), psd, atol=1e-10)  # PSD stays


def test_a_projected_table_is_each_rows_projection_in_order(tmp_path):
    """project_table works on several batches at once: 23 items in batches of 4 come out in their
    order, each A_j exactly project_psd's, b_j and the release's metadata untouched."""
    rng = np.random.default_rng(5)
    m = rng.normal(size=(23, 3, 3))
    a_upper, b = pack_upper((m + np.swapaxes(m, 1, 2)) / 2), rng.normal(size=(23, 3))
    write_stats(str(tmp_path / "s.parquet"), np.arange(100, 123), a_upper, b, 3)
    ssp.project_table(str(tmp_path / "s.parquet"), str(tmp_path / "p.parquet"), batch_size=4)
    projected = storage.read_table(str(tmp_path / "p.parquet"))
    assert projected["item_id"].to_pylist() == list(range(100, 123))
    np.testing.assert_array_equal(np.array(projected["a_upper"].to_pylist()), ssp.project_psd(a_upper, 3))
    np.testing.assert_array_equal(np.array(projected["b"].to_pylist()), b)
    assert projected.schema.metadata == storage.read_schema(str(tmp_path / "s.parquet")).metadata


def test_stats_that_do_not_match_are_refused(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, np.zeros((5, 6)), np.zeros((5, 3)), 3, clip_u=2.0)
    encoder = ItemEncoder(space, dim=4)
    with pytest.raises(ValueError, match=r"released with d=3, but this run expects d=4"):
        ssp.train(encoder, [str(tmp_path / "s.parquet")], ssp.SSPConfig(epochs=1), progress=False)
    with pytest.raises(ValueError, match=r"released with clip_u=2, but this run expects clip_u=1"):
        ssp.train(
            ItemEncoder(space, dim=3),
            [str(tmp_path / "s.parquet")],
            ssp.SSPConfig(epochs=1),
            expected={"clip_u": 1.0},
            progress=False,
        )
    storage.write_table(pa.table({"item_id": [1], "x": [1.0]}), str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match="is not a stats table"):
        ssp.train(encoder, [str(tmp_path / "bad.parquet")], ssp.SSPConfig(epochs=1), progress=False)
    write_stats(str(tmp_path / "alien.parquet"), [999], np.zeros((1, 6)), np.zeros((1, 3)), 3)
    with pytest.raises(ValueError, match="item 999 is not in the catalog"):
        ssp.train(ItemEncoder(space, dim=3), [str(tmp_path / "alien.parquet")], ssp.SSPConfig(epochs=1), progress=False)


def test_ssp1_phases_use_each_resample(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    d = 2
    targets = [np.full((5, d), 1.0), np.full((5, d), -1.0)]
    for k, target in enumerate(targets):  # A = I, b = target: the minimiser of each table is v = target / (1 + ridge)
        write_stats(
            str(tmp_path / f"r{k}.parquet"),
            space.item_ids,
            np.tile(pack_upper(np.eye(d)), (5, 1)),
            target,
            d,
            resample=k,
        )
    encoder = ItemEncoder(space, dim=d, kind="id")
    ssp.train(
        encoder,
        [str(tmp_path / "r0.parquet"), str(tmp_path / "r1.parquet")],
        ssp.SSPConfig(epochs=400, batch_size=5, learning_rate=0.05, ridge=0.0, cosine_decay=False),
        progress=False,
    )
    np.testing.assert_allclose(encoder.embed_all(), -1.0, atol=0.05)  # the last phase's table wins


def test_export_and_item_embeddings(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    encoder = ItemEncoder(space, dim=3)
    table = ssp.item_embeddings_table(encoder)
    assert table["item_id"].to_pylist() == [10, 20, 30, 40, 50]
    export(encoder, str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    out = loaded.signatures["embed"](item_ids=tf.constant([30, 10], tf.int64))["embedding"].numpy()
    np.testing.assert_allclose(out, np.array(table["embedding"].to_pylist())[[2, 0]], rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"not in the catalog of this encoder[\s\S]*\[777 999\]"):
        loaded.signatures["embed"](item_ids=tf.constant([30, 777, 10, 999], tf.int64))  # the unknown ids are named


def test_the_features_signature_embeds_any_item_from_its_public_features(tmp_path):
    """Catalog items through `embed_features` equal the shared encoder (no residual); a value the
    catalog never had is the family's out-of-vocabulary row (id 0); "" pads and counts for nothing."""
    tf.keras.utils.set_random_seed(3)
    space = FeatureSpace.from_items(ITEMS)  # with the item id: the residual exists
    encoder = ItemEncoder(space, dim=3)
    encoder(tf.range(5))
    encoder.residual(tf.range(5))
    encoder._residual.assign(
        tf.random.normal(encoder._residual.shape)
    )  # trained residuals must not leak into new items
    export(encoder, str(tmp_path / "model"))
    embed = tf.saved_model.load(str(tmp_path / "model")).signatures["embed_features"]
    genres = tf.constant([["x", "y", ""], ["y", "", ""], ["x", "x", "z"], ["", "", ""], ["z", "", ""]])
    years = tf.constant([["1990"], ["1990"], [""], ["2000"], ["2010"]])
    out = embed(genres=genres, year=years)["embedding"].numpy()
    np.testing.assert_allclose(out, encoder.embed_all(shared=True), rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, encoder.embed_all(), atol=1e-3)  # the id signature keeps the residuals
    # a new item: one known genre, one never seen, and an unseen year
    new = embed(genres=tf.constant([["y", "w"]]), year=tf.constant([["1999"]]))["embedding"].numpy()
    ragged = [
        tf.ragged.constant([[2, 0]], dtype=tf.int64),
        tf.ragged.constant([[0]], dtype=tf.int64),
    ]  # y is genre id 2; 0: out of vocabulary
    np.testing.assert_allclose(new, encoder.encode_values(ragged).numpy(), rtol=1e-5, atol=1e-6)
    tables = {name: table.numpy() for name, _, table in encoder._families}
    hidden = np.r_[(tables["genres"][2] + tables["genres"][0]) / 2, tables["year"][0]]
    np.testing.assert_allclose(
        new[0], hidden @ encoder._dense.kernel.numpy() + encoder._dense.bias.numpy(), rtol=1e-5, atol=1e-6
    )


def test_als_item_solve_is_the_closed_form_and_matches_ssp(tmp_path):
    from trainer import als

    space = FeatureSpace.from_items(ITEMS)
    d, ridge = 3, 0.5
    rng = np.random.default_rng(4)
    positions, u, y = random_examples(rng, 60, d, space.size)
    keys, a_upper, b = grouped_sums(positions, augment(u, y))
    write_stats(str(tmp_path / "s.parquet"), space.item_ids[keys], a_upper, b, d)
    scale = np.arange(1.0, space.size + 1)
    solved = als.solve_items(str(tmp_path / "s.parquet"), space, d, ridge, ridge_scale=scale, psd_projection=True)
    want = np.linalg.solve(unpack_upper(a_upper, d) + (ridge * scale[keys])[:, None, None] * np.eye(d), b[..., None])[
        ..., 0
    ]
    np.testing.assert_allclose(solved[keys], want, rtol=1e-9)
    assert np.all(solved[np.setdiff1d(np.arange(space.size), keys)] == 0)
    encoder = ItemEncoder(space, dim=d, kind="id")
    encoder.set_item_vectors(solved)
    np.testing.assert_allclose(encoder.embed_all(), solved, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="ridge must be > 0"):
        als.solve_items(str(tmp_path / "s.parquet"), space, d, 0.0)


def test_residual_moves_only_items_whose_statistics_call_for_it(tmp_path):
    """The features encoder's per-item residual under its penalty: an item with no statistics stays
    exactly what its public features say; an item with strong statistics reaches its own solution."""
    tf.keras.utils.set_random_seed(1)
    space = FeatureSpace.from_items(ITEMS)  # with the item id: the residual
    d = 2
    encoder = ItemEncoder(space, dim=d, kind="features", family_dim=3)
    assert encoder.has_residual
    start = encoder.embed_all()
    target = np.array([3.0, -2.0])
    a = np.zeros((5, 3))
    b = np.zeros((5, d))
    a[0], b[0] = pack_upper(50.0 * np.eye(d)), 50.0 * target  # item 10: A = 50 I, b = 50 target -> v = target
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, a, b, d)
    penalty = np.full(space.size, 1.0)
    # only the residuals train here: the shared features part is fixed, so the other items' embeddings are theirs
    shared = [w for w in encoder.trainable_variables if "residual" not in w.name]
    for w in shared:
        w._trainable = False
    ssp.train(
        encoder,
        [str(tmp_path / "s.parquet")],
        ssp.SSPConfig(epochs=1500, batch_size=5, learning_rate=0.1, ridge=0.0, psd_projection=False),
        progress=False,
        residual_penalty=penalty,
    )
    after = encoder.embed_all()
    residual = encoder.residual(tf.range(space.size)).numpy()
    np.testing.assert_allclose(residual[1:], 0.0)  # no statistics: exactly the features
    np.testing.assert_allclose(after[1:], start[1:], rtol=1e-6)
    # item 10 minimises 1/2 v^T 50 v - 50 target^T v + 1/2 ||v - f||^2: v = (50 target + f) / 51
    np.testing.assert_allclose(after[0], (50 * target + start[0]) / 51, atol=2e-2)


def test_rescale_multiplies_every_embedding():
    space = FeatureSpace.from_items(ITEMS)
    encoder = ItemEncoder(space, dim=3, kind="features")
    encoder.residual(tf.range(2))
    encoder._residual.assign(tf.random.normal(encoder._residual.shape))
    before = encoder.embed_all()
    encoder.rescale(0.25)
    np.testing.assert_allclose(encoder.embed_all(), 0.25 * before, rtol=1e-5, atol=1e-6)


def test_anchor_holds_the_shared_encoder_at_its_start(tmp_path):
    """Statistics that are all noise: with a strong anchor the shared encoder ends where it began;
    without one it follows the noise."""
    space = FeatureSpace.from_items(ITEMS, use_item_id=False)
    d = 2
    rng = np.random.default_rng(3)
    noise_a = rng.normal(size=(5, d, d))
    a = np.stack([pack_upper(m @ m.T + np.eye(d)) for m in noise_a])
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, a, rng.normal(size=(5, d)) * 5, d)
    moved = {}
    for anchor in (0.0, 1e4):
        tf.keras.utils.set_random_seed(2)
        encoder = ItemEncoder(space, dim=d, kind="features", family_dim=3)
        start = encoder.embed_all()
        ssp.train(
            encoder,
            [str(tmp_path / "s.parquet")],
            ssp.SSPConfig(epochs=200, batch_size=5, learning_rate=0.05, ridge=0.0, psd_projection=False),
            progress=False,
            anchor=anchor,
        )
        moved[anchor] = float(np.abs(encoder.embed_all() - start).max())
    assert moved[1e4] < 0.01 < moved[0.0]


@pytest.mark.parametrize("held", [False, True])
def test_solved_residuals_minimise_the_loss_with_a_penalty_per_coordinate(tmp_path, held):
    """solve_residuals sets each item's residual to its exact minimiser, the shared encoder fixed,
    under a penalty of one number per (item, coordinate), about zero or about held residuals r0
    (the item Gram's start): the loss's gradient in the residuals is zero there, and the loss is
    below where the residuals started."""
    tf.keras.utils.set_random_seed(4)
    space = FeatureSpace.from_items(ITEMS)
    d = 3
    rng = np.random.default_rng(4)
    spread = rng.normal(size=(5, d, d))
    a = np.stack([pack_upper(m @ m.T) for m in spread])
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, a, rng.normal(size=(5, d)), d)
    encoder = ItemEncoder(space, dim=d, kind="features", family_dim=3)
    encoder.set_residuals(np.arange(5), rng.normal(size=(5, d)))
    penalty = rng.uniform(0.1, 2.0, size=(5, d))
    ridge = np.tile([1.0, 1.0, 0.01], (5, 1))  # a diagonal ridge: the last coordinate's own
    config = ssp.SSPConfig(ridge=0.5, psd_projection=False)
    positions = tf.range(5)
    full_a = tf.constant(unpack_upper(a, d) + 0.5 * ssp.diagonals(ridge, d), tf.float32)
    b = tf.constant(
        np.stack(storage.read_table(str(tmp_path / "s.parquet"))["b"].to_numpy(zero_copy_only=False)), tf.float32
    )

    centre = rng.normal(size=(5, d)) if held else None

    def loss():
        return ssp.ssp_loss(
            encoder,
            positions,
            ssp.dense_product(full_a),
            b,
            residual_penalty=tf.constant(penalty, tf.float32),
            residual_start=tf.constant(centre, tf.float32) if held else None,
        )

    before = float(loss())
    ssp.solve_residuals(encoder, [str(tmp_path / "s.parquet")], config, penalty, ridge, held=centre)
    with tf.GradientTape() as tape:
        value = loss()
    gradient = tf.convert_to_tensor(tape.gradient(value, encoder._residual)).numpy()
    assert float(value) < before
    np.testing.assert_allclose(gradient, 0.0, atol=1e-5)


def test_diagonals_are_scaled_identities_or_per_coordinate():
    np.testing.assert_array_equal(ssp.diagonals(np.array([2.0, 3.0]), 2), [[[2, 0], [0, 2]], [[3, 0], [0, 3]]])
    np.testing.assert_array_equal(ssp.diagonals(np.array([[1.0, 4.0]]), 2), [[[1, 0], [0, 4]]])


def test_the_trainers_products_are_the_item_batches_matrices_times_the_vectors(tmp_path):
    """The training loop applies A_j + ridge diag(s_j) + gravity to the items' vectors in TensorFlow
    from the packed rows (`packed_product`); `item_batches` (the residual solve's) builds the
    matrices in numpy: the same products, for a ridge of one number per item and of one per
    coordinate, and a gravity that need not be symmetric."""
    space = FeatureSpace.from_items(ITEMS)
    d = 3
    rng = np.random.default_rng(7)
    a = np.stack([pack_upper(m @ m.T) for m in rng.normal(size=(5, d, d))])
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, a, rng.normal(size=(5, d)), d)
    encoder = ItemEncoder(space, dim=d, kind="features", family_dim=3)
    gravity = rng.normal(size=(d, d))
    config = ssp.SSPConfig(ridge=0.5, batch_size=2)
    for scale in (rng.uniform(1, 3, size=5), rng.uniform(1, 3, size=(5, d))):
        ((_, (positions, packed, _, scales)),) = ssp.shuffled_chunks(
            str(tmp_path / "s.parquet"), encoder, config, np.random.default_rng(0), ridge_scale=scale
        )  # the buffer in the table's order, as `item_batches` reads it
        expected = np.concatenate(
            [batch[1] for batch in ssp.item_batches(str(tmp_path / "s.parquet"), encoder, config, scale, gravity)]
        )
        v = rng.normal(size=(5, d))
        product = ssp.packed_product(
            tf.constant(packed, tf.float32), tf.constant(scales, tf.float32), 0.5, tf.constant(gravity, tf.float32)
        )
        np.testing.assert_allclose(
            product(tf.constant(v, tf.float32)).numpy(), np.einsum("bij,bj->bi", expected, v), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            expected[0],
            unpack_upper(a[positions[0]], d) + 0.5 * np.diag(np.broadcast_to(scale[positions[0]], (d,))) + gravity,
        )


def _item_chunks(path, encoder, config, rng, *, ridge_scale=None, cache=None, dtype=np.float64):
    """`shuffled_chunks`' buffers with their rows in their shuffled order, a chunk per buffer."""
    for order, (positions, a, b, scale) in ssp.shuffled_chunks(
        path, encoder, config, rng, ridge_scale=ridge_scale, cache=cache, dtype=dtype
    ):
        yield positions[order], a[order], b[order], scale[order]


def five_item_stats(tmp_path, seed: int):
    """A stats table of the five test items at d = 3 (random PSD A_j), a features encoder, batches
    of 2, and the random stream that made them."""
    space = FeatureSpace.from_items(ITEMS)
    d = 3
    rng = np.random.default_rng(seed)
    a = np.stack([pack_upper(m @ m.T) for m in rng.normal(size=(5, d, d))])
    path = str(tmp_path / "s.parquet")
    write_stats(path, space.item_ids, a, rng.normal(size=(5, d)), d)
    return path, ItemEncoder(space, dim=d, kind="features", family_dim=3), ssp.SSPConfig(batch_size=2), rng


def test_float32_chunks_are_the_float64_ones_converted_and_a_cached_table_is_read_once(tmp_path, monkeypatch):
    """The trainer's chunks (float32, converted once at decoding) hold the float64 chunks' rows in the
    same shuffled order, converted; with a cache, later epochs reuse the decoded rows (no read) and
    give the shuffles an uncached run gives."""
    path, encoder, config, rng = five_item_stats(tmp_path, 3)
    scale = rng.uniform(1, 3, size=5)
    reads = []
    real = ssp._decoded_buffers
    monkeypatch.setattr(ssp, "_decoded_buffers", lambda *args: reads.append(1) or real(*args))
    wide, narrow, cache = np.random.default_rng(5), np.random.default_rng(5), {}
    for _epoch in range(3):
        expected = list(_item_chunks(path, encoder, config, wide, ridge_scale=scale))
        got = list(_item_chunks(path, encoder, config, narrow, ridge_scale=scale, cache=cache, dtype=np.float32))
        assert len(got) == len(expected) == 1
        for g, e in zip(got[0], expected[0], strict=True):
            assert g.dtype == (np.int64 if e.dtype == np.int64 else np.float32)
            np.testing.assert_array_equal(g, e.astype(g.dtype))
    assert len(reads) == 3 + 1  # every epoch for the uncached chunks, once for the cached ones


def test_a_cached_chunk_is_converted_once_and_its_shuffle_gathers_the_item_chunks_rows(tmp_path):
    """The trainer's feed (`shuffled_chunks` with a conversion to tensors): a cached table's buffers are
    converted once and reused by every epoch; gathering each buffer's rows by the epoch's order gives
    `_item_chunks`' shuffled chunks exactly, for the same random stream."""
    path, encoder, config, rng = five_item_stats(tmp_path, 11)
    scale = rng.uniform(1, 3, size=(5, encoder.dim))
    conversions = []

    def convert(buffer):
        conversions.append(1)
        return tuple(tf.constant(x) for x in buffer)

    fed, expected, cache = np.random.default_rng(2), np.random.default_rng(2), {}
    first = None
    for _epoch in range(3):
        ((order, buffer),) = ssp.shuffled_chunks(
            path, encoder, config, fed, ridge_scale=scale, cache=cache, dtype=np.float32, convert=convert
        )
        first = first or buffer
        assert all(x is y for x, y in zip(buffer, first, strict=True))  # the same tensors every epoch
        (chunk,) = _item_chunks(path, encoder, config, expected, ridge_scale=scale, cache=None, dtype=np.float32)
        for tensor, rows in zip(buffer, chunk, strict=True):
            np.testing.assert_array_equal(tf.gather(tensor, order).numpy(), rows)
    assert len(conversions) == 1


def test_the_default_batch_is_an_eighth_of_the_catalog_within_its_bounds():
    """At least 512 items, an epoch of about 8 steps, and a shuffle buffer of 8 batches of packed
    float64 A_j within 256 MiB (d = 64: 2,080 entries, 2,016 items)."""
    assert ssp.auto_batch_size(3_500, 17, 8) == 512
    assert ssp.auto_batch_size(61_542, 19, 8) == 7_693
    assert ssp.auto_batch_size(500_000, 64, 8) == (256 << 20) // (8 * 2_080 * 8) == 2_016
    assert ssp.auto_batch_size(500_000, 128, 8) == 512  # the buffer's bound never goes below the smallest batch


def test_training_with_solve_residuals_ends_at_each_items_exact_residual(tmp_path):
    """One epoch, then the solve: item 10 (A = 50 I, b = 50 target, penalty 1) ends exactly at
    (50 target + f) / 51 for the shared output f as trained; items without statistics keep r = 0."""
    tf.keras.utils.set_random_seed(1)
    space = FeatureSpace.from_items(ITEMS)
    d = 2
    encoder = ItemEncoder(space, dim=d, kind="features", family_dim=3)
    target = np.array([3.0, -2.0])
    a, b = np.zeros((5, 3)), np.zeros((5, d))
    a[0], b[0] = pack_upper(50.0 * np.eye(d)), 50.0 * target
    write_stats(str(tmp_path / "s.parquet"), space.item_ids, a, b, d)
    ssp.train(
        encoder,
        [str(tmp_path / "s.parquet")],
        ssp.SSPConfig(epochs=1, batch_size=5, ridge=0.0, psd_projection=False, solve_residuals=True),
        progress=False,
        residual_penalty=np.ones(space.size),
    )
    shared = encoder.embed_all(shared=True)
    np.testing.assert_allclose(encoder.embed_all()[0], (50 * target + shared[0]) / 51, rtol=1e-5)
    np.testing.assert_allclose(encoder.residual(tf.range(1, space.size)).numpy(), 0.0, atol=1e-6)


def test_a_numeric_family_is_bucketed_by_the_catalogs_quantiles_in_training_and_in_the_signature(tmp_path):
    """Prices 1..20 (and one unknown): nine decile edges by numpy's quantile rule, each price's
    bucket 1 + #(edges <= price); the signature buckets a number given as text the same way,
    float64 exactly at an edge, and a new price beyond every edge lands in the top bucket."""
    prices = [float(p) for p in range(1, 21)] + [None]
    items = pa.table(
        {"item_id": list(range(100, 121)), "title": [None] * 21, "price": prices},
        schema=items_schema({"price": "numeric"}),
    )
    space = FeatureSpace.from_items(items, use_item_id=False)
    (family,) = space.families
    edges = np.quantile(np.arange(1.0, 21.0), np.arange(1, 10) / 10)  # 2.9, 4.8, ..., 18.1
    np.testing.assert_allclose(family.boundaries, edges)
    assert family.size == 11 and family.vocabulary[0] == "[-inf, 2.9)" and family.vocabulary[-1] == "[18.1, inf)"
    np.testing.assert_array_equal(family.values, 1 + np.searchsorted(edges, np.arange(1.0, 21.0), side="right"))
    np.testing.assert_array_equal(np.diff(family.row_splits), [1] * 20 + [0])  # the unknown price: no value
    tf.keras.utils.set_random_seed(5)
    encoder = ItemEncoder(space, dim=3)
    encoder(tf.range(space.size))
    export(encoder, str(tmp_path / "model"))
    embed = tf.saved_model.load(str(tmp_path / "model")).signatures["embed_features"]
    texts = [[repr(p)] if p is not None else [""] for p in prices]
    np.testing.assert_allclose(
        embed(price=tf.constant(texts))["embedding"].numpy(), encoder.embed_all(shared=True), rtol=1e-5, atol=1e-6
    )
    at_edge, beyond = embed(price=tf.constant([[repr(edges[3])], ["1000"]]))["embedding"].numpy()
    ids = [tf.ragged.constant([[5]], dtype=tf.int64), tf.ragged.constant([[10]], dtype=tf.int64)]
    np.testing.assert_allclose(
        at_edge, encoder.encode_values(ids[:1]).numpy()[0], rtol=1e-5, atol=1e-6
    )  # an edge opens its bucket
    np.testing.assert_allclose(beyond, encoder.encode_values(ids[1:]).numpy()[0], rtol=1e-5, atol=1e-6)
