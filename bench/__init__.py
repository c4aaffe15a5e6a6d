"""Benchmarks and the reproduction of the paper's experiments (reports, plots)."""

import schemas  # noqa: F401  (its warning filter, before Beam or gcsfs is imported)
