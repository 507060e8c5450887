"""The CUDA allocator's settings (agora_client/system/cuda_allocator.py): set by every command that runs an engine
peer, before it could allocate, and never over an operator's own."""

from __future__ import annotations

import os

import pytest

from agora_client.cli import main
from agora_client.system.cuda_allocator import ALLOC_CONF, EXPANDABLE_SEGMENTS


def _help(command: str) -> None:
    with pytest.raises(SystemExit):  # argparse's --help: the command parsed its arguments and ran nothing
        main([command, "--help"])


def test_engine_commands_use_expandable_segments_and_an_operators_setting_wins(monkeypatch, capsys) -> None:
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    _help("describe")
    assert ALLOC_CONF not in os.environ  # no engine, no GPU: nothing to set
    _help("worker")
    assert os.environ[ALLOC_CONF] == EXPANDABLE_SEGMENTS
    monkeypatch.setenv(ALLOC_CONF, "backend:cudaMallocAsync")
    _help("runtime")
    assert os.environ[ALLOC_CONF] == "backend:cudaMallocAsync"
