"""A worker: one stage's parameters, optimizer, epochs and sync phases, assembled from serving/ and averaging/."""
