"""Long functions read as steps: none in agora_client/ or tui/ runs over 50 lines (signature and docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 50


def long_functions() -> list[str]:
    found = []
    for path in sorted([*(ROOT / "agora_client").rglob("*.py"), *(ROOT / "tui").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_runs_over_fifty_lines() -> None:
    assert long_functions() == []
