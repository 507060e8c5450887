"""Stage checkpoints by wall-clock time: retention, consistent sets, resume checks and the Hugging Face export."""

from .retention import Retention
from .sets import CheckpointError, CheckpointSet, format_time, list_sets, parse_time, run_record, select_set

__all__ = [
    "CheckpointError",
    "CheckpointSet",
    "Retention",
    "format_time",
    "list_sets",
    "parse_time",
    "run_record",
    "select_set",
]
