"""System probes (GPU through NVML, host through psutil), redaction and the support bundle."""

from agora_client.system.bundle import REVIEW_NOTE, build_bundle, known_secrets, system_report
from agora_client.system.gpu import NA, NO_DRIVER_NOTE, GpuDevice, GpuProbe
from agora_client.system.host import HostProbe
from agora_client.system.redact import REDACTED, redact_data, redact_line, redact_text
from agora_client.system.resources import ResourceProbe

__all__ = [
    "NA",
    "NO_DRIVER_NOTE",
    "REDACTED",
    "REVIEW_NOTE",
    "GpuDevice",
    "GpuProbe",
    "HostProbe",
    "ResourceProbe",
    "build_bundle",
    "known_secrets",
    "redact_data",
    "redact_line",
    "redact_text",
    "system_report",
]
