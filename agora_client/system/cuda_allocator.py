"""The CUDA caching allocator's settings for the processes that hold a stage on a GPU.

Expandable segments grow the allocator's memory in place instead of caching fixed blocks, so what a stage frees
can be reused by a request of another size. Without them the 8b tail in the offload layout, planned at 22.6 GiB, ran
out of an emulated 24 GiB card on an H200 with 2.56 GiB reserved and unused (bench/gpu_check.py). The setting is
read when a process makes its first CUDA allocation, so it is set before one; an operator's own value wins.
"""

from __future__ import annotations

import os

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments() -> None:
    os.environ.setdefault(ALLOC_CONF, EXPANDABLE_SEGMENTS)
