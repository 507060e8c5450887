"""Peer id -> identity bindings: a key belongs to the Hugging Face account that first joined with it.

Kept in ``peer_bindings.json`` in the service's state dir (mode 0600, replaced atomically), so a
binding outlives a restart of the service.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class BindingFileError(ValueError):
    pass


class PeerBindings:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._owners: dict[str, str] = self._read()

    def claim(self, peer_id: str, identity: str) -> str:
        """Bind ``peer_id`` to ``identity`` if it is new; return the identity it is bound to."""
        with self._lock:
            owner = self._owners.get(peer_id)
            if owner is None:
                self._owners[peer_id] = owner = identity
                self._write()
            return owner

    def owner(self, peer_id: str) -> str | None:
        with self._lock:
            return self._owners.get(peer_id)

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            raise BindingFileError(
                f"{self.path} cannot be read ({type(error).__name__}); restore it from a backup "
                "(deleting it forgets which account owns which peer key)"
            ) from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise BindingFileError(f"{self.path} must map peer ids to identities; restore it from a backup")
        return data

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(self._owners, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
