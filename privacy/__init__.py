"""Engine-free privacy math: clipping, weights, keyed Gaussian noise, the per-item accumulator,
accounting with dp-accounting, and the privacy budget ledger.
"""
