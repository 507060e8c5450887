"""The engine boundary's contract with the installed hivemind (agora_client/engine/).

Every hivemind or libp2p internal the engine relies on is listed here and checked against the installed
version: the attribute exists, the method takes the parameters the engine passes or overrides, the
source still does what the engine's comment says, the layouts decode and the error texts still match.
An upgrade that moves one fails here, naming it.

The rule the last tests keep (read by tests/engine_boundary.py): outside agora_client/engine/ the project uses
hivemind's public API only; everything else of hivemind or libp2p, with or without an underscore, lives in
engine/, behind a small function or subclass listed in MEMBERS.

- hivemind has no ``__all__``. Its public objects are what its package ``__init__`` files import (hivemind/__init__.py
  and every subpackage's re-exports), the classes and functions its API pages document (docs/modules/*.rst of
  1.1.12, and ``choose_ip_address`` of docs/user/dht.md: ``DOCUMENTED``), the seams DESIGN.md builds on
  (ConnectionHandler, ProgressTracker, TokenAuthorizerBase; ModuleBackend, Server, DecentralizedAverager are
  exported anyway), and the types that the signatures and the public attributes of those take or hold.
  A module is public when it is a package or defines a public object.
- A member of a public class is public when its page lists it (a page with an explicit member list names the only
  public methods, the documented hooks), or else when it has no leading underscore, is not excluded by the page,
  and is not a class-level data attribute without a doc-comment (autodoc renders none of those: DHTProtocol's
  ``serializer`` and ``RESERVED_SUBKEYS`` are internals). Fields of dataclasses and members of enums are public.
- Names are told apart by what they refer to, not by how they are spelled, so no name is exempt: an import is
  resolved to the object it binds; ``x.name`` is resolved through what ``x`` is (a module, a class, ``self`` of a
  class and its bases, a parameter or variable by its annotation or the class it was built from) to the class
  that defines ``name``; it is hivemind's when that class is, whatever the project calls its own attributes.
  Only where ``x`` cannot be read from the source does the name decide: a private ``x._name`` is hivemind's when
  hivemind defines ``_name`` and the project's own code does not (an override of a hivemind member counts as
  hivemind's name, not the project's).
- A class outside engine/ that subclasses a hivemind class overrides (by a method, a class attribute or
  ``self.<name> =``) only public members of its hivemind bases: the documented hooks.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import multiprocessing as mp
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import AllreduceException, TensorPartContainer, TensorPartReducer
from hivemind.compression import NoCompression, serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import RoutingTable
from hivemind.dht.schema import SchemaValidator
from hivemind.moe.client.expert import get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.moe.server.server import Server
from hivemind.optim import progress_tracker
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.servicer import ServicerBase
from hivemind.proto import crypto_pb2, runtime_pb2
from hivemind.utils import logging as hivemind_logging
from hivemind.utils.asyncio import asingle
from hivemind.utils.crypto import RSAPrivateKey

import agora_client.averaging.sparta as sparta
import agora_client.serving.backend as backend
import agora_client.serving.server as server
from agora_client.engine import averaging as engine_averaging
from agora_client.engine.averaging import RoundAverager, ScreenedAllReduce, found_no_group, parts_by_reducer
from agora_client.engine.identity import key_from_der, use_as_process_key
from agora_client.engine.libp2p_errors import DaemonFailure, daemon_failure, stream_ended_empty
from agora_client.engine.serving import CheckedConnectionHandler, HostedServer
from agora_client.engine.uniform8bit import Uniform8Bit
from tests.engine_boundary import boundary_violations, outside_engine, project_files

REPO = Path(__file__).resolve().parents[1]
HIVEMIND = Path(hivemind.__file__).parent


@dataclass(frozen=True)
class Member:
    """A method or attribute of ``owner`` the engine calls, overrides or reads; ``params``: the method's
    parameter names, in order (None: an attribute, or a method whose parameters the engine does not depend on)."""

    owner: Any
    name: str
    params: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{getattr(self.owner, '__qualname__', self.owner)}.{self.name}"


@dataclass(frozen=True)
class SourceFact:
    """Text the source of ``owner.name`` must hold: the upstream behaviour an engine seam depends on."""

    owner: Any
    name: str
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.owner.__qualname__}.{self.name} ({self.why})"


MEMBERS = (
    # averaging.py
    Member(AllReduceRunner, "_generate_input_for_peer", ("self", "peer_index")),
    Member(AllReduceRunner, "_get_peer_stub", ("self", "peer")),
    Member(AllReduceRunner, "rpc_aggregate_part", ("self", "stream", "context")),
    Member(TensorPartReducer, "accumulate_part", ("self", "sender_index", "part_index", "tensor_part", "weight")),
    Member(TensorPartReducer, "__init__", ("self", "part_shapes", "num_senders")),
    Member(DecentralizedAverager, "_aggregate_with_group", ("self", "group_info", "min_vector_size", "kwargs")),
    Member(DecentralizedAverager, "_run_allreduce_inplace_", ("self", "tensors", "group_info", "group_id", "kwargs")),
    Member(DecentralizedAverager, "rpc_join_group", ("self", "request", "context")),
    Member(DecentralizedAverager, "_shutdown", ("self", "timeout")),
    Member(DecentralizedAverager, "remove_p2p_handlers", ("self", "p2p", "namespace")),
    Member(DecentralizedAverager, "set_group_bits", ("self", "group_bits", "wait")),
    Member(DecentralizedAverager, "serializer"),
    Member(mp.Process, "_Popen"),
    Member(mp.get_context("fork").Process, "_start_method"),
    # serving.py
    Member(ServicerBase, "_get_handle_name", ("namespace", "method_name")),
    Member(ConnectionHandler, "_process_inputs", ("self", "inputs", "pool", "schema")),
    # identity.py
    Member(RSAPrivateKey, "_process_wide_key"),
    Member(RSAPrivateKey, "_process_wide_key_lock"),
    Member(RSAPrivateKey, "__setstate__", ("self", "state")),
    # uniform8bit.py puts its NumPy-2.4-safe UNIFORM_8BIT decoder in the table every received part is decoded by
    Member(serialization, "_BASE_COMPRESSION_TYPES"),
    # expert_calls.py
    Member(control, "DEFAULT_MAX_MSG_SIZE"),
    Member(control, "MAX_UNARY_PAYLOAD_SIZE"),
    Member(RemoteExpertWorker, "run_coroutine"),
    # identity.py: libp2p's crypto protobuf (identity files, public keys of peer ids)
    Member(crypto_pb2, "PrivateKey"),
    Member(crypto_pb2, "PublicKey"),
    Member(crypto_pb2.KeyType, "RSA"),
    # records.py
    Member(RSASignatureValidator, "__init__", ("self", "private_key")),
    Member(RSASignatureValidator, "PUBLIC_KEY_REGEX"),
    Member(RSASignatureValidator, "local_public_key"),
    Member(SchemaValidator, "__init__", ("self", "schema", "allow_extra_keys", "prefix")),
    Member(progress_tracker, "TrainingProgressSchema"),
    Member(DHTProtocol, "RESERVED_SUBKEYS"),
    Member(DHTProtocol, "serializer"),
    # logs.py
    Member(hivemind_logging, "use_hivemind_log_handler", ("where",)),
)

SOURCE_FACTS = (
    SourceFact(
        AllReduceRunner,
        "__init__",
        "self.tensor_part_reducer = TensorPartReducer(",
        "the reducer ScreenedAllReduce replaces is built by name in __init__",
    ),
    SourceFact(AllReduceRunner, "__init__", "self.parts_for_local_averaging = ", "the parts this peer reduces"),
    SourceFact(AllReduceRunner, "__init__", "self.tensor_part_container = TensorPartContainer(", "the part layout"),
    SourceFact(AllReduceRunner, "__init__", "self.sender_peer_ids = ", "reducer sender indices name these peers"),
    SourceFact(TensorPartReducer, "__init__", "self.sender_failed_after = ", "lonely_elements reads it"),
    SourceFact(
        DecentralizedAverager,
        "_run_allreduce_inplace_",
        "self._running_groups[group_id].set_result(runner)",
        "the engine's copy registers its runner the same way",
    ),
    SourceFact(DecentralizedAverager, "_run_allreduce_inplace_", "p2p=self._p2p", "the runner's p2p"),
    SourceFact(
        DecentralizedAverager,
        "step",
        "self.serializer.dumps([self.bandwidth, self.mode.value, user_data_for_gather])",
        "RoundAverager.user_data decodes this gather layout",
    ),
    SourceFact(
        DecentralizedAverager,
        "_aggregate_with_group",
        "await self._run_allreduce_inplace_(",
        "the group is averaged through the engine's override",
    ),
    SourceFact(
        DecentralizedAverager,
        "_aggregate_with_group",
        "download_bandwidths = [",
        "announce_bandwidth: the gathered bandwidths size each peer's share of the parts",
    ),
    SourceFact(
        DecentralizedAverager,
        "_step",
        "**self.allreduce_kwargs,",
        "group_timeouts: the sender and reducer timeouts reach _aggregate_with_group as keyword arguments",
    ),
    SourceFact(
        DecentralizedAverager,
        "_step",
        "timeout=self._allreduce_timeout",
        "group_timeouts: with allreduce_timeout None, the group's own bound is the only one",
    ),
    SourceFact(DecentralizedAverager, "_step", "could not find a group", "found_no_group reads this text"),
    SourceFact(
        DecentralizedAverager,
        "_shutdown",
        "group.finalize(cancel=True)",
        "RoundAverager._shutdown replaces upstream's finalize() on a future; a fixed upstream makes it unneeded",
    ),
    SourceFact(
        DecentralizedAverager,
        "get_tensors",
        "with self.lock_averaged_tensors:\n            yield self._averaged_tensors",
        "RoundAverager.tensors_unless takes the same lock, with a bounded wait, and yields the same tensors",
    ),
    SourceFact(
        DecentralizedAverager,
        "_register_allreduce_group",
        "self._running_groups[group_info.group_id] = asyncio.Future()",
        "RoundAverager._shutdown reads futures of runners there",
    ),
    SourceFact(DecentralizedAverager, "__init__", "self.schema_hash = ", "RoundAverager folds its layout into it"),
    SourceFact(
        DecentralizedAverager,
        "step",
        "step.attach(*future_for_init.result())",
        "a step waits without a bound for the process to take it: begin_step sends none after the stop",
    ),
    SourceFact(
        DecentralizedAverager,
        "_run_internal",
        'if method == "_shutdown":\n                    await task\n                    break',
        "the process reads no call sent after its stop: begin_step and set_round send none",
    ),
    SourceFact(
        DecentralizedAverager, "_run_internal", "self._matchmaking = Matchmaking(", "set_round reaches the matchmaking"
    ),
    SourceFact(
        DecentralizedAverager, "_run_internal", "self.schema_hash", "read after __init__, in the averager's process"
    ),
    SourceFact(Matchmaking, "rpc_join_group", "self.target_group_size", "a leader reads the target size at every join"),
    SourceFact(Matchmaking, "__init__", "self.group_key_manager = GroupKeyManager(", "set_group_bits reaches it"),
    SourceFact(Server, "__init__", "self.conn_handlers = [", "HostedServer replaces the handlers after __init__"),
    SourceFact(
        Server, "__init__", "self.dht_handler_thread = DHTHandlerThread(", "HostedServer replaces the announcer"
    ),
    SourceFact(Server, "run", "self.dht_handler_thread.start()", "the announcer is started like upstream's"),
    SourceFact(Server, "shutdown", "self.dht_handler_thread.stop.set()", "the announcer is stopped through .stop"),
    SourceFact(
        ConnectionHandler, "rpc_forward", "await self._process_inputs(", "every plain request reaches the check"
    ),
    SourceFact(ConnectionHandler, "rpc_forward_stream", "await self._process_inputs(", "every streamed request too"),
    SourceFact(RSAPrivateKey, "process_wide", "cls._process_wide_key", "use_as_process_key sets what it returns"),
    SourceFact(DHTNode, "create", "self.protocol = await DHTProtocol.create(", "known_peers reads the node's protocol"),
    SourceFact(DHTProtocol, "create", "self.routing_table = RoutingTable(", "known_peers counts its routing table"),
    SourceFact(RoutingTable, "__init__", "self.uid_to_peer_id", "known_peers counts the peers it maps"),
    SourceFact(
        progress_tracker.ProgressTracker,
        "pause_updates",
        "with self.lock_global_progress, self.performance_ema.pause():",
        "EpochController._stepping takes the same two, the stage lock between them",
    ),
)

_LOGGED_TEXTS = {  # RoundAverager quiets these partial-round messages: each must still be logged upstream
    "did not finish": HIVEMIND / "averaging" / "averager.py",
    "Reducer: received": HIVEMIND / "averaging" / "partition.py",
    "Averaging: received": HIVEMIND / "averaging" / "partition.py",
}


def contract_breaches(members=MEMBERS, facts=SOURCE_FACTS) -> list[str]:
    """Each internal of the contract that the installed hivemind no longer provides, named."""
    breaches = []
    for member in members:
        if not hasattr(member.owner, member.name):
            breaches.append(f"{member}: missing")
        elif member.params is not None:
            params = tuple(inspect.signature(getattr(member.owner, member.name)).parameters)
            if params != member.params:
                breaches.append(f"{member}: takes {params}, the engine expects {member.params}")
    for fact in facts:
        function = getattr(fact.owner, fact.name, None)
        if function is None:
            breaches.append(f"{fact}: missing")
        elif fact.text not in inspect.getsource(function):
            breaches.append(f"{fact}: no longer holds {fact.text!r}")
    return breaches


def test_every_internal_the_engine_uses_is_there() -> None:
    assert contract_breaches() == []


def test_a_missing_internal_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(AllReduceRunner, "_get_peer_stub")
    assert contract_breaches() == ["AllReduceRunner._get_peer_stub: missing"]


def test_a_changed_signature_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    async def accumulate_part(self, sender_index, part_index, tensor_part, weight=1.0, extra=None): ...

    monkeypatch.setattr(TensorPartReducer, "accumulate_part", accumulate_part)
    [breach] = contract_breaches()
    assert breach.startswith("TensorPartReducer.accumulate_part: takes (")
    assert "'extra'" in breach


def test_changed_upstream_behaviour_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def rpc_join_group(self, request, context):  # an upstream that stopped reading target_group_size
        yield None

    monkeypatch.setattr(Matchmaking, "rpc_join_group", rpc_join_group)
    assert contract_breaches() == [
        "Matchmaking.rpc_join_group (a leader reads the target size at every join): "
        "no longer holds 'self.target_group_size'"
    ]


def test_the_partial_round_messages_are_still_logged_upstream() -> None:
    assert set(_LOGGED_TEXTS) == set(engine_averaging._PARTIAL_ROUND_MESSAGES)
    for text, path in _LOGGED_TEXTS.items():
        assert text in path.read_text(), f"{path.name} no longer logs {text!r}"
    for name in engine_averaging._ROUND_LOGGERS:
        module = HIVEMIND.parent / Path(*name.split("."))
        assert module.with_suffix(".py").exists() or module.is_dir(), f"no hivemind logger {name}"


@pytest.mark.parametrize("compression", [NoCompression(), Uniform8Bit()], ids=["fp32", "int8"])
def test_the_part_layout_decodes(compression: Any) -> None:
    """parts_by_reducer walks a tensor in the order and sizes upstream's TensorPartContainer cut it (whose
    part_size_bytes counts bytes after compression)."""
    tensor = torch.arange(10_000, dtype=torch.float32)
    peers = [PeerID(bytes([0, 2, index, index])) for index in range(3)]
    container = TensorPartContainer(
        [tensor], peer_fractions=(0.5, 0.2, 0.3), part_size_bytes=4 * 700, compression=compression
    )
    decoded = list(parts_by_reducer(container, peers, tensor, tensor * 2))
    for index, peer in enumerate(peers):
        upstream = [part.view(-1) for part in container.get_raw_input_parts(index)]
        ours = [own for reducer, own, _ in decoded if reducer == peer]
        assert len(ours) == len(upstream) == container.num_parts_by_peer[index]
        assert all(torch.equal(a, b) for a, b in zip(ours, upstream, strict=True))
    assert all(torch.equal(change, own * 2) for _, own, change in decoded)
    assert sum(own.numel() for _, own, _ in decoded) == tensor.numel()


def test_the_reducer_keeps_what_lonely_elements_reads() -> None:
    async def fail_one_sender() -> TensorPartReducer:  # the reducer lives in an event loop, as in the averager
        reducer = TensorPartReducer((torch.Size([4]), torch.Size([6])), num_senders=3)
        reducer.on_sender_failed(1)  # before any part: sender 1 failed after part 0
        reducer.finished.set()
        return reducer

    reducer = asyncio.run(fail_one_sender())
    assert list(reducer.sender_failed_after) == [float("inf"), 0, float("inf")]
    assert reducer.part_shapes == (torch.Size([4]), torch.Size([6]))


def test_the_gather_layout_decodes() -> None:
    """RoundAverager.user_data reads what upstream's step serializes: [bandwidth, mode, serialized gather]."""
    serializer = DecentralizedAverager.serializer
    gathered = serializer.dumps([1e9, 0, serializer.dumps({"weight": 2.0, "ticket": "t"})])
    assert RoundAverager.user_data(gathered) == {"weight": 2.0, "ticket": "t"}
    assert RoundAverager.user_data(b"\x00not msgpack") is None


