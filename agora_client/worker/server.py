"""The worker's hivemind moe Server, with two seams swapped in.

- Connection handlers validate every request against the stage schema before it reaches a pool,
  and count every answered request and its payload bytes (worker/traffic.py).
- The DHT handler thread is replaced by the StageAnnouncer, which publishes the stage-prefixed uid
  together with the sync phase (hivemind's own handler can only publish the uid).
"""

from __future__ import annotations

import threading
from typing import Callable

from hivemind import DHT
from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.moe.server.server import Server
from hivemind.moe.server.task_pool import TaskPool
from hivemind.utils import nested_flatten

from agora_client.swarm.roster import WorkerRecord, announce, withdraw
from agora_client.worker.backend import StageBackend
from agora_client.worker.traffic import RequestMeter
from agora_client.worker.validation import validate_inputs


class ValidatingConnectionHandler(ConnectionHandler):
    def __init__(
        self,
        dht: DHT,
        backends: dict[str, StageBackend],
        *,
        vocab_size: int,
        max_batch_size: int,
        meter: RequestMeter | None = None,
    ):
        super().__init__(dht, backends)
        self._input_schemas, self._kinds = {}, {}
        for backend in backends.values():
            self._input_schemas[backend.forward_pool.name] = tuple(nested_flatten(backend.forward_schema))
            self._input_schemas[backend.backward_pool.name] = tuple(nested_flatten(backend.backward_schema))
            self._kinds[backend.forward_pool.name], self._kinds[backend.backward_pool.name] = "forward", "backward"
        self._vocab_size, self._max_batch_size = vocab_size, max_batch_size
        self._meter = meter

    @classmethod
    def _get_handle_name(cls, namespace, method_name):
        # hivemind derives protocol names from the class name; keep ConnectionHandler's so clients find us
        return ConnectionHandler._get_handle_name(namespace, method_name)

    async def _process_inputs(self, inputs, pool: TaskPool, schema):
        validate_inputs(
            inputs, self._input_schemas[pool.name], vocab_size=self._vocab_size, max_batch_size=self._max_batch_size
        )
        outputs = await super()._process_inputs(inputs, pool, schema)
        if self._meter is not None:  # every answered request, whichever rpc (plain or streamed) carried it
            received = sum(tensor.numel() * tensor.element_size() for tensor in inputs)
            self._meter.on_request(self._kinds[pool.name], received, sum(proto.ByteSize() for proto in outputs))
        return outputs


class StageAnnouncer(threading.Thread):
    """Re-publishes this worker's WorkerRecord every ``period`` seconds; withdraws it on stop."""

    def __init__(self, dht: DHT, record: Callable[[], WorkerRecord], period: float):
        super().__init__(name="stage-announcer", daemon=True)
        self.dht, self.record, self.period = dht, record, period
        self.stop = threading.Event()
        self.refresh = threading.Event()  # set to announce now (e.g. after a sync phase change)

    def run(self) -> None:
        while not self.stop.is_set():
            announce(self.dht, self.record(), ttl=self.period * 2.5)
            self.refresh.wait(self.period)
            self.refresh.clear()
        withdraw(self.dht, self.record(), ttl=self.period * 2.5)

    def join(self, timeout: float | None = None) -> None:
        self.refresh.set()
        super().join(timeout)


class StageServer(Server):
    def __init__(
        self,
        dht: DHT,
        backend: StageBackend,
        record: Callable[[], WorkerRecord],
        *,
        announce_period: float,
        vocab_size: int,
        max_batch_size: int,
        num_connection_handlers: int = 2,
        meter: RequestMeter | None = None,
        **runtime_kwargs,
    ):
        super().__init__(dht, {backend.name: backend}, num_connection_handlers=0, **runtime_kwargs)
        self.conn_handlers = [
            ValidatingConnectionHandler(
                dht, self.module_backends, vocab_size=vocab_size, max_batch_size=max_batch_size, meter=meter
            )
            for _ in range(num_connection_handlers)
        ]
        self.dht_handler_thread = self.announcer = StageAnnouncer(dht, record, announce_period)
        self._shutdown_once = threading.Lock()
        self._is_shut_down = False

    def shutdown(self) -> None:
        # hivemind's run() calls shutdown() again once its runtime has stopped: the second call must do nothing
        with self._shutdown_once:
            if self._is_shut_down:
                return
            self._is_shut_down = True
        super().shutdown()
