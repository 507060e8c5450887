"""Serving a stage to trainers: the hivemind backend and server, and every check a request passes before a pool."""
