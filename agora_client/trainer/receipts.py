"""Receipts: the trainer's own count of the work each worker served it, signed and published for the monitor.

A worker's metrics record says how many FLOPs it processed, and nothing bounds what a modified worker
claims. The trainer saw every request it sent and every answer that came back, so it counts them per
worker (spot-check re-runs included: they cost the worker the same) and prices them with the formula the
worker uses (``monitor.flops.request_flops``). It stores the counts, signed with its own key and carrying
its trainer ticket, under ``agora.receipts``; the monitor credits a worker's compute as the lesser of its
claim and its receipts (``monitor/receipts.py``). With spot checks on, work served on a stage they cannot judge
yet is held in escrow (``trainer/escrow.py``): the receipt says how much, and how much was forfeited.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from agora_client.config import ModelConfig
from agora_client.discovery.signed_records import RECEIPTS_KEY, Receipt, ServedCounts
from agora_client.engine.records import RSASignatureValidator
from agora_client.monitor.flops import request_flops
from agora_client.monitor.signatures import owner_subkey
from agora_client.trainer.escrow import Escrow

RECEIPT_TTL_S = 600.0  # the monitor scrapes far more often; a stopped trainer's receipts go after this


@dataclass
class _Served:
    stage: str
    forwards: int = 0
    backwards: int = 0
    flops: float = 0.0


class ReceiptBook:
    """Per worker peer id, what it served this trainer process; thread-safe (every pipeline thread counts)."""

    def __init__(self, model: ModelConfig, escrow: Escrow | None = None):
        self.run_id = secrets.token_hex(8)
        self.escrow = escrow  # None: every request is paid as served (no spot checks to judge it)
        self._lock = threading.Lock()
        self._served: dict[str, _Served] = {}

        @lru_cache(maxsize=256)
        def flops(stage: str, kind: str, batch: int, seq: int) -> int:
            return request_flops(model, stage, kind, batch, seq)

        self._flops = flops

    def count(self, stage: str, kind: str, peer_id: str, inputs: Sequence[torch.Tensor]) -> None:
        """One answered request of ``kind`` on ``stage``; ``inputs`` as sent (the head's first one is the [batch,
        seq] token ids, every other stage's the boundary activations, then the token ids)."""
        batch, seq = inputs[0 if stage == "head" else 1].shape
        cost = self._flops(stage, kind, int(batch), int(seq))
        with self._lock:
            served = self._served.setdefault(peer_id, _Served(stage))
            served.stage = stage
            served.flops += cost
            if kind == "forward":
                served.forwards += 1
            else:
                served.backwards += 1
        if self.escrow is not None:
            self.escrow.receive(stage, kind, peer_id, cost)

    def receipt(self, trainer: str, ticket: str, now: float | None = None) -> Receipt:
        with self._lock:
            served = {peer_id: self._counts(peer_id, s) for peer_id, s in self._served.items()}
        return Receipt(
            trainer=trainer, ticket=ticket, run_id=self.run_id, served=served, ts=time.time() if now is None else now
        )

    def _counts(self, peer_id: str, served: _Served) -> ServedCounts:
        counts = ServedCounts(
            stage=served.stage, forwards=served.forwards, backwards=served.backwards, flops=served.flops
        )
        if self.escrow is None:
            return counts
        tally = self.escrow.tally(peer_id)
        return counts.model_copy(
            update={
                "held_flops": max(0.0, tally.held_flops),  # sums of floats: never a rounding error below zero
                "forfeited_flops": max(0.0, tally.forfeited_flops),
                "disputed_windows": tally.disputed_windows,
            }
        )


def publish_receipt(dht: DHT, receipt: Receipt, validator: RSASignatureValidator, ttl_s: float = RECEIPT_TTL_S) -> bool:
    """Store the receipt signed by the trainer's key (replacing its previous one); True if a DHT node accepted it."""
    return bool(
        dht.store(
            RECEIPTS_KEY,
            receipt.model_dump(mode="json"),
            expiration_time=get_dht_time() + ttl_s,
            subkey=owner_subkey(receipt.subkey_name, validator),
        )
    )


def publish_every(period_s: float, publish: Callable[[], None], stop: threading.Event) -> threading.Thread:
    """Publish now and then every ``period_s`` until ``stop``, and once more on the way out (the last counts)."""

    def loop() -> None:
        while True:
            publish()
            if stop.wait(period_s):
                publish()
                return

    thread = threading.Thread(target=loop, name="receipts", daemon=True)
    thread.start()
    return thread
