"""The `ssp` command line (ssp.cli): the top of the house, above pipelines/ and bench/."""
