"""The stage stand-in of bench/utilization.py: the ``agora`` CLI whose worker serves a stage that only takes time.

    python bench/_utilization_standin.py --forward-s 0.7 --backward-s 2.1 --microbatch 52 --busy-dir D worker ...

The stand-in flags come first; the rest is an ordinary ``agora`` command line. As tests/faulty_worker.py injects its
faults, this replaces ``StageBackend`` where the worker node builds it, so everything around the stage's math is the
product's own: tickets, validation, the pools, the stage lock, epochs, SPARTA, the DHT. Each request holds the stage
lock (never two at once), sleeps the time a card needs for it (``request_seconds``: the stage's seconds per
microbatch at that card x the request's share of the microbatch x --slower), and answers zeros of the stage's output
shapes (forward) or of its inputs' (backward). No parameter gets a gradient: the optimizer steps on nothing.

``--pad-to N`` adds one trainable parameter so that the stage holds N values: SPARTA then averages an 8b-sized
slice (scaled) although the stage's own weights are tiny's. Every request appends a line to
``<busy-dir>/<uid>.tsv``: kind, arrived, started, ended (wall-clock seconds), samples.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages, whatever the cwd

import torch  # noqa: E402

from agora_client.serving.backend import StageBackend  # noqa: E402

INJECTED_INTO = "agora_client.worker.node"  # the module whose WorkerNode builds the StageBackend and prepares the stage
FORWARD_SHARE = 0.25  # of a microbatch's FLOPs (model/memory.py): forward 1 of 4 forwards' worth, backward the other 3
PADDING = "sparta_padding"


def stage_seconds(flops_per_microbatch: float, peak_flops: float, mfu: float, scale: float) -> float:
    """Seconds per microbatch (forward + recomputing backward) at ``mfu`` of a card's peak, divided by ``scale``."""
    if min(flops_per_microbatch, peak_flops, mfu, scale) <= 0:
        raise ValueError("FLOPs, peak, MFU and scale must be positive")
    return flops_per_microbatch / (peak_flops * mfu) / scale


@dataclass(frozen=True)
class StandIn:
    forward_s: float  # one microbatch's forward request on this worker's card
    backward_s: float  # one microbatch's backward request (recomputed forward + backward)
    microbatch: int  # samples of one microbatch: a request of other size takes its share
    slower: float = 1.0  # a card this many times slower (the straggler)
    busy_dir: Path | None = None
    pad_to: int = 0  # trainable values the stage holds (0: its own)

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s) <= 0 or self.microbatch < 1 or self.slower < 1 or self.pad_to < 0:
            raise ValueError("times must be positive, --microbatch >= 1, --slower >= 1 and --pad-to >= 0")

    def request_seconds(self, kind: str, samples: int) -> float:
        per_microbatch = {"forward": self.forward_s, "backward": self.backward_s}[kind]
        return per_microbatch * self.slower * samples / self.microbatch


