"""How long an honest worker's compute waits in the trainer's escrow (agora_client/trainer/escrow.py).

A stage's spot checks judge nothing until they are calibrated, so every FLOP an honest worker serves before then
waits until the calibration vouches for it. This bench runs the trainer's real balancer, SpotChecker, ReceiptBook
and Escrow on a simulated clock over in-process replicas of one stage (honest workers whose weights drift apart by
``--drift``, as SPARTA leaves them), a microbatch (a forward and a backward) every 1/``--rps`` s, for ``--seconds``,
with the run config's spot checks (``--preset``; ``--fraction`` overrides its share). It prints, per kind, when
the stage became verifiable, and ends with one JSON line:

- ``honest_escrow_release_s``: the longest any honest compute waited before it was released;
- ``time_to_verifiable_s``: when the later of forward and backward became judged;
- ``honest_paid_ratio``: what the receipts let the monitor pay over what the workers served (the rest is held
  in windows not closed yet, or forfeited: with honest workers, nothing should be);
- ``forfeited_flops``: honest compute lost (target 0).

``measure()`` gives the same figures to another script (bench/gaming.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_client.config import SpotCheckConfig, load_config  # noqa: E402
from agora_client.discovery.roster import WorkerRecord  # noqa: E402
from agora_client.trainer.balancer import Router  # noqa: E402
from agora_client.trainer.escrow import Escrow  # noqa: E402
from agora_client.trainer.receipts import ReceiptBook  # noqa: E402
from agora_client.trainer.spotcheck import KINDS, SpotChecker  # noqa: E402

STAGE = "body1"
DIM = 32


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Replicas:
    """A stage client over replicas: each worker answers with its own drifted copy of one weight matrix, and a liar
    with random values of the right shape and scale."""

    def __init__(self, weights: dict[str, torch.Tensor], liars: frozenset[str] = frozenset()):
        self.weights, self.liars = weights, liars

    def _answer(self, worker: WorkerRecord, honest: torch.Tensor) -> list[torch.Tensor]:
        return [torch.randn_like(honest) * honest.std() if worker.uid in self.liars else honest]

    def forward(self, worker: WorkerRecord, inputs):
        return self._answer(worker, inputs[0] @ self.weights[worker.uid])

    def backward(self, worker: WorkerRecord, inputs, grad_outputs):
        return self._answer(worker, grad_outputs[0] @ self.weights[worker.uid].T)


def measure(
    config: SpotCheckConfig,
    *,
    workers: int = 3,
    rps: float = 2.0,
    seconds: float = 1800.0,
    drift: float = 0.05,
    liars: int = 0,
    references: int = 0,
) -> dict:
    """Escrow on one simulated stage of ``workers`` honest workers, ``liars`` lying ones and ``references``
    reference workers (the operator's, named in ``config.reference_workers``); the figures the module's docstring
    names, and what each worker served and was paid (``served``, ``paid``: peer id -> FLOPs)."""
    torch.manual_seed(0)
    base = torch.randn(DIM, DIM)
    roles = [("honest", workers), ("liar", liars), ("reference", references)]
    peers = [f"{role}{i}" for role, count in roles for i in range(count)]
    records = [WorkerRecord(uid=f"{STAGE}.0.{peer}", peer_id=peer, stage=STAGE) for peer in peers]
    config = config.model_copy(update={"reference_workers": [p for p in peers if p.startswith("reference")]})
    router = Router([STAGE])
    router.update_roster(records)
    weights = {r.uid: base + drift * torch.randn(DIM, DIM) for r in records}
    client = _Replicas(weights, frozenset(r.uid for r in records if r.peer_id.startswith("liar")))
    clock, verifiable_at = _Clock(), {}
    book = ReceiptBook(load_config("tiny").model, Escrow(config, clock))

    def on_standing(stage: str, kind: str, standing) -> None:
        if standing.state == "verifiable":
            verifiable_at.setdefault(kind, clock.now)

    checker = SpotChecker(config, router, {STAGE: client}, receipts=book, on_standing=on_standing, rng=random.Random(0))
    while clock.now < seconds:
        inputs = (torch.randn(4, DIM), torch.zeros(4, 8, dtype=torch.long))
        grads = (torch.randn(4, DIM),)
        for kind in KINDS:
            lease = router[STAGE].choose(kind, 4.0)
            call = client.forward(lease.worker, inputs) if kind == "forward" else None
            outputs = call if call is not None else client.backward(lease.worker, inputs, grads)
            router[STAGE].report_success(lease)
            book.count(STAGE, kind, lease.worker.peer_id, inputs)
            checker.review(STAGE, kind, 4.0, lease.worker, inputs, grads if kind == "backward" else (), outputs)
        clock.now += 1.0 / rps
    counts = book.receipt("bench", "ticket", now=clock.now).served
    honest = [c for peer, c in counts.items() if peer.startswith("honest")]
    return {
        "honest_escrow_release_s": book.escrow.longest_release_s,
        "time_to_verifiable_s": max(verifiable_at.values()) if len(verifiable_at) == len(KINDS) else None,
        "honest_paid_ratio": sum(c.payable_flops for c in honest) / sum(c.flops for c in honest),
        "forfeited_flops": sum(c.forfeited_flops for c in honest),
        "checks": checker.stats.checks,
        "served": {peer: c.flops for peer, c in counts.items()},
        "paid": {peer: c.payable_flops for peer, c in counts.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="run config whose spot_checks are used (default tiny)")
    parser.add_argument("--fraction", type=float, help="spot-check share, instead of the preset's")
    parser.add_argument("--workers", type=int, default=3, help="honest workers of the stage (3: the fewest judged)")
    parser.add_argument("--rps", type=float, default=2.0, help="microbatches a second through the stage")
    parser.add_argument("--seconds", type=float, default=1800.0, help="simulated seconds of training")
    parser.add_argument("--drift", type=float, default=0.05, help="how far apart the honest replicas' weights are")
    args = parser.parse_args()
    config = load_config(args.preset).spot_checks
    if args.fraction is not None:
        config = config.model_copy(update={"fraction": args.fraction})
    print(
        f"{args.workers} honest workers, {args.rps:g} microbatches/s, spot checks on {config.fraction:.0%}, "
        f"{config.min_samples} honest distances to calibrate, escrow windows of {config.escrow_window_s:g} s, "
        f"held at most {config.escrow_hold_s:g} s; {args.seconds:g} simulated seconds",
        flush=True,
    )
    figures = measure(config, workers=args.workers, rps=args.rps, seconds=args.seconds, drift=args.drift)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
