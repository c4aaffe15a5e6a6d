"""The noise's compiled kernels: the Gaussian transform (privacy.noise, step 3), Box-Muller from
IEEE-exact operations only, and the rounding of a release to the noise's grid (step 4).

ln, cos and sin come from tables built at import from Taylor series (no libm, whose last bits vary
by machine), then short polynomials; numba compiles the transform without fast-math, so nothing is
reassociated or fused and every value is the same bits on every machine (tests/privacy/test_noise.py
pins them). privacy.noise imports this module on the first draw; the compiled code is cached beside
this file except where the module is read from a zip (spark-submit's --py-files). docs/noise.md has
the construction.

Privacy: the kernels only transform keystream words and round to the grid; they hold no secret and
read no data beyond the values they are handed, and their bits must not vary by machine, or a
retried task would release different noise.
"""

from __future__ import annotations

import math

import numpy as np

from schemas.compiled import kernel

# ln 2 split so that e * _LN2_HI is exact for |e| < 2^20 (fdlibm's constants): the log table's ln(1/2)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SQRT_HALF = math.sqrt(0.5)
_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 below 1
# ln m = 2 atanh(s) = 2 s sum_k s^2k / (2k + 1), |s| <= 3 - 2 sqrt(2): terms to s^20 reach 2^-56
_ATANH = tuple(1.0 / (2 * k + 1) for k in range(10, -1, -1))
# sin a = a sum_k (-1)^k a^2k / (2k+1)!, cos a = sum_k (-1)^k a^2k / (2k)!, |a| <= pi/4: to a^17, a^18
_SIN = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(8, -1, -1))
_COS = tuple((-1) ** k / math.factorial(2 * k) for k in range(9, -1, -1))


def _horner(x: np.ndarray, coefficients: tuple[float, ...]) -> np.ndarray:
    """sum_k c_k x^k, the coefficients from the highest power down (a new array)."""
    result = np.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        result *= x
        result += c
    return result