class StandInBackend(StageBackend):
    """A StageBackend that takes the stand-in's time under the stage lock and answers zeros of the right shapes."""

    standin = StandIn(1.0, 1.0, 1)  # set per subclass by standin_backend()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._log_lock = threading.Lock()
        self._log_path = None if self.standin.busy_dir is None else self.standin.busy_dir / f"{self.name}.tsv"

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        samples = inputs[0].shape[0]
        with self._taking_time("forward", samples):
            outputs = tuple(torch.zeros((samples, *out.size[1:]), dtype=out.dtype) for out in self._output_schemas())
        self._on_forward(_tokens(inputs), outputs)
        return outputs

    def backward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        forward_inputs = inputs[: len(self.args_schema)]  # then the gradients of the outputs
        samples = forward_inputs[0].shape[0]
        with self._taking_time("backward", samples):
            self.on_backward(samples)  # under the stage lock, as StageBackend's: the epoch counter requires it
        grads = tuple(torch.zeros_like(tensor) for tensor in forward_inputs)
        self._on_backward(_tokens(forward_inputs))
        return grads

    def _output_schemas(self) -> tuple:
        schema = self.outputs_schema
        return tuple(schema) if isinstance(schema, (tuple, list)) else (schema,)

    @contextlib.contextmanager
    def _taking_time(self, kind: str, samples: int) -> Iterator[None]:
        """Hold the stage lock for the request's time, then run the block still holding it."""
        arrived = time.time()
        with self._locked():
            started = time.time()
            time.sleep(self.standin.request_seconds(kind, samples))  # asleep: the shared CPU stays the others'
            ended = time.time()
            yield
        self._record(kind, arrived, started, ended, samples)

    def _record(self, kind: str, arrived: float, started: float, ended: float, samples: int) -> None:
        if self._log_path is None:
            return
        with self._log_lock, self._log_path.open("a", encoding="utf-8") as log:
            log.write(f"{kind}\t{arrived:.6f}\t{started:.6f}\t{ended:.6f}\t{samples}\n")


def _tokens(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return next(tensor for tensor in inputs if not tensor.is_floating_point())


def standin_backend(standin: StandIn) -> type[StandInBackend]:
    return type("StandInBackend", (StandInBackend,), {"standin": standin})


def padded(prepare, pad_to: int):
    """``prepare_stage`` whose module holds ``pad_to`` trainable values: one extra flat parameter, never used."""

    def prepare_padded(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        own = sum(p.numel() for p in prepared.module.parameters() if p.requires_grad)
        if pad_to > own:
            values = torch.randn(pad_to - own) * 0.02  # weights of a usual scale: int8 quantizes them as it would
            prepared.module.register_parameter(PADDING, torch.nn.Parameter(values))
        return prepared

    return prepare_padded


def inject(standin: StandIn) -> type[StandInBackend]:
    """Make every worker node built in this process serve through the stand-in (and hold the padded stage)."""
    module = importlib.import_module(INJECTED_INTO)
    built = getattr(module, "StageBackend", None)
    if not (isinstance(built, type) and issubclass(built, StageBackend)) or not callable(
        getattr(module, "prepare_stage", None)
    ):
        raise RuntimeError(f"{INJECTED_INTO} no longer builds StageBackend / prepare_stage by those names")
    module.StageBackend = backend = standin_backend(standin)
    if standin.pad_to:
        module.prepare_stage = padded(module.prepare_stage, standin.pad_to)
    if standin.busy_dir is not None:
        standin.busy_dir.mkdir(parents=True, exist_ok=True)
    return backend


def parse(argv: list[str]) -> tuple[StandIn, list[str]]:
    parser = argparse.ArgumentParser(prog="_utilization_standin", description=__doc__.splitlines()[0])
    parser.add_argument("--forward-s", type=float, required=True, help="seconds of one microbatch's forward")
    parser.add_argument("--backward-s", type=float, required=True, help="seconds of one microbatch's backward")
    parser.add_argument("--microbatch", type=int, required=True, help="samples per microbatch")
    parser.add_argument("--slower", type=float, default=1.0, help="every request takes this many times longer")
    parser.add_argument("--busy-dir", type=Path, default=None, help="append each request's interval here")
    parser.add_argument("--pad-to", type=int, default=0, help="trainable values the stage holds (SPARTA's slice)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the agora command line, e.g. worker ...")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the agora command to run after the stand-in flags, e.g. worker --stage body1 ...")
    try:
        standin = StandIn(args.forward_s, args.backward_s, args.microbatch, args.slower, args.busy_dir, args.pad_to)
    except ValueError as error:
        parser.error(str(error))
    return standin, args.command


def main(argv: list[str] | None = None) -> int:
    standin, command = parse(sys.argv[1:] if argv is None else argv)
    inject(standin)
    from agora_client.cli import main as agora

    return agora(command)


if __name__ == "__main__":
    sys.exit(main())
