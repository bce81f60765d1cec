"""Training: the loop, optimizer, data, checkpoints and metrics, the same for every layout."""
