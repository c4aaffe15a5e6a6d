"""Model side: the public item encoder, the SSP trainers, DP-SGD and ALS baselines, evaluation metrics.

It consumes only released (noised) statistics and public item features, never interactions.
TensorFlow is imported by the modules that need it, not by this package.

Privacy: the trainers read released statistics and public features; DP-SGD reads private rows under
its own release (trainer.dpsgd).
"""
