"""Cost of a worker's request guards against the stage work they protect, side by side in one process.

For one tiny body1 microbatch (8 x 128 tokens), alternating rounds time: the stage's forward; the
guards a forward request passes (ticket check, header check before deserialization, schema and value
checks after); a backward by recomputation; and the guards of a backward request. Medians per request,
and the ratio guards / work. A first-seen ticket (signature verified) is timed apart from a remembered one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text
from agora_client.config import load_config
from agora_client.model import build_stage
from agora_client.serving.ticket_gate import TicketGate
from agora_client.serving.validation import MagnitudeGuard, check_descriptors, validate_inputs

CALLER = "12D3KooWbenchcaller"


def timed(function, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config("tiny")
    module = build_stage(config.model, "body1", seed=0)
    batch = config.optim.microbatch_size
    hidden, tokens = module.example_inputs(batch)
    hidden = torch.randn_like(hidden)
    grads = torch.randn_like(hidden) * 1e-3
    schema = tuple(BatchTensorDescriptor.from_tensor(t) for t in module.example_inputs(1))
    backward_schema = (*schema, schema[0])
    key = generate_signing_key()
    gate = TicketGate(public_key_text(key), roles=("trainer",))
    forward_protos = [serialize_torch_tensor(t) for t in (hidden, tokens)]
    backward_protos = [*forward_protos, serialize_torch_tensor(grads)]
    magnitudes = {"forward": MagnitudeGuard("forward"), "backward": MagnitudeGuard("backward")}
    ticket = issue_ticket(
        key, identity="op", peer_id=CALLER, stage="trainer", slot=0, ttl_s=3600, role="trainer"
    ).encode()

    def fresh_ticket() -> None:
        gate.check(
            issue_ticket(
                key, identity="op", peer_id=CALLER, stage="trainer", slot=0, ttl_s=3600, role="trainer"
            ).encode(),
            CALLER,
        )

    def guards(kind: str, protos, tensors, flat_schema) -> None:
        gate.check(ticket, CALLER)
        check_descriptors(protos, flat_schema, batch)
        validate_inputs(tensors, flat_schema, vocab_size=config.model.vocab_size, max_batch_size=batch)
        magnitudes[kind].check(tensors)

    def forward() -> None:
        with torch.no_grad():
            module(hidden, tokens)

    def backward() -> None:
        leaf = hidden.clone().requires_grad_(True)
        torch.autograd.backward(module(leaf, tokens), grads)

    figures: dict[str, list[float]] = {
        name: [] for name in ("forward", "forward_guards", "backward", "backward_guards", "ticket_first_seen")
    }
    for round_no in range(args.rounds):
        print(f"round {round_no + 1}/{args.rounds}", flush=True)
        figures["forward"].append(timed(forward, 5))
        figures["forward_guards"].append(timed(lambda: guards("forward", forward_protos, (hidden, tokens), schema), 20))
        figures["backward"].append(timed(backward, 3))
        figures["backward_guards"].append(
            timed(lambda: guards("backward", backward_protos, (hidden, tokens, grads), backward_schema), 20)
        )
        figures["ticket_first_seen"].append(timed(fresh_ticket, 20))
    medians = {name: statistics.median(values) * 1e3 for name, values in figures.items()}
    result = {
        "forward_ms": round(medians["forward"], 3),
        "forward_guards_ms": round(medians["forward_guards"], 3),
        "backward_ms": round(medians["backward"], 3),
        "backward_guards_ms": round(medians["backward_guards"], 3),
        "ticket_first_seen_ms": round(medians["ticket_first_seen"], 3),
        "forward_guard_ratio": round(medians["forward_guards"] / medians["forward"], 4),
        "backward_guard_ratio": round(medians["backward_guards"] / medians["backward"], 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
