"""Peer id -> identity bindings: a key belongs to the Hugging Face account that first joined with it.

Kept in the service's state database (state_store.py), so a binding outlives a restart of the service.
A ``peer_bindings.json`` that an older version kept is imported at start (where the database already binds
a peer, the database wins) and renamed ``peer_bindings.json.migrated``: from then on the database is the truth.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .state_store import AuthStateStore

log = logging.getLogger(__name__)


class BindingFileError(ValueError):
    pass


class PeerBindings:
    def __init__(self, store: AuthStateStore, legacy_file: Path | None = None):
        self._store = store
        if legacy_file is not None:
            _import_binding_file(Path(legacy_file), store)

    def claim(self, peer_id: str, identity: str) -> str:
        """Bind ``peer_id`` to ``identity`` if it is new; return the identity it is bound to."""
        return self._store.bind(peer_id, identity)

    def owner(self, peer_id: str) -> str | None:
        return self._store.owner(peer_id)


def _import_binding_file(path: Path, store: AuthStateStore) -> None:
    owners = _read_binding_file(path)
    if owners is None:
        return
    added = store.import_bindings(owners)
    migrated = path.with_name(path.name + ".migrated")
    os.replace(path, migrated)  # after the commit: a crash before this imports the same bindings again, harmlessly
    log.info(
        "imported %d of %d peer bindings from %s into %s; the file is kept as %s and no longer read",
        added,
        len(owners),
        path,
        store.path,
        migrated,
    )


def _read_binding_file(path: Path) -> dict[str, str] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise BindingFileError(
            f"{path} cannot be read ({type(error).__name__}); restore it from a backup "
            "(deleting it forgets which account owns which peer key)"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise BindingFileError(f"{path} must map peer ids to identities; restore it from a backup")
    return data
