"""The statistics' kernel, compiled: per group of rows, the packed sum of w x x^T and the sum of w l x.

For the rows k of a group g (consecutive positions starts[g]:starts[g + 1] of the row order), with
x_k = vectors[source[k], :d], weight w_k and label l_k: a[g] <- the packed upper triangle of
sum_k w_k x_k x_k^T (privacy.accumulator.pack_upper's order) and b[g] <- sum_k w_k l_k x_k. With no
weights, w_k = 1; with no labels, l_k = vectors[source[k], d] (privacy.accumulator's augmented
kernel rows [x, s], whose grouped sums are sum x x^T and sum s x).

`source` indexes `vectors`, so rows are read where they lie: the augmented rows in file order (the
sort's permutation), or one table of clipped user vectors that every row of a user points into
(the Spark task's path, pipelines.releases.stats_core.item_sums: no per-row copy of a vector).

numba compiles one pass over the groups. A group of at least GEMM_ROWS rows is gathered into a
buffer as z_k = sqrt(w_k) [x_k, l_k], the rows some way ahead prefetched, and its Gram matrix's
upper triangle computed by one BLAS symmetric rank-k update (dsyrk); a smaller group is summed row
by row. The groups come from a compiled stable counting sort of the keys where they are integers
over a dense range (`grouped_order`). The compiled code is cached beside this file, except where the
module is read from a zip (spark-submit's --py-files). Its speed: docs/results.md
("Speed of the statistics kernel").

Privacy: the kernel sums the rows it is given before any noise; the order of the additions is fixed
by the rows' order, so reruns give the same bits, and nothing here is released without the
accumulator's noise.
"""

from __future__ import annotations

import llvmlite.binding
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import get_cython_function_address, intrinsic

from schemas.compiled import kernel

GEMM_ROWS = 8  # groups with at least this many rows: gathered and multiplied by BLAS
_AHEAD = 16  # rows prefetched ahead of the gather

# BLAS's symmetric rank-k update (scipy's, as numba's own np.dot uses), named for the linker on every
# import, so that the compiled code can be cached (an address would be baked into it)
llvmlite.binding.add_symbol("ssp_privacy_dsyrk", get_cython_function_address("scipy.linalg.cython_blas", "dsyrk"))
_dsyrk = types.ExternalFunction("ssp_privacy_dsyrk", types.void(*[types.voidptr] * 10))


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask the CPU to fetch array[index]'s cache line (llvm.prefetch: read, keep in all caches)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        fetch = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte] + [ir.IntType(32)] * 3)
        )
        builder.call(
            fetch,
            [builder.bitcast(builder.gep(data, [args[1]]), byte)] + [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)],
        )
        return context.get_dummy_value()

    return types.void(array, index), codegen


def _grouped_gram(
    starts: np.ndarray,
    source: np.ndarray,
    weights: np.ndarray,
    labels: np.ndarray,
    vectors: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    block: np.ndarray,
) -> None:
    """a (groups, d(d+1)/2) and b (groups, d) <- each group's sums (module docstring); `weights` or
    `labels` empty: none given. `vectors` C-contiguous; `block` (at least the largest group's rows
    from GEMM_ROWS on, d + 1) the gathered rows' buffer."""
    d = b.shape[1]
    width = vectors.shape[1]
    weighted = weights.size > 0
    labelled = labels.size > 0
    flat = vectors.reshape(-1)
    gram = np.zeros((d + 1, d + 1))  # row-major: its upper triangle is BLAS's lower one of the transpose
    lower, no_trans = np.array([ord("L")], np.uint8), np.array([ord("N")], np.uint8)
    size, rows, one, zero = np.array([d + 1], np.int32), np.zeros(1, np.int32), np.ones(1), np.zeros(1)
    for g in range(starts.size - 1):
        k, end = starts[g], starts[g + 1]
        if end - k >= GEMM_ROWS:
            for r in range(end - k):
                if k + r + _AHEAD < source.size:
                    ahead = source[k + r + _AHEAD] * width
                    for c in range(0, width, 8):  # a cache line holds 8 float64
                        _prefetch(flat, ahead + c)
                row = vectors[source[k + r]]
                root = np.sqrt(weights[k + r]) if weighted else 1.0
                for p in range(d):
                    block[r, p] = root * row[p]
                block[r, d] = root * (labels[k + r] if labelled else row[d])
            rows[0] = end - k
            # row-major block (rows x (d+1)) is BLAS's column-major (d+1) x rows: gram = block^T block
            _dsyrk(
                lower.ctypes,
                no_trans.ctypes,
                size.ctypes,
                rows.ctypes,
                one.ctypes,
                block.ctypes,
                size.ctypes,
                zero.ctypes,
                gram.ctypes,
                size.ctypes,
            )
        else:
            gram[:] = 0.0
            for r in range(k, end):
                row = vectors[source[r]]
                w = weights[r] if weighted else 1.0
                label = labels[r] if labelled else row[d]
                for p in range(d):
                    t = w * row[p]
                    for q in range(p, d):
                        gram[p, q] += t * row[q]
                    gram[p, d] += t * label
        at = 0
        for p in range(d):
            for q in range(p, d):
                a[g, at] = gram[p, q]
                at += 1
            b[g, p] = gram[p, d]


