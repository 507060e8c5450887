"""Faulty workers for tests and benches: the ``agora`` CLI with a lying and/or slow stage backend injected, or
with a presence cheat.

    python tests/faulty_worker.py --slowdown 12 worker --stage body1 --seeds ...
    python tests/faulty_worker.py --lie runtime --swarm URL ...
    python tests/faulty_worker.py --rotate-run-id runtime --swarm URL ...

The fault flags come first; the rest is an ordinary ``agora`` command line. The faulty backend replaces
``StageBackend`` where the worker node builds it, in this process, so both ``worker`` and ``runtime`` (which
builds its worker in-process) serve through it. ``--rotate-run-id`` is the presence cheat of issue 46: a fresh
``run_id`` in every metrics record the worker publishes, as if it restarted before each scrape. From Python, give
``faulty(...)`` as the ``program`` of a ManagedProcess or of ``LocalSwarm.start_worker``.
"""

from __future__ import annotations

import argparse
import importlib
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages, whatever the cwd

import torch  # noqa: E402

from agora_client.monitor.records import MetricsRecord  # noqa: E402
from agora_client.serving.backend import StageBackend  # noqa: E402
from agora_client.worker.metrics import WorkerMetrics  # noqa: E402

INJECTED_INTO = "agora_client.worker.node"  # the module whose WorkerNode builds the StageBackend


@dataclass(frozen=True)
class Faults:
    lie: bool = False  # answer random tensors of the right shape and scale: the dishonest worker of spot checks
    slowdown_s: float = 0.0  # seconds added to every request: a request surely outstanding when the worker dies
    slower: float = 1.0  # every request takes this many times its own time: a GPU this many times slower
    rotate_run_id: bool = False  # a fresh run id in every metrics record: a restart the monitor would pay again

    def __post_init__(self) -> None:
        if self.slowdown_s < 0 or self.slower < 1:
            raise ValueError(f"--slowdown must be >= 0 and --slower >= 1 (got {self.slowdown_s:g}, {self.slower:g})")

    def flags(self) -> list[str]:
        """These faults as the flags of main(), the ones that differ from an honest worker's."""
        flags = ["--lie"] if self.lie else []
        flags += ["--slowdown", str(self.slowdown_s)] if self.slowdown_s else []
        flags += ["--slower", str(self.slower)] if self.slower != 1 else []
        return flags + (["--rotate-run-id"] if self.rotate_run_id else [])


class FaultyBackend(StageBackend):
    """A StageBackend that computes honestly, then waits as a slower GPU would and, if it lies, scrambles its answer."""

    faults = Faults()  # set per subclass by faulty_backend()

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        started = time.perf_counter()
        outputs = super().forward(*inputs)
        self._emulate_slower_gpu(started)
        return self._answer(outputs)

    def backward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        started = time.perf_counter()
        grads = super().backward(*inputs)
        self._emulate_slower_gpu(started)
        return self._answer(grads)

    def _emulate_slower_gpu(self, started: float) -> None:
        # asleep, so a slow worker does not take the CPU from the others on a shared machine
        delay = self.faults.slowdown_s + (self.faults.slower - 1.0) * (time.perf_counter() - started)
        if delay > 0:
            time.sleep(delay)

    def _answer(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.faults.lie:
            return tensors
        return tuple(
            torch.randn_like(t) * t.pow(2).mean().sqrt() if t.is_floating_point() and t.numel() else t for t in tensors
        )


def faulty_backend(faults: Faults) -> type[FaultyBackend]:
    """A FaultyBackend class carrying ``faults``, built with StageBackend's own arguments."""
    return type("FaultyBackend", (FaultyBackend,), {"faults": faults})


def inject(faults: Faults) -> type[FaultyBackend]:
    """Make every worker node built in this process serve through a backend with ``faults`` (and publish a fresh
    run id in every metrics record, with ``rotate_run_id``)."""
    module = importlib.import_module(INJECTED_INTO)
    built = getattr(module, "StageBackend", None)
    if not (isinstance(built, type) and issubclass(built, StageBackend)):
        raise RuntimeError(f"{INJECTED_INTO} no longer builds StageBackend by that name: update tests/faulty_worker.py")
    module.StageBackend = backend = faulty_backend(faults)
    if faults.rotate_run_id:
        WorkerMetrics.snapshot = _with_a_fresh_run_id(WorkerMetrics.snapshot)
    return backend


def _with_a_fresh_run_id(
    snapshot: Callable[[WorkerMetrics], MetricsRecord],
) -> Callable[[WorkerMetrics], MetricsRecord]:
    def cheating(metrics: WorkerMetrics) -> MetricsRecord:
        metrics.run_id = secrets.token_hex(8)
        return snapshot(metrics)

    return cheating


def faulty(*, lie: bool = False, slowdown: float = 0.0, slower: float = 1.0, rotate_run_id: bool = False) -> list[str]:
    """The program running ``agora`` with these faults, for ManagedProcess / LocalSwarm.start_worker's ``program``."""
    return [sys.executable, str(Path(__file__).resolve()), *Faults(lie, slowdown, slower, rotate_run_id).flags()]


def parse(argv: list[str]) -> tuple[Faults, list[str]]:
    """(the faults, the agora command line after them); bad fault flags exit 2 with argparse's message."""
    parser = argparse.ArgumentParser(prog="faulty_worker", description="agora with a faulty stage backend injected")
    parser.add_argument("--lie", action="store_true", help="answer random tensors of the right shape and scale")
    parser.add_argument("--slowdown", type=float, default=0.0, metavar="S", help="seconds added to every request")
    parser.add_argument(
        "--slower", type=float, default=1.0, metavar="F", help="every request takes F times its own time"
    )
    parser.add_argument(
        "--rotate-run-id", action="store_true", help="a fresh run id in every metrics record (a presence cheat)"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the agora command line, e.g. worker --stage body1 ..."
    )
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the agora command to run after the fault flags, e.g. worker --stage body1 ...")
    try:
        return Faults(args.lie, args.slowdown, args.slower, args.rotate_run_id), args.command
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    faults, command = parse(sys.argv[1:] if argv is None else argv)
    inject(faults)
    from agora_client.cli import main as agora

    return agora(command)


if __name__ == "__main__":
    sys.exit(main())
