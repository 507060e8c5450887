"""Trainer credentials: what lets a trainer on another host get trainer tickets without the signing key.

A trainer's ticket lets it call every worker and sign verdicts and receipts, so it used to be signed by the
trainer itself with the auth service's key, copied to each trainer host: one leaked trainer host could then
mint worker tickets too. Now the operator makes a credential per trainer on the auth host
(``agora trainer-credential add NAME``), hands the printed token to that trainer (``--credential-file``),
and the auth service exchanges it for short trainer tickets (``POST /v1/trainer/ticket``). Revoking a
credential stops its renewals: its tickets end within their TTL.

The file (``trainer_credentials.json`` in the service's state dir, mode 0600) keeps each credential's
SHA-256, never the token: tokens are 256 random bits, so the hash cannot be reversed. The service reads the
file on every request, so a revocation by the CLI counts at once.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .secret import Secret, token_fingerprint

FILE_NAME = "trainer_credentials.json"
NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
TOKEN_PREFIX = "agora-trainer-"


class CredentialRefused(Exception):
    """The credential is unknown or revoked; the message says which and what to do."""


@dataclass(frozen=True)
class Credential:
    name: str
    created_at: float
    revoked_at: float | None


class TrainerCredentials:
    """The credentials file of one auth service's state dir."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / FILE_NAME

    def add(self, name: str) -> Secret:
        """A new credential's token (shown once: only its hash is kept); ValueError for a bad or taken name."""
        if not NAME.match(name):
            raise ValueError(f"credential name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        entries = self._read()
        if name in entries:
            raise ValueError(f"a credential named {name!r} exists already; revoke it and add another name")
        token = Secret(TOKEN_PREFIX + secrets.token_urlsafe(32))
        entries[name] = {"sha256": token_fingerprint(token), "created_at": time.time(), "revoked_at": None}
        self._write(entries)
        return token

    def revoke(self, name: str) -> bool:
        """Revoke ``name``; False when it was revoked already. KeyError when there is no such credential."""
        entries = self._read()
        if name not in entries:
            raise KeyError(f"no trainer credential named {name!r}")
        if entries[name]["revoked_at"] is not None:
            return False
        entries[name]["revoked_at"] = time.time()
        self._write(entries)
        return True

    def list(self) -> list[Credential]:
        return [
            Credential(name, entry["created_at"], entry["revoked_at"]) for name, entry in sorted(self._read().items())
        ]

    def holder(self, token: Secret) -> str:
        """The name of the live credential ``token`` is; CredentialRefused otherwise."""
        digest = token_fingerprint(token)
        for name, entry in self._read().items():
            if hmac.compare_digest(entry["sha256"], digest):
                if entry["revoked_at"] is not None:
                    raise CredentialRefused(
                        f"the trainer credential {name!r} was revoked; ask the operator for a new one"
                    )
                return name
        raise CredentialRefused(
            "unknown trainer credential; check --credential-file against what "
            "`agora trainer-credential add` printed on the auth host"
        )

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _write(self, entries: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            json.dump(entries, out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)  # a reader sees the old file or the new one, never half of one
