"""NVIDIA GPU probe through NVML (``nvidia-ml-py``, module ``pynvml``).

Every NVML query is wrapped: a missing library, a missing driver or an unsupported field
becomes ``None`` ("N/A" on screen) instead of an exception. NVML numbers devices in PCI bus
order, which is not necessarily the order of ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

from agora_client.events import GpuInfo

NA = "N/A"
NO_DRIVER_NOTE = "no NVIDIA driver: showing worker and host memory"

T = TypeVar("T")


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    memory_total: int


def _nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _query(call: Callable[..., T], *args: Any) -> T | None:
    """One NVML query; any NVML failure (unsupported field, lost device) is None."""
    pynvml = _nvml()
    try:
        return call(*args)
    except Exception as error:  # pynvml raises NVMLError subclasses generated at runtime
        if pynvml is not None and isinstance(error, pynvml.NVMLError):
            return None
        raise


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuProbe:
    """Initialises NVML once; ``available`` is False (and ``note`` says why) without a driver."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pynvml = _nvml()
        self.available = False
        self.note = NO_DRIVER_NOTE
        if self._pynvml is None:
            self.note = "nvidia-ml-py is not installed: showing worker and host memory"
            return
        try:
            self._pynvml.nvmlInit()
        except self._pynvml.NVMLError:
            return
        self.available = True
        self.note = ""
        if self.count() == 0:
            self.note = "no NVIDIA GPU found: showing worker and host memory"

    def count(self) -> int:
        if not self.available:
            return 0
        return _query(self._pynvml.nvmlDeviceGetCount) or 0

    def _handle(self, index: int) -> Any | None:
        if not self.available:
            return None
        return _query(self._pynvml.nvmlDeviceGetHandleByIndex, index)

    def device_query(self, index: int, call: str) -> Any | None:
        """NVML's ``call`` (a pynvml function name, e.g. nvmlDeviceGetTotalEnergyConsumption) on card ``index``; None
        without NVML or the card, or where NVML cannot answer it."""
        handle = self._handle(index)
        return None if handle is None else _query(getattr(self._pynvml, call), handle)

    def devices(self) -> list[GpuDevice]:
        found = []
        for index in range(self.count()):
            handle = self._handle(index)
            name = _query(self._pynvml.nvmlDeviceGetName, handle) if handle else None
            memory = _query(self._pynvml.nvmlDeviceGetMemoryInfo, handle) if handle else None
            found.append(GpuDevice(index, _text(name) if name else NA, int(memory.total) if memory else 0))
        return found

    def sample(self, index: int) -> GpuInfo | None:
        """Name, memory and utilization of one device, or None when it cannot be read."""
        with self._lock:
            handle = self._handle(index)
            if handle is None:
                return None
            name = _query(self._pynvml.nvmlDeviceGetName, handle)
            memory = _query(self._pynvml.nvmlDeviceGetMemoryInfo, handle)
            rates = _query(self._pynvml.nvmlDeviceGetUtilizationRates, handle)
        return GpuInfo(
            index=index,
            name=_text(name) if name else NA,
            memory_used=int(memory.used) if memory else 0,
            memory_total=int(memory.total) if memory else 0,
            utilization=float(rates.gpu) if rates else None,
        )

    def driver_version(self) -> str:
        if not self.available:
            return NA
        version = _query(self._pynvml.nvmlSystemGetDriverVersion)
        return _text(version) if version else NA

    def cuda_driver_version(self) -> str:
        if not self.available:
            return NA
        version = _query(self._pynvml.nvmlSystemGetCudaDriverVersion)
        return f"{version // 1000}.{version % 1000 // 10}" if version else NA

    def close(self) -> None:
        if self.available:
            _query(self._pynvml.nvmlShutdown)
            self.available = False


@dataclass(frozen=True)
class GpuSpec:
    """What the join-time fit check needs to know about the chosen GPU."""

    name: str
    memory_total: int  # bytes
    capability: tuple[int, int]  # CUDA compute capability (major, minor)
    memory_free: int | None = None  # bytes NVML counts free (a desktop's and other programs' use taken), None: unknown

    @property
    def capacity(self) -> int:
        """Bytes a worker may plan with: the card's free memory where known, else its total."""
        return self.memory_total if self.memory_free is None else min(self.memory_total, self.memory_free)

    def limited_to(self, capacity: int) -> "GpuSpec":
        """This card judged as one of ``capacity`` bytes (e.g. a larger card held to a torch memory fraction)."""
        free = capacity if self.memory_free is None else min(self.memory_free, capacity)
        return replace(self, memory_total=min(self.memory_total, capacity), memory_free=free)


