"""`agora deploy units`: one systemd unit per role of this host, from the same plan `agora deploy up` runs.

Each unit runs its role with the command line `up` would use; a unit starts after the units of the steps before
its own (and pulls them in). ``agora.target`` holds them all: ``systemctl start agora.target`` starts the host's
roles, ``systemctl stop agora.target`` stops them. Secrets stay in files; no unit holds one.
"""

from __future__ import annotations

from pathlib import Path

from .plan import Launch, Step
from .supervisor import RESTART_AFTER_S

TARGET = "agora.target"


def unit_name(launch: Launch) -> str:
    return f"agora-{launch.name}.service"


def write_units(
    steps: list[Step], out: Path, *, python: str, checkout: Path, secrets: Path, user: str | None
) -> list[Path]:
    """Write the units and ``agora.target`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written, before = [], []
    for step in steps:
        for launch in step:
            path = out / unit_name(launch)
            path.write_text(_unit(launch, before, python=python, checkout=checkout, secrets=secrets, user=user))
            written.append(path)
        before = [unit_name(launch) for launch in step]
    target = out / TARGET
    names = " ".join(path.name for path in written)
    target.write_text(
        f"[Unit]\nDescription=Agora roles of this host\nWants={names}\n\n[Install]\nWantedBy=multi-user.target\n"
    )
    return [*written, target]


def _unit(launch: Launch, after: list[str], *, python: str, checkout: Path, secrets: Path, user: str | None) -> str:
    command = " ".join(_quoted(part) for part in [python, str(checkout / "agora_cli.py"), *launch.args])
    earlier = " ".join(after)
    lines = [
        "[Unit]",
        f"Description=Agora {launch.name} ({launch.address})",
        f"After=network-online.target {earlier}".rstrip(),
        f"Wants=network-online.target {earlier}".rstrip(),
        f"PartOf={TARGET}",
        "",
        "[Service]",
        "Type=simple",
        *([f"User={user}"] if user else []),
        f"WorkingDirectory={checkout}",
        "Environment=PYTHONUNBUFFERED=1",
        "# AWS_* variables for an s3:// store, if any, one per line (mode 0600); never on the command line",
        f"EnvironmentFile=-{secrets / 'environment'}",
        f"ExecStart={command}",
        "# A role that stops on its own (a trainer whose auth service is not up yet) is started again",
        "Restart=on-failure",
        f"RestartSec={RESTART_AFTER_S:g}",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=30",
        "KillMode=mixed",
        "",
        "[Install]",
        f"WantedBy={TARGET}",
        "",
    ]
    return "\n".join(lines)


def _quoted(word: str) -> str:
    """``word`` as one argument of an ExecStart line: specifiers (%) and variables ($) taken literally."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not any(char in word for char in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
