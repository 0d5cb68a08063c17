"""Training checkpoints, parameters-only checkpoints and what readers of a run take from its
workdir."""
