"""hivemind's moe Server and ConnectionHandler, with the seams a worker needs and upstream lacks.

- CheckedConnectionHandler: serves under upstream's protocol names whatever its class is called, and calls
  check_inputs on every request's deserialized tensors before they reach a pool, answered after, and awaits
  before_answer (an upload cap's pacing) before the answer is sent.
- HostedServer: a Server whose connection handlers and DHT announcer are of the caller's making, and
  whose shutdown may be called twice.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch
from hivemind import DHT
from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.moe.server.server import Server
from hivemind.moe.server.task_pool import TaskPool
from hivemind.proto import runtime_pb2

__all__ = ["Announcer", "CheckedConnectionHandler", "HostedServer"]


class CheckedConnectionHandler(ConnectionHandler):
    """hivemind's connection handler with a check of every request's deserialized inputs, whichever rpc
    (plain or streamed) carried them, and a note of every answer."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # upstream derives protocol names from the class name; keep ConnectionHandler's so clients find us
        return ConnectionHandler._get_handle_name(namespace, method_name)

    def check_inputs(self, pool_name: str, inputs: Sequence[torch.Tensor]) -> None:
        """Raise to refuse a request whose tensors are about to be submitted to the pool ``pool_name``."""

    def answered(self, pool_name: str, inputs: Sequence[torch.Tensor], outputs: Sequence[runtime_pb2.Tensor]) -> None:
        """Called with every request the pool ``pool_name`` answered."""

    async def before_answer(self, outputs: Sequence[runtime_pb2.Tensor]) -> None:
        """Awaited with every answer before it is handed to hivemind to send (plain or streamed)."""

    async def _process_inputs(self, inputs, pool: TaskPool, schema) -> list[runtime_pb2.Tensor]:
        # upstream has no hook between deserializing a request's tensors and submitting them to a pool
        self.check_inputs(pool.name, inputs)
        outputs = await super()._process_inputs(inputs, pool, schema)
        self.answered(pool.name, inputs, outputs)
        await self.before_answer(outputs)
        return outputs


class Announcer(Protocol):
    """What a Server runs in place of upstream's DHTHandlerThread: a thread with a ``stop`` event."""

    stop: threading.Event

    def start(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class HostedServer(Server):
    """hivemind's moe Server with connection handlers and a DHT announcer of the caller's making.

    :param handlers: builds the connection handlers from the server's module backends (before any fork)
    :param announcer: replaces upstream's DHTHandlerThread, which can publish only the uid
    """

    def __init__(
        self,
        dht: DHT,
        module_backends: dict[str, ModuleBackend],
        *,
        handlers: Callable[[dict[str, ModuleBackend]], list[ConnectionHandler]],
        announcer: Announcer,
        **kwargs: Any,
    ):
        super().__init__(dht, module_backends, num_connection_handlers=0, **kwargs)
        # upstream builds plain ConnectionHandlers and its own DHTHandlerThread in __init__, with no way to pass others
        self.conn_handlers = handlers(self.module_backends)
        self.dht_handler_thread = announcer
        self._shutdown_once = threading.Lock()
        self._is_shut_down = False

    def shutdown(self) -> None:
        # upstream's run() calls shutdown() again once its runtime has stopped: the second call must do nothing
        with self._shutdown_once:
            if self._is_shut_down:
                return
            self._is_shut_down = True
        super().shutdown()
