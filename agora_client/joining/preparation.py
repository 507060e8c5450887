"""What a contributor does for its assigned stage while it waits for admission: fetch the snapshot, build the stage.

Both start as soon as the stage is known, possibly deep in the join queue, and run side by side in
daemon threads, so the worker's start after admission is only loading the snapshot into a stage
that already exists. The threads end with the process if the contributor stops first; a partial
download is resumed next time. Once the assigned stage's snapshot is downloaded, every other download
(earlier joins, recoveries, a stage assigned before this one) is removed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from agora_client.auth.client import StageAssignment
from agora_client.config import RunConfig
from agora_client.events import EventWriter
from agora_client.network.outage import Outage
from agora_client.snapshots import download_snapshot, remove_other_downloads
from agora_client.worker.prepared_stage import PreparedStage, prepare_stage

POLL_SECONDS = 0.2  # how soon a wait notices the stop event


class _Call:
    """One call in a daemon thread; what it returned or raised is kept for ``outcome``."""

    def __init__(self, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any):
        self._value: Any = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(function, args, kwargs), name=name, daemon=True)
        self._thread.start()

    def _run(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._value = function(*args, **kwargs)
        except Exception as error:  # raised again in the waiting thread, where the runtime reports it
            self._error = error

    def finished(self, stop: threading.Event) -> bool:
        """Wait for the call; False as soon as ``stop`` is set."""
        while self._thread.is_alive():
            if stop.wait(POLL_SECONDS):
                return False
        return True

    def outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class StagePreparation:
    """``new_outage``: how each download waits through an outage of the snapshot server (none: it fails sooner)."""

    def __init__(
        self,
        config: RunConfig,
        device: str,
        snapshot_dir: Path,
        events: EventWriter,
        new_outage: Callable[[], Outage] | None = None,
    ):
        self.config, self.device, self.snapshot_dir, self.events = config, device, snapshot_dir, events
        self.new_outage = new_outage
        self.assignment: StageAssignment | None = None
        self._download: _Call | None = None
        self._build: _Call | None = None

    @property
    def stage(self) -> str | None:
        return self.assignment.stage if self.assignment is not None else None

    def start(self, assignment: StageAssignment, layout: str = "fp32") -> None:
        """Start both for this stage, the build in the card's ``layout`` (see prepare_stage); another stage (a
        re-join in the queue was given one) starts them again,
        and what the earlier threads produce is dropped. The same stage again is ignored, even under a new
        URL (an object store presigns a new one at every answer)."""
        if assignment.stage == self.stage:
            return
        self.assignment = assignment
        url = assignment.snapshot_url
        self._download = (
            None
            if not url
            else _Call(
                "snapshot download",
                download_snapshot,
                url,
                self.snapshot_dir,
                events=self.events,
                outage=self.new_outage() if self.new_outage is not None else None,
            )
        )
        self._build = _Call(
            "stage build",
            prepare_stage,
            self.config,
            assignment.stage,
            self.device,
            seed=self.config.seed,
            seeded_weights=not url,  # a snapshot will set every weight
            layout=layout,
        )

    def result(self, stop: threading.Event) -> tuple[Path | None, PreparedStage] | None:
        """(the downloaded snapshot or None when the stage has none, the built stage) once both are done;
        None as soon as ``stop`` is set. Raises what either raised, the download's error first."""
        if self._build is None:
            raise RuntimeError("nothing was started: the stage is not assigned yet")
        snapshot = None
        if self._download is not None:
            if not self._download.finished(stop):
                return None
            snapshot = self._download.outcome()
            remove_other_downloads(
                snapshot
            )  # here, not in the download thread: a dropped thread must not remove this one
        if not self._build.finished(stop):
            return None
        return snapshot, self._build.outcome()