def probe_cuda_device(index: int) -> GpuSpec | None:
    """The CUDA device `index` as torch sees it, or None without CUDA (the worker then runs on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"there is no CUDA device {index}: this machine has {torch.cuda.device_count()}; choose another --gpu"
        )
    properties = torch.cuda.get_device_properties(index)
    return GpuSpec(
        properties.name,
        int(properties.total_memory),
        (properties.major, properties.minor),
        memory_free=nvml_free_memory(cuda_card_ids()[index]),
    )


def nvml_free_memory(card: CardId) -> int | None:
    """Free memory of ``card`` as NVML counts it (what a desktop or other programs hold is taken), or None."""
    probe = GpuProbe()
    try:
        for index in range(probe.count()):
            nvml_card = nvml_card_id(probe, index)
            if nvml_card is not None and match_cuda_index(nvml_card, [card]) == 0:
                memory = _query(probe._pynvml.nvmlDeviceGetMemoryInfo, probe._handle(index))
                return int(memory.free) if memory else None
        return None
    finally:
        probe.close()


# -- --gpu N: the same physical card in NVML and in CUDA -------------------------------------------------


@dataclass(frozen=True)
class CardId:
    """What identifies one physical card in both numberings: its UUID and its PCI (domain, bus, device)."""

    uuid: str | None
    pci: tuple[int, int, int] | None


def nvml_card_id(probe: GpuProbe, index: int) -> CardId | None:
    """The card NVML numbers ``index`` (the number nvidia-smi shows), or None when NVML cannot say."""
    handle = probe._handle(index)
    if handle is None:
        return None
    uuid = _query(probe._pynvml.nvmlDeviceGetUUID, handle)
    pci = _query(probe._pynvml.nvmlDeviceGetPciInfo, handle)
    return CardId(_normal_uuid(_text(uuid)) if uuid else None, _parse_bus_id(_text(pci.busId)) if pci else None)


def cuda_card_ids() -> list[CardId]:
    """The cards CUDA sees, in CUDA's numbering (which CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER change)."""
    import torch

    cards = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        pci = tuple(getattr(props, name, -1) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        cards.append(CardId(_normal_uuid(str(uuid)) if uuid is not None else None, pci if min(pci) >= 0 else None))
    return cards


def match_cuda_index(card: CardId, cuda_cards: list[CardId]) -> int | None:
    """CUDA's index of ``card``: by UUID, else by PCI address; None if CUDA does not see it."""
    for index, other in enumerate(cuda_cards):
        if card.uuid and other.uuid and card.uuid == other.uuid:
            return index
    for index, other in enumerate(cuda_cards):
        if card.pci and other.pci and card.pci == other.pci:
            return index
    return None


def _normal_uuid(text: str) -> str:
    return text.lower().removeprefix("gpu-")


def _parse_bus_id(bus_id: str) -> tuple[int, int, int] | None:
    """NVML's ``DDDDDDDD:BB:DD.F`` -> (domain, bus, device)."""
    try:
        domain, bus, rest = bus_id.split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


class NoUsableGpu(RuntimeError):
    """The chosen GPU cannot be used through CUDA; the message says why and what to do."""


CPU_NOTE = "--cpu: running on the CPU (the demo and tests only; a CPU worker is far too slow for a real run)"


def torch_device_for(gpu: int | None) -> tuple[str, str]:
    """(torch device, note) for ``--gpu N`` (N as NVML / nvidia-smi number it); NoUsableGpu when CUDA cannot use it."""
    if gpu is None:
        raise NoUsableGpu("no GPU chosen: pass --gpu N, N as nvidia-smi numbers the cards")
    cuda = cuda_card_ids()
    if not cuda:
        raise NoUsableGpu(
            f"CUDA is not available to torch, so GPU {gpu} cannot be used: check the NVIDIA driver "
            "and that torch is a CUDA build"
        )
    probe = GpuProbe()
    try:
        card = nvml_card_id(probe, gpu) if gpu < probe.count() else None
    finally:
        probe.close()
    if card is None:
        raise NoUsableGpu(f"NVML knows no GPU {gpu}: see nvidia-smi for the numbers")
    index = match_cuda_index(card, cuda)
    if index is None:
        raise NoUsableGpu(f"GPU {gpu} is hidden from CUDA: check CUDA_VISIBLE_DEVICES")
    return f"cuda:{index}", f"GPU {gpu} is cuda:{index}"
