"""numba's compile of the project's kernels (the noise, the statistics, the clip, the digests, the
id lookups, the user update).

Privacy: compiles code only.
"""

from __future__ import annotations

import contextlib

import numba


def kernel(function):
    """`function` compiled by numba without the GIL, its machine code cached beside its module,
    except where the module is read from a zip (spark-submit's --py-files): there it is compiled
    once a process."""
    compiled = numba.njit(nogil=True)(function)
    with contextlib.suppress(RuntimeError):  # no file beside a zipped module to cache it in
        compiled.enable_caching()
    return compiled