def _counting_order(keys: np.ndarray, low: int, starts: np.ndarray, order: np.ndarray) -> None:
    """A stable counting sort: order <- the positions of `keys` by ascending key, ties in their given
    order; starts (span + 1 entries, zeros) <- where each key value low + k begins in that order,
    starts[-1] the number of keys."""
    for i in range(keys.size):
        starts[keys[i] - low + 1] += 1
    for k in range(1, starts.size):
        starts[k] += starts[k - 1]
    cursor = starts[:-1].copy()
    for i in range(keys.size):
        k = keys[i] - low
        order[cursor[k]] = i
        cursor[k] += 1


grouped_gram_kernel = kernel(_grouped_gram)
counting_order_kernel = kernel(_counting_order)

MAX_BINS_PER_KEY = (
    2  # the counting sort's table at most this many entries per key (and at least 2^16), else a radix argsort
)


def grouped_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(order, unique keys, group starts) of integer `keys`: the stable order by key (as
    np.argsort(kind="stable")), the sorted distinct keys, and where each one's rows begin in that order
    (the last entry the number of keys). One counting pass and one scatter, compiled: no comparison
    sort and no sorted copy of the keys. None when the keys are not integers or span more than
    MAX_BINS_PER_KEY entries per key (a sparse id space: the caller sorts)."""
    keys = np.asarray(keys)
    if (
        keys.dtype.kind not in "iu" or keys.dtype.itemsize > 8 - (keys.dtype.kind == "u") * 4 or keys.size == 0
    ):  # uint64: its difference leaves int64
        return None
    low, high = int(keys.min()), int(keys.max())
    span = high - low + 1
    if span > max(MAX_BINS_PER_KEY * keys.size, 1 << 16):
        return None
    starts = np.zeros(span + 1, dtype=np.int64)
    order = np.empty(keys.size, dtype=np.int64)
    counting_order_kernel(keys, low, starts, order)
    present = np.flatnonzero(starts[1:] > starts[:-1])
    return order, low + present.astype(keys.dtype), np.r_[starts[present], keys.size]


def grouped_gram(
    starts: np.ndarray,
    source: np.ndarray,
    vectors: np.ndarray,
    d: int,
    weights: np.ndarray | None = None,
    labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(a (groups, d(d+1)/2), b (groups, d)) of the groups whose rows start at `starts` (increasing,
    the last entry the number of rows): module docstring. `vectors` has d + 1 columns when `labels`
    is None (the last one the label), else at least d."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float64)
    if vectors.ndim != 2 or vectors.shape[1] < d + (labels is None):
        raise ValueError(f"vectors {vectors.shape} need {d + (labels is None)} columns")
    starts, source = np.asarray(starts, dtype=np.int64), np.asarray(source, dtype=np.int64)
    n = source.size
    if starts.ndim != 1 or starts.size < 1 or starts[0] != 0 or starts[-1] != n or np.any(np.diff(starts) < 0):
        raise ValueError(f"group starts must rise from 0 to the {n} rows")
    if n and (source.min() < 0 or source.max() >= vectors.shape[0]):
        raise ValueError(f"row sources must index the {vectors.shape[0]} vectors")
    for name, values in (("weights", weights), ("labels", labels)):
        if values is not None and np.shape(values) != (n,):
            raise ValueError(f"{name} {np.shape(values)} do not match the {n} rows")
    groups = starts.size - 1
    a, b = np.empty((groups, d * (d + 1) // 2)), np.empty((groups, d))
    widest = int(np.diff(starts).max(initial=0))
    block = np.empty(
        (widest if widest >= GEMM_ROWS else 0, d + 1)
    )  # numpy's allocation: huge pages where the kernel offers them
    empty = np.zeros(0)
    grouped_gram_kernel(
        starts,
        source,
        empty if weights is None else np.ascontiguousarray(weights, dtype=np.float64),
        empty if labels is None else np.ascontiguousarray(labels, dtype=np.float64),
        vectors,
        a,
        b,
        block,
    )
    return a, b