def test_a_key_from_its_der_bytes_is_the_same_key() -> None:
    key = RSAPrivateKey()
    again = key_from_der(key.to_bytes())
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    assert key.get_public_key().verify(b"message", again.sign(b"message"))


def test_the_process_key_is_the_one_set() -> None:
    code = (
        "from hivemind.utils.crypto import RSAPrivateKey\n"
        "from agora_client.engine.identity import use_as_process_key\n"
        "key = RSAPrivateKey(); use_as_process_key(key)\n"
        "assert RSAPrivateKey.process_wide() is key\n"
        "try:\n    use_as_process_key(RSAPrivateKey())\nexcept RuntimeError:\n    print('refused')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"  # a second key after the first is refused, not swapped in
    assert use_as_process_key.__module__ == "agora_client.engine.identity"


def test_a_handler_serves_under_upstream_protocol_names() -> None:
    class Renamed(CheckedConnectionHandler):
        pass

    assert Renamed._get_handle_name(None, "rpc_forward") == ConnectionHandler._get_handle_name(None, "rpc_forward")
    assert Renamed._get_handle_name(None, "rpc_forward") == "ConnectionHandler.rpc_forward"


def test_an_empty_reply_stream_is_recognized() -> None:
    async def nothing():
        return
        yield

    with pytest.raises(ValueError) as raised:
        asyncio.run(asingle(nothing()))
    assert stream_ended_empty(raised.value)
    assert not stream_ended_empty(ValueError("something else"))


def test_no_group_text_is_recognized() -> None:
    assert found_no_group(AllreduceException("Averaging step failed: could not find a group"))
    assert not found_no_group(TimeoutError())


@pytest.mark.integration
def test_libp2p_errors_still_say_what_routing_reads() -> None:
    """Two real p2p daemons: a protocol the peer does not serve, and a peer nobody knows."""

    async def observe() -> list[P2PDaemonError]:
        first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        second = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(addr) for addr in await first.get_visible_maddrs()]
        )
        errors = []
        try:
            for peer in (second.peer_id, PeerID.from_identity(_identity_bytes())):
                try:
                    await asyncio.wait_for(
                        first.call_protobuf_handler(
                            peer, "Nobody.rpc", runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
                        ),
                        30,
                    )
                except P2PDaemonError as error:
                    errors.append(error)
        finally:
            await second.shutdown()
            await first.shutdown()
        return errors

    errors = asyncio.run(observe())
    assert len(errors) == 2, errors
    assert [daemon_failure(error) for error in errors] == [DaemonFailure.UNREACHABLE] * 2, [str(e) for e in errors]


