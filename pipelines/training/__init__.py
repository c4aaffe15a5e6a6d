"""A training run: its settings, run directory, stages, commands and publish (pipelines.training.stages runs them
all).

Privacy: the stages' modules say theirs; the item updates read released tables and public features
only, except AM-DPSGD, under its own release.
"""
