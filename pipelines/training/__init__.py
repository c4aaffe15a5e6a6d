"""A training run: its settings, run directory, stages, commands and publish (pipelines.training.stages runs them
all)."""
