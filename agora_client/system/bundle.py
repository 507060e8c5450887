"""Support bundle: a zip a contributor can attach to a ticket.

It holds the recent event logs, the effective client config, a system report (OS, Python,
torch, CUDA and driver, GPU, RAM, disk, package versions) and the newest diagnosis of the network
between this machine and the swarm (``network.json``). Every member is redacted by key and
by token pattern before it is written, and the known secrets (the saved token, ``HF_TOKEN``,
the ``hf auth login`` token) are removed literally, so none of them reaches the zip.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil

from agora_client.client_config import CONFIG_FILE, SECRETS_FILE, hf_login_token
from agora_client.system.gpu import GpuProbe
from agora_client.system.redact import REDACTED, redact_data, redact_line

PACKAGES = (
    "agora",
    "torch",
    "hivemind",
    "textual",
    "pydantic",
    "httpx",
    "huggingface-hub",
    "safetensors",
    "psutil",
    "nvidia-ml-py",
    "PyYAML",
    "numpy",
    "rich",
)
TERMINAL_VARIABLES = ("TERM", "COLORTERM", "TERM_PROGRAM", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "TMUX")
REVIEW_NOTE = (
    "Review the bundle before sharing it: secrets were redacted, but it holds logs and details of this machine."
)
DEFAULT_MAX_LOG_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_LOG_FILES = 8


def known_secrets(config_dir: Path, login_token: Callable[[], str | None] = hf_login_token) -> list[str]:
    """Secret values this machine holds, to remove literally wherever they appear."""
    found = [os.environ.get("HF_TOKEN", ""), login_token() or ""]
    try:
        data = json.loads((Path(config_dir) / SECRETS_FILE).read_text(encoding="utf-8"))
        found.extend(str(value) for value in data.values() if isinstance(data, dict))
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    return [secret for secret in found if secret]


def _versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _torch_report() -> dict[str, Any]:
    try:
        import torch
    except Exception as error:  # a broken torch install is itself worth reporting
        return {"error": f"{type(error).__name__}: {error}"}
    return {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def _disk(path: Path) -> dict[str, Any]:
    try:
        usage = shutil.disk_usage(path)
    except OSError as error:
        return {"path": str(path), "error": str(error)}
    return {"path": str(path), "total": usage.total, "free": usage.free}


def system_report(config_dir: Path, gpu: GpuProbe | None = None) -> dict[str, Any]:
    gpu = gpu or GpuProbe()
    memory = psutil.virtual_memory()
    return {
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version,
        "executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "ram": {"total": memory.total, "available": memory.available},
        "disk": [_disk(Path(config_dir)), _disk(Path.cwd())],
        "nvidia": {
            "driver": gpu.driver_version(),
            "cuda_driver": gpu.cuda_driver_version(),
            "note": gpu.note,
            "gpus": [device.__dict__ for device in gpu.devices()],
        },
        "torch": _torch_report(),
        "packages": _versions(),
        "terminal": {name: os.environ.get(name, "") for name in TERMINAL_VARIABLES},
    }


def effective_config(config_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = {"config_dir": str(config_dir)}
    try:
        config.update(json.loads((Path(config_dir) / CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as error:
        config["config_error"] = str(error)
    if (Path(config_dir) / SECRETS_FILE).exists():
        config["hf_token"] = REDACTED
    config["hf_token_from_env"] = bool(os.environ.get("HF_TOKEN"))
    return config


def recent_logs(logs_dir: Path) -> list[Path]:
    """Every JSONL log under logs_dir, newest first."""
    if not Path(logs_dir).is_dir():
        return []
    return sorted(Path(logs_dir).rglob("*.jsonl"), key=lambda path: path.stat().st_mtime, reverse=True)


def _tail(path: Path, max_bytes: int) -> list[str]:
    """The last whole lines of a file, at most about max_bytes of them."""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - max_bytes))
        data = handle.read()
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if size > max_bytes else lines


def last_network_report(logs: list[Path], max_bytes: int = DEFAULT_MAX_LOG_BYTES) -> dict[str, Any] | None:
    """The newest diagnosis of the network (a reachability event's ``network``), newest log first."""
    for log in logs:
        for line in reversed(_tail(log, max_bytes)):
            if '"network":{' not in line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(event, dict)
                and event.get("kind") == "reachability"
                and isinstance(event.get("network"), dict)
            ):
                dial = {name: event.get(name) for name in ("ts", "status", "path", "address", "tested_from", "relay")}
                return {**dial, **event["network"]}
    return None


def build_bundle(
    output_dir: Path,
    *,
    config_dir: Path,
    logs_dir: Path,
    secrets: Iterable[str] = (),
    extra_lines: Iterable[str] = (),
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
    max_log_files: int = DEFAULT_MAX_LOG_FILES,
    report: dict[str, Any] | None = None,
    now: Callable[[], float] = time.time,
) -> Path:
    """Write ``agora-support-<time>.zip`` into output_dir and return its path.

    ``extra_lines`` are recent lines the caller holds in memory (the app's log pane, say);
    ``report`` replaces the live system report (tests).
    """
    secrets = [*known_secrets(config_dir), *secrets]
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / time.strftime("agora-support-%Y%m%d-%H%M%S.zip", time.localtime(now()))
    report = report if report is not None else system_report(config_dir)

    def as_json(data: Any) -> str:
        return json.dumps(redact_data(data, secrets), indent=2, default=str) + "\n"

    partial = path.with_suffix(".zip.partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("README.txt", f"Agora support bundle\n\n{REVIEW_NOTE}\n")
        bundle.writestr("system.json", as_json(report))
        bundle.writestr("config.json", as_json(effective_config(config_dir)))
        logs = recent_logs(logs_dir)[:max_log_files]
        for log in logs:
            lines = (redact_line(line, secrets) for line in _tail(log, max_log_bytes))
            bundle.writestr(f"logs/{log.name}", "".join(f"{line}\n" for line in lines))
        network = last_network_report(logs, max_log_bytes)
        if network is not None:  # what the network between this machine and the swarm does, for the ticket
            bundle.writestr("network.json", as_json(network))
        recent = [redact_line(line, secrets) for line in extra_lines]
        if recent:
            bundle.writestr("recent.txt", "".join(f"{line}\n" for line in recent))
    os.replace(partial, path)  # a half-written bundle never carries the final name
    return path
