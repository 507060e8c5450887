"""The faulty workers of tests and benches (tests/faulty_worker.py) live outside the production CLI: the fault
flags are tests/faulty_worker.py's own, its backend reaches the worker node by injection, and it lies and
waits exactly as the tests expect."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import agora_client.worker.node as node
from agora_client import runtime
from agora_client.config import load_config
from agora_client.serving.backend import StageBackend
from agora_client.worker import main as worker_main
from agora_client.worker.metrics import WorkerMetrics
from agora_client.worker.prepared_stage import PreparedStage, prepare_stage
from tests import faulty_worker
from tests.faulty_worker import Faults, FaultyBackend, faulty, faulty_backend, inject, parse

CONFIG = load_config("tiny")
FAULT_FLAGS = (["--lie"], ["--slowdown", "1"], ["--slower", "2"], ["--rotate-run-id"])


@pytest.fixture(scope="module")
def body1() -> PreparedStage:
    return prepare_stage(CONFIG, "body1", "cpu", seed=0, seeded_weights=True)


def backend(cls: type[StageBackend], prepared: PreparedStage) -> StageBackend:
    noop = lambda *_: None  # noqa: E731
    return cls(
        "body1.0.0",
        prepared.module,
        lock=threading.Lock(),
        on_samples=noop,
        device=torch.device("cpu"),
        mixed_precision=False,
        on_forward=noop,
        on_backward=noop,
        on_unhealthy=noop,
        args_schema=prepared.args_schema,
        outputs_schema=prepared.outputs_schema,
        min_batch_size=1,
        max_batch_size=8,
    )


def inputs(prepared: PreparedStage) -> tuple[torch.Tensor, torch.Tensor]:
    boundary, tokens = prepared.module.example_inputs(2)
    return torch.randn(boundary.shape), torch.randint(0, CONFIG.model.vocab_size, tokens.shape)


@pytest.mark.parametrize("command", [worker_main, runtime], ids=["worker", "runtime"])
@pytest.mark.parametrize("flags", FAULT_FLAGS, ids=lambda flags: flags[0])
def test_the_production_cli_has_no_fault_flags(command, flags: list[str], capsys) -> None:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    required = ["--stage", "body1", "--seeds", "x"] if command is worker_main else ["--swarm", "http://x"]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*required, *flags])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {' '.join(flags)}" in capsys.readouterr().err
    assert flags[0] not in parser.format_help()


def test_injection_replaces_the_backend_the_worker_node_builds(monkeypatch) -> None:
    monkeypatch.setattr(node, "StageBackend", node.StageBackend)  # restored after the test
    injected = inject(Faults(lie=True, slowdown_s=2.0))
    assert node.StageBackend is injected and issubclass(injected, FaultyBackend)
    assert injected.faults == Faults(lie=True, slowdown_s=2.0)
    # WorkerNode builds its backend by this global name: a refactor that moves it must move the injection too
    methods = [f for f in vars(node.WorkerNode).values() if inspect.isfunction(f)]
    assert any("StageBackend" in method.__code__.co_names for method in methods)


def test_the_presence_cheat_publishes_a_fresh_run_id_in_every_record(monkeypatch) -> None:
    monkeypatch.setattr(node, "StageBackend", node.StageBackend)  # both restored after the test
    monkeypatch.setattr(WorkerMetrics, "snapshot", WorkerMetrics.snapshot)
    honest = WorkerMetrics(load_config("tiny").model, "body1", peer_id="p", identity="alice", ticket="t")
    honest.set_phase("active")
    assert honest.snapshot().run_id == honest.snapshot().run_id
    inject(Faults(rotate_run_id=True))
    cheat = WorkerMetrics(load_config("tiny").model, "body1", peer_id="p", identity="alice", ticket="t")
    cheat.set_phase("active")
    run_ids = {cheat.snapshot().run_id for _ in range(3)}
    assert len(run_ids) == 3 and cheat.snapshot().active_seconds >= 0


def test_a_lying_backend_answers_random_values_of_the_right_shape_and_scale(body1: PreparedStage) -> None:
    boundary, tokens = inputs(body1)
    honest, liar = backend(StageBackend, body1), backend(faulty_backend(Faults(lie=True)), body1)
    (truth,) = honest.forward(boundary, tokens)
    (lie,) = liar.forward(boundary, tokens)
    assert lie.shape == truth.shape and lie.dtype == truth.dtype
    assert not torch.allclose(lie, truth)
    assert 0.5 < float(lie.pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()) < 2.0

    grad_output = torch.randn_like(truth)
    true_grads = honest.backward(boundary, tokens, grad_output)
    lying_grads = liar.backward(boundary, tokens, grad_output)
    assert lying_grads[0].shape == true_grads[0].shape and not torch.allclose(lying_grads[0], true_grads[0])
    assert torch.equal(lying_grads[1], true_grads[1])  # not floats: passed on as computed


def test_a_slow_backend_sleeps_its_fixed_delay_plus_the_extra_time_of_a_slower_gpu(monkeypatch, body1) -> None:
    slept: list[float] = []
    clock = iter([10.0, 10.5])  # the request's own time: 0.5 s
    monkeypatch.setattr(faulty_worker, "time", SimpleNamespace(perf_counter=lambda: next(clock), sleep=slept.append))
    slow = backend(faulty_backend(Faults(slowdown_s=1.0, slower=3.0)), body1)
    (outputs,) = slow.forward(*inputs(body1))
    assert slept == [1.0 + 2 * 0.5]
    assert outputs.is_floating_point()


def test_fault_flags_come_before_the_agora_command_and_are_checked(capsys) -> None:
    assert faulty(slowdown=12) == [sys.executable, str(Path(faulty_worker.__file__).resolve()), "--slowdown", "12"]
    assert parse([*faulty(lie=True, slower=2.5)[2:], "worker", "--stage", "body1"]) == (
        Faults(lie=True, slower=2.5),
        ["worker", "--stage", "body1"],
    )
    assert parse([*faulty(rotate_run_id=True)[2:], "runtime"]) == (Faults(rotate_run_id=True), ["runtime"])
    for argv, says in [
        (["--slowdown", "-1", "worker"], "--slowdown must be >= 0 and --slower >= 1 (got -1, 1)"),
        (["--slower", "0.5", "worker"], "--slowdown must be >= 0 and --slower >= 1 (got 0, 0.5)"),
        (["--lie"], "give the agora command to run after the fault flags"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_the_faulty_program_runs_the_agora_cli_from_any_directory(tmp_path: Path) -> None:
    done = subprocess.run(
        [*faulty(lie=True), "worker", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: agora worker" in done.stdout and "--lie" not in done.stdout
