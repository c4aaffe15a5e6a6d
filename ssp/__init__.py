"""The `ssp` command line (ssp.cli): the top of the house, above pipelines/ and bench/.

Privacy: the commands run the stages, which hold the privacy logic.
"""
