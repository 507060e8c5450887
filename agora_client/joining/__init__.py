"""A contributor joining a swarm: preflight, identity, GPU fit, the stage prepared while the snapshot downloads."""
