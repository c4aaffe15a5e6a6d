"""Benchmarks and the reproduction of the paper's experiments (reports, plots)."""