def _identity_bytes() -> bytes:
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()


def test_the_moe_stub_is_made_for_a_peer() -> None:
    assert tuple(inspect.signature(get_server_stub).parameters)[:2] == ("p2p", "server_peer_id")


# --- the boundary itself


def test_nothing_outside_the_engine_touches_a_hivemind_internal() -> None:
    assert boundary_violations(outside_engine(project_files())) == []


def _plant(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "planted.py"
    path.write_text(textwrap.dedent(source))
    return [violation.removeprefix(f"{path}:") for violation in boundary_violations([path])]


def test_an_internal_without_an_underscore_fails_by_name(tmp_path: Path) -> None:
    violations = _plant(
        tmp_path,
        """
        from hivemind.dht.protocol import DHTProtocol

        def decode(data: bytes) -> object:
            return DHTProtocol.serializer.loads(data)
        """,
    )
    assert violations == ["5 DHTProtocol.serializer"]


def test_an_override_of_a_private_hivemind_method_fails_by_name(tmp_path: Path) -> None:
    violations = _plant(
        tmp_path,
        """
        from hivemind.averaging import DecentralizedAverager

        class Quiet(DecentralizedAverager):
            def step(self, *args, **kwargs):  # a public, documented hook
                return super().step(*args, **kwargs)

            async def _step(self, **kwargs):
                return None
        """,
    )
    assert violations == ["8 Quiet._step overrides DecentralizedAverager._step"]


def test_a_name_of_our_own_does_not_hide_hivemind_s(tmp_path: Path) -> None:
    """The project defining ``_p2p`` and ``serializer`` itself does not make hivemind's its own."""
    violations = _plant(
        tmp_path,
        """
        from hivemind.averaging import DecentralizedAverager
        from hivemind.dht.protocol import DHTProtocol

        class Ours:
            serializer = None

            def __init__(self):
                self._p2p = None

        def reach(averager: DecentralizedAverager, protocol: DHTProtocol):
            return averager._p2p, protocol.serializer, Ours()._p2p
        """,
    )
    assert violations == ["12 DecentralizedAverager._p2p", "12 DHTProtocol.serializer"]


def test_an_internal_module_import_fails_by_name(tmp_path: Path) -> None:
    violations = _plant(tmp_path, "from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE\n")
    assert violations == ["1 imports hivemind.p2p.p2p_daemon_bindings.control.DEFAULT_MAX_MSG_SIZE"]


def test_our_subclasses_set_no_private_attribute_upstream_uses() -> None:
    """A private attribute of ours that an upstream base class also uses would silently replace its state."""
    subclasses = [
        RoundAverager,
        ScreenedAllReduce,
        engine_averaging._ScreenedPartReducer,
        CheckedConnectionHandler,
        HostedServer,
        sparta._GroupAverager,
        server.GuardedConnectionHandler,
        server.StageServer,
        backend.StageBackend,
    ]
    clashes = []
    for cls in subclasses:
        upstream = {
            name
            for base in cls.__mro__
            if base.__module__.split(".")[0] in ("hivemind", "multiprocessing", "threading")
            for name in re.findall(r"\b(_[A-Za-z]\w*)", inspect.getsource(base))
        }
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
                if node.value.id == "self" and node.attr in upstream and node.attr != "_start_method":
                    clashes.append(f"{cls.__qualname__}.{node.attr}")
    assert clashes == []


def test_an_averager_shut_down_mid_round_finalizes_its_runners_and_cancels_the_rest():
    """hivemind's own _shutdown calls finalize() on the futures of its running groups and waits for what it returns
    (None); the engine's finalizes, with upstream's own finalize(), each runner a future holds and cancels the rest."""
    from types import SimpleNamespace

    from agora_client.engine.averaging import RoundAverager

    class Parts:
        finalized = False

        def finalize(self) -> None:
            self.finalized = True

    async def shut_down() -> tuple[SimpleNamespace, asyncio.Future, asyncio.Future]:
        runner = SimpleNamespace(_future=asyncio.Future(), tensor_part_container=Parts(), tensor_part_reducer=Parts())
        runner.finalize = functools.partial(AllReduceRunner.finalize, runner)
        running, pending = asyncio.Future(), asyncio.Future()
        running.set_result(runner)
        averager = SimpleNamespace(client_mode=True, _running_groups={b"a": running, b"b": pending})
        await RoundAverager._shutdown(averager, timeout=5)
        return runner, running, pending

    runner, running, pending = asyncio.run(shut_down())
    assert (
        runner._future.cancelled() and runner.tensor_part_container.finalized and runner.tensor_part_reducer.finalized
    )
    assert pending.cancelled() and not running.cancelled()


def test_a_lock_left_held_by_a_stopped_process_ends_the_wait_for_the_tensors_once_stopped():
    """An all-reduce holds the averaged tensors' lock in hivemind's process; a process stopped there never releases
    it, and a round queued behind it must not wait for good once the averager stops."""
    from concurrent.futures import CancelledError
    from types import SimpleNamespace

    from agora_client.engine.averaging import RoundAverager

    context = mp.get_context("fork")
    lock, buffer = context.Lock(), torch.zeros(4)
    holder = context.Process(target=lock.acquire)  # exits holding it, as a process stopped mid all-reduce does
    holder.start()
    holder.join()
    averager = SimpleNamespace(lock_averaged_tensors=lock, _averaged_tensors=(buffer,))
    checks = []

    def stopped() -> bool:
        checks.append(True)
        return len(checks) >= 3

    with pytest.raises(CancelledError):
        with RoundAverager.tensors_unless(averager, stopped, poll_s=0.01):
            pass
    assert len(checks) == 3
    free = context.Lock()
    with RoundAverager.tensors_unless(
        SimpleNamespace(lock_averaged_tensors=free, _averaged_tensors=(buffer,)), stopped, 0.01
    ) as tensors:
        assert tensors == (buffer,) and not free.acquire(block=False)
    assert free.acquire(block=False)
