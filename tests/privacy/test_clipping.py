"""privacy.clipping: Clip(x, G) = x * min(1, G / ||x||) row by row, labels to [-G, G]."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from privacy.clipping import biased_row_clip, check_bound, clip_labels, clip_rows, clip_rows_into


def test_vector_outside_is_scaled_onto_the_sphere():
    out = clip_rows(np.array([[3.0, 4.0]]), 1.0)  # norm 5 -> scaled by 1/5
    np.testing.assert_allclose(out, [[0.6, 0.8]], rtol=0, atol=1e-15)
    assert np.linalg.norm(out) == pytest.approx(1.0, abs=1e-15)


def test_vector_inside_is_unchanged_exactly():
    x = np.array([[0.3, -0.4], [1.0, 0.0]])  # norms 0.5 and 1.0 (on the bound) with G = 1
    out = clip_rows(x, 1.0)
    assert np.array_equal(out, x)


def test_rows_are_clipped_independently():
    x = np.array([[3.0, 4.0], [0.1, 0.2], [0.0, -10.0]])
    out = clip_rows(x, 2.0)
    np.testing.assert_allclose(out, [[1.2, 1.6], [0.1, 0.2], [0.0, -2.0]], rtol=0, atol=1e-15)


def test_zero_vector_stays_zero_without_nan_or_warning():
    with np.errstate(all="raise"):
        out = clip_rows(np.zeros((2, 3)), 0.5)
    assert np.array_equal(out, np.zeros((2, 3)))
    assert not np.isnan(out).any()


def test_output_is_float64_and_input_untouched():
    x = np.array([[3, 4]], dtype=np.int64)
    out = clip_rows(x, 1.0)
    assert out.dtype == np.float64
    assert x.tolist() == [[3, 4]]


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float64, st.tuples(st.integers(1, 8), st.integers(1, 6)), elements=st.floats(-1e6, 1e6)),
    bound=st.floats(1e-3, 1e3),
)
def test_clip_properties(x, bound):
    out = clip_rows(x, bound)
    norms_in = np.linalg.norm(x, axis=1)
    norms_out = np.linalg.norm(out, axis=1)
    # never longer than the bound, and never longer than the input
    assert np.all(norms_out <= bound * (1 + 1e-12))
    assert np.all(norms_out <= norms_in * (1 + 1e-12) + 1e-300)
    # rows inside are unchanged, rows outside land on the sphere in the same direction
    inside = norms_in <= bound
    assert np.array_equal(out[inside], x[inside])
    outside = ~inside
    np.testing.assert_allclose(norms_out[outside], bound, rtol=1e-12)
    np.testing.assert_allclose(out[outside], x[outside] * (bound / norms_in[outside])[:, None], rtol=1e-12, atol=0)


def test_labels_clipped_to_symmetric_interval():
    y = np.array([-7.0, -2.0, -0.5, 0.0, 1.5, 2.0, 9.0])
    np.testing.assert_array_equal(clip_labels(y, 2.0), [-2.0, -2.0, -0.5, 0.0, 1.5, 2.0, 2.0])
    assert clip_labels(np.array([3]), 2.5).dtype == np.float64


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -1e-9, math.nan, -math.inf])
def test_bad_clip_norm_raises_naming_the_bound(bad):
    with pytest.raises(ValueError, match="clip norm"):
        clip_rows(np.ones((1, 2)), bad)


@pytest.mark.parametrize("bad", [0, -3.0, math.nan])
def test_bad_label_clip_raises_naming_the_bound(bad):
    with pytest.raises(ValueError, match="label clip"):
        clip_labels(np.ones(2), bad)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_check_bound_names_its_argument(bad):
    with pytest.raises(ValueError, match="my_bound"):
        check_bound("my_bound", bad)
    assert check_bound("my_bound", 2) == 2.0


def test_infinite_bound_means_no_clipping():
    """Non-private runs clip nothing; check_bound refuses inf unless told to allow it."""
    x = np.array([[3.0, 4.0], [1e300, 0.0]])
    np.testing.assert_array_equal(clip_rows(x, math.inf), x)
    np.testing.assert_array_equal(clip_labels(np.array([-1e9, 7.0]), math.inf), [-1e9, 7.0])
    assert check_bound("b", math.inf, allow_inf=True) == math.inf


def test_huge_finite_row_is_clipped_in_its_direction():
    with np.errstate(over="ignore"):
        out = clip_rows(np.array([[1e200, 1e200]]), 1.0)
    np.testing.assert_allclose(out, [[math.sqrt(0.5), math.sqrt(0.5)]], rtol=1e-12)


def test_biased_row_clip_bounds_the_clipped_vector_with_its_bias_coordinate():
    # [Clip(u, 2), 0.75 x 2]: |.| <= sqrt(4 + 2.25) = 2.5; the per-item mean's rows are [1.5] alone
    assert biased_row_clip(2.0, 0.75) == pytest.approx(2.5)
    assert biased_row_clip(2.0, 0.75, has_embedding=False) == pytest.approx(1.5)
    rows = np.hstack([clip_rows(np.random.default_rng(0).normal(size=(50, 3)) * 10, 2.0), np.full((50, 1), 1.5)])
    assert np.linalg.norm(rows, axis=1).max() == pytest.approx(2.5)


@settings(max_examples=50, deadline=None)
@given(x=hnp.arrays(np.float64, (7, 5), elements=st.floats(-1e6, 1e6)), bound=st.floats(1e-3, 1e3))
def test_compiled_clip_agrees_with_clip_rows_and_keeps_the_bound(x, bound):
    # one compiled pass with no temporaries: clip_rows' result up to the norm's rounding
    out = clip_rows_into(x, bound, np.empty_like(x))
    np.testing.assert_allclose(out, clip_rows(x, bound), rtol=1e-14, atol=0)
    assert np.all(np.linalg.norm(out, axis=1) <= bound * (1 + 1e-12))


def test_compiled_clip_refuses_arrays_that_do_not_fit():
    with pytest.raises(ValueError, match="into a float64 array of"):
        clip_rows_into(np.ones((3, 4)), 1.0, np.empty((2, 4)))
    with pytest.raises(ValueError, match="no head of 5"):
        clip_rows_into(np.ones((3, 4)), 1.0, np.empty((3, 6)), head_bound=1.0)
    with pytest.raises(ValueError, match="clip norm must be"):
        clip_rows_into(np.ones((3, 4)), -1.0, np.empty((3, 4)))
