"""Engine-free privacy math: clipping, weights, keyed Gaussian noise, the per-item accumulator,
accounting with dp-accounting, and the privacy budget ledger.

Privacy: the package is the privacy logic; each module's paragraph says what it guarantees.
"""