def _sin_cos_turns(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi w / 2^64 (to 53 bits of the turn) from Taylor polynomials on a quarter
    turn: builds the tables below. Quadrant q (the nearest), a in [-pi/4, pi/4) from the rest."""
    shifted = words + np.uint64(1 << 61)
    quadrant = (shifted >> np.uint64(62)).astype(np.intp)
    a = (((shifted & np.uint64((1 << 62) - 1)).view(np.int64) - np.int64(1 << 61)) >> np.int64(9)).astype(np.float64)
    a *= math.pi / 2**54  # (pi / 2) 2^-53 per unit: |a| <= pi/4
    a2 = a * a
    sin_a = _horner(a2, _SIN) * a
    cos_a = _horner(a2, _COS)
    odd = (quadrant & 1).astype(bool)  # cos and sin of q pi/2 + a: (c, s), (-s, c), (-c, -s), (s, -c)
    return (
        np.where(odd, sin_a, cos_a) * np.array([1.0, -1.0, -1.0, 1.0])[quadrant],
        np.where(odd, cos_a, sin_a) * np.array([1.0, 1.0, -1.0, -1.0])[quadrant],
    )


def _log_series(m: np.ndarray) -> np.ndarray:
    """ln m for m in [1/2, 1] (exact operations only): builds the table below."""
    m = m.copy()
    low = m < _SQRT_HALF
    m[low] *= 2.0
    s = (m - 1.0) / (m + 1.0)  # m - 1 exact (Sterbenz); ln m = 2 atanh(s), |s| <= 3 - 2 sqrt(2)
    return 2.0 * s * _horner(s * s, _ATANH) - np.where(low, _LN2_HI, 0.0) - np.where(low, _LN2_LO, 0.0)


# Angle table: cos and sin of 2 pi (j + 1/2) / 2^_TURN_BITS. A draw's angle is its entry's plus a
# remainder |d| <= pi / 2^_TURN_BITS: sin d = d - d^3/6 and cos d = 1 - d^2/2 leave out under 2^-56.
_TURN_BITS = 14
_TURN_COS, _TURN_SIN = _sin_cos_turns(
    (np.arange(1 << _TURN_BITS, dtype=np.uint64) << np.uint64(64 - _TURN_BITS)) + np.uint64(1 << (63 - _TURN_BITS))
)
# Log table: mantissas m in [1/2, 1) fall in bins i = floor(m 2^(_LOG_BITS+1)) in [2^_LOG_BITS, 2^(_LOG_BITS+1)),
# each with its centre c_i (the top bin: 1, so that ln u near 0 keeps its relative precision), 1 / c_i
# and -2 ln c_i. Then -2 ln m = -2 ln c_i - 2 log1p(r), r = (m - c_i) / c_i, |r| <= 2^-(_LOG_BITS+1), and
# -2 log1p(r) = -2r + r^2 - 2r^3/3 + r^4/2 leaves out under 2^-54 r.
_LOG_BITS = 12
_LOG_CENTRE = (np.arange(2 << _LOG_BITS, dtype=np.float64) + 0.5) * 2.0 ** -(_LOG_BITS + 1)
_LOG_CENTRE[: 1 << _LOG_BITS] = 1.0  # unused bins (m < 1/2)
_LOG_CENTRE[-1] = 1.0
_LOG_INVERSE = 1.0 / _LOG_CENTRE
_MINUS_TWO_LOG_CENTRE = -2.0 * _log_series(_LOG_CENTRE)
_MINUS_TWO_LN2 = -2.0 * math.log(
    2.0
)  # e (-2 ln 2) in one rounding: within 2^-54 |e| of exact, far below an ulp of -2 ln u


_BINS_PER_UNIT = float(2 << _LOG_BITS)  # a mantissa m in [1/2, 1) is in log bin floor(m 2^(_LOG_BITS+1))
_ANGLE_SHIFT = np.uint64(64 - _TURN_BITS)  # an angle word's top bits: its turn table entry
_ANGLE_REST = np.uint64((1 << (64 - _TURN_BITS)) - 1)
_ANGLE_HALF = np.int64(1 << (63 - _TURN_BITS))  # the entry's centre, in the rest's units
_ANGLE_UNIT = 2 * math.pi / 2.0**64  # radians per unit of the rest (exact: a power-of-two division)
_LOW_WORD = np.uint64(0xFFFFFFFF)
_MANTISSA = np.uint64((1 << 52) - 1)  # a float64's fraction bits
_HALF_EXPONENT = np.uint64(1022 << 52)  # the exponent bits of [1/2, 1)


def _pairs(words: np.ndarray, out: np.ndarray) -> None:
    """out[2k], out[2k+1] = R cos t, R sin t of words[2k], words[2k+1] (1-d uint64, even length; out
    float64 of the same length): u = (w + 1/2) / 2^64 rounded once and capped below 1, R^2 = -2 ln u
    from the log table, t = 2 pi w' / 2^64 from the turn table (the tables above; privacy.noise, step 3)."""
    for k in range(words.size // 2):
        radius_word, angle_word = words[2 * k], words[2 * k + 1]
        # u = hi 2^-32 + (lo + 1/2) 2^-64: both exact, one rounding in the sum
        u = float(radius_word >> np.uint64(32)) * 2.0**-32 + (float(radius_word & _LOW_WORD) + 0.5) * 2.0**-64
        u = min(u, _BELOW_ONE)
        # R^2 = e (-2 ln 2) - 2 ln c - 2 log1p(r), u = m 2^e, c the centre of m's bin, r = (m - c) / c;
        # m and e from u's bits (frexp's values exactly, u being normal: u >= 2^-65), 2.4x faster than frexp here
        bits = np.float64(u).view(np.uint64)
        m = np.uint64((bits & _MANTISSA) | _HALF_EXPONENT).view(np.float64)
        e = np.int64(bits >> np.uint64(52)) - 1022
        b = int(m * _BINS_PER_UNIT)
        r = (m - _LOG_CENTRE[b]) * _LOG_INVERSE[b]
        square = ((((r * 0.5 - 2.0 / 3.0) * r + 1.0) * r - 2.0) * r + _MINUS_TWO_LOG_CENTRE[b]) + float(
            e
        ) * _MINUS_TWO_LN2
        radius = math.sqrt(max(square, 0.0))  # positive already (u < 1): a guard against a NaN radius
        # t = 2 pi (j + 1/2) / 2^_TURN_BITS + d: cos t = cos_j - (cos_j h + sin_j sin d), sin t = sin_j - (sin_j h -
        # cos_j sin d)
        j = np.int64(angle_word >> _ANGLE_SHIFT)
        d = float(np.int64(angle_word & _ANGLE_REST) - _ANGLE_HALF) * _ANGLE_UNIT
        h = d * d
        sin_d = h * (-1.0 / 6.0) * d + d
        h = h * 0.5
        cos_j, sin_j = _TURN_COS[j], _TURN_SIN[j]
        out[2 * k] = (cos_j - (cos_j * h + sin_j * sin_d)) * radius
        out[2 * k + 1] = (sin_j - (sin_j * h - cos_j * sin_d)) * radius


def _on_grid(
    z: np.ndarray, factor: float, grid: float, values: np.ndarray, positions: np.ndarray, out: np.ndarray
) -> None:
    """out <- grid (rint(z factor) + rint(values / grid) at rows `positions`): privacy.noise.add_noise's
    release (step 4) with the same operations in the same order, one pass over a chunk of items while
    its noise is in the cache. z, out (n, w); values (len(positions), w); positions increasing rows of out."""
    rows, width = z.shape
    for i in range(rows):
        for j in range(width):
            out[i, j] = np.rint(z[i, j] * factor)
    for p in range(positions.size):
        i = positions[p]
        for j in range(width):
            out[i, j] = out[i, j] + np.rint(values[p, j] / grid)
    for i in range(rows):
        for j in range(width):
            out[i, j] = out[i, j] * grid


box_muller = kernel(_pairs)
on_grid = kernel(_on_grid)
