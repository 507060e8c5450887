"""bench/utilization.py's stage stand-in (bench/_utilization_standin.py): each request takes its formula's time, one
request at a time, answers tensors of the stage's shapes, and reaches the worker node only by injection."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import agora_client.worker.node as node
from agora_client.config import load_config
from agora_client.model.memory import flops_per_microbatch
from agora_client.worker.prepared_stage import PreparedStage, prepare_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _utilization_standin import (  # noqa: E402
    PADDING,
    StandIn,
    StandInBackend,
    inject,
    parse,
    stage_seconds,
    standin_backend,
)

CONFIG = load_config("tiny")
MICROBATCH = 4
FORWARD_S, BACKWARD_S = 0.05, 0.15


@pytest.fixture(scope="module")
def body1() -> PreparedStage:
    return prepare_stage(CONFIG, "body1", "cpu", seed=0, seeded_weights=True)


def backend(standin: StandIn, prepared: PreparedStage, counted: list[tuple[int, bool]]) -> StandInBackend:
    """The stand-in as the worker node builds it; ``counted`` gets (samples, whether the stage lock was held)."""
    noop = lambda *_: None  # noqa: E731
    lock = threading.Lock()
    return standin_backend(standin)(
        "body1.0.0",
        prepared.module,
        lock=lock,
        on_samples=lambda samples: counted.append((samples, lock.locked())),
        device=torch.device("cpu"),
        mixed_precision=False,
        on_forward=noop,
        on_backward=noop,
        on_unhealthy=noop,
        args_schema=prepared.args_schema,
        outputs_schema=prepared.outputs_schema,
        min_batch_size=1,
        max_batch_size=8 * MICROBATCH,
    )


def inputs(prepared: PreparedStage, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    boundary, tokens = prepared.module.example_inputs(samples)
    return torch.randn(boundary.shape), torch.randint(0, CONFIG.model.vocab_size, tokens.shape)


def intervals(path: Path) -> list[tuple[str, float, float, float, int]]:
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    return [(kind, float(a), float(s), float(e), int(n)) for kind, a, s, e, n in rows]


def test_seconds_per_microbatch_follow_the_formula() -> None:
    flops = flops_per_microbatch(load_config("8b").model, "body1", 1)
    seconds = stage_seconds(flops, 165e12, 0.4, 0.5)
    assert seconds == pytest.approx(flops / (165e12 * 0.4) / 0.5)
    assert 0.4 < seconds * 0.5 < 0.6  # describe's "0.49 s compute" of a body at 40% of a 4090
    with pytest.raises(ValueError):
        stage_seconds(flops, 165e12, 0.4, 0)


def test_each_request_takes_its_share_of_the_microbatch_time(body1: PreparedStage, tmp_path: Path) -> None:
    standin = StandIn(FORWARD_S, BACKWARD_S, MICROBATCH, slower=2.0, busy_dir=tmp_path)
    counted: list[tuple[int, bool]] = []
    served = backend(standin, body1, counted)
    boundary, tokens = inputs(body1, 2 * MICROBATCH)  # two microbatches' worth: twice the time
    (out,) = served.forward(boundary, tokens)
    assert out.shape == boundary.shape and out.dtype == torch.float32
    grads = served.backward(boundary, tokens, torch.randn(out.shape))
    assert [g.shape for g in grads] == [boundary.shape, tokens.shape]
    assert counted == [(2 * MICROBATCH, True)]  # the epoch counts the backward's samples under the stage lock
    (forward, backward) = intervals(tmp_path / "body1.0.0.tsv")
    for (kind, _, started, ended, samples), per_microbatch in zip(
        (forward, backward), (FORWARD_S, BACKWARD_S), strict=True
    ):
        expected = per_microbatch * 2.0 * samples / MICROBATCH
        assert samples == 2 * MICROBATCH
        assert expected <= ended - started < expected + 0.5, kind  # sleeps at least its time; the bound is generous


def test_never_two_requests_at_once(body1: PreparedStage, tmp_path: Path) -> None:
    served = backend(StandIn(FORWARD_S, BACKWARD_S, MICROBATCH, busy_dir=tmp_path), body1, [])
    boundary, tokens = inputs(body1, MICROBATCH)
    threads = [threading.Thread(target=lambda: [served.forward(boundary, tokens) for _ in range(3)]) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    spans = sorted((started, ended) for _, _, started, ended, _ in intervals(tmp_path / "body1.0.0.tsv"))
    assert len(spans) == 6
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))
    waited = [started - arrived for _, arrived, started, _, _ in intervals(tmp_path / "body1.0.0.tsv")]
    assert max(waited) >= FORWARD_S * 0.9  # the other thread's request held the lock meanwhile


def test_injection_pads_the_stage_and_replaces_the_backend(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(node, "StageBackend", node.StageBackend)  # restored after the test
    monkeypatch.setattr(node, "prepare_stage", node.prepare_stage)
    pad_to = 3_000_000
    injected = inject(StandIn(FORWARD_S, BACKWARD_S, MICROBATCH, busy_dir=tmp_path / "busy", pad_to=pad_to))
    assert node.StageBackend is injected and (tmp_path / "busy").is_dir()
    prepared = node.prepare_stage(CONFIG, "body1", "cpu", seed=0, seeded_weights=True)
    trainable = [p for p in prepared.module.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == pad_to
    assert any(name == PADDING for name, _ in prepared.module.named_parameters())


def test_bad_flags_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["--forward-s", "0", "--backward-s", "1", "--microbatch", "2", "worker"])
    assert exit_info.value.code == 2
    assert "times must be positive" in capsys.readouterr().err
    standin, command = parse(["--forward-s", "1", "--backward-s", "2", "--microbatch", "3", "worker", "--stage", "x"])
    assert standin.request_seconds("backward", 6) == pytest.approx(4.0) and command == ["worker", "--stage", "x"]


def test_sleeps_rather_than_spins(body1: PreparedStage) -> None:
    served = backend(StandIn(0.3, 0.3, MICROBATCH), body1, [])
    boundary, tokens = inputs(body1, MICROBATCH)
    cpu, wall = time.process_time(), time.perf_counter()
    served.forward(boundary, tokens)
    assert time.perf_counter() - wall >= 0.3
    assert time.process_time() - cpu < 0.25  # the shared cores stay the other processes'
