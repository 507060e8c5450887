"""Rotating JSONL event logs, one set per GPU, written in every mode (app and headless).

``<logs dir>/gpu0.jsonl`` holds the newest events of the worker on GPU 0 (``cpu.jsonl`` without
a GPU); when it passes ``max_bytes`` it becomes ``gpu0.1.jsonl`` and older files shift up to
``backups``. Every line is redacted before it is written, so a secret never reaches a log.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterable, TextIO

from agora_client.events import Event, dump_event
from agora_client.system.redact import redact_line

DEFAULT_MAX_BYTES = 5 * 1024 * 1024
DEFAULT_BACKUPS = 4


def logs_dir(config_dir: Path) -> Path:
    return Path(config_dir) / "logs"


def log_name(gpu_index: int | None) -> str:
    return "cpu" if gpu_index is None else f"gpu{gpu_index}"


class EventLog:
    """Appends redacted JSON lines to ``<directory>/<name>.jsonl`` and rotates it by size."""

    def __init__(
        self,
        directory: Path,
        name: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        secrets: Iterable[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self.name = name
        self.max_bytes = max_bytes
        self.backups = backups
        self._secrets = tuple(secret for secret in secrets if secret)
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = None

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.jsonl"

    def _rotated(self, number: int) -> Path:
        return self.directory / f"{self.name}.{number}.jsonl"

    def _open(self) -> TextIO:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for number in range(self.backups - 1, 0, -1):
            if self._rotated(number).exists():
                os.replace(self._rotated(number), self._rotated(number + 1))
        if self.backups > 0:
            os.replace(self.path, self._rotated(1))
        else:
            self.path.unlink(missing_ok=True)

    def write_line(self, line: str) -> None:
        """One line of the runtime's stream, as received (it need not be valid JSON)."""
        text = redact_line(line, self._secrets) + "\n"
        with self._lock:
            handle = self._open()
            handle.write(text)
            handle.flush()
            if handle.tell() >= self.max_bytes:
                self._rotate()

    def write_event(self, event: Event) -> None:
        self.write_line(dump_event(event))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
