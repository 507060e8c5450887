"""Averaging a stage with its other workers: SPARTA rounds, rotating slices, bounded influence, ticketed groups."""
