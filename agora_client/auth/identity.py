"""Identity sources: turn a contributor's token into the name their contributions count under."""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any, Protocol

import yaml

from agora_client.token_scope import hf_endpoint

from .secret import Secret, token_fingerprint

_HASHED_KEY = re.compile(r"^sha256:[0-9a-f]{64}$")


class IdentityError(Exception):
    """The token could not be turned into an identity."""


class InvalidToken(IdentityError):
    """The identity source says the token is not valid (HTTP 401)."""


class IdentityUnavailable(IdentityError):
    """The identity source could not be asked (HTTP 503): the token may be fine."""


class IdentitySource(Protocol):
    def resolve(self, token: Secret) -> str:
        """Return the identity (user name); raise InvalidToken or IdentityUnavailable."""

    def describe(self) -> str:
        """One line for the service's start-up message."""


class HuggingFaceIdentity:
    """Asks ``whoami-v2`` of a Hugging Face endpoint; the token needs no scope."""

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 15.0):
        self.endpoint = (endpoint or hf_endpoint()).rstrip("/")
        self.timeout_s = timeout_s

    def resolve(self, token: Secret) -> str:
        # Imported here: huggingface_hub is slow to import and only this source needs it.
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        outcome: dict[str, Any] = {}

        def ask() -> None:
            try:
                outcome["info"] = HfApi(endpoint=self.endpoint).whoami(token=token.reveal())
            except BaseException as error:  # handed to the caller below
                outcome["error"] = error

        # huggingface_hub's HTTP client has no timeout: ask in a daemon thread so a stuck
        # endpoint holds neither the caller nor the process's exit.
        asking = threading.Thread(target=ask, name="whoami", daemon=True)
        asking.start()
        asking.join(self.timeout_s)
        if asking.is_alive():
            raise IdentityUnavailable(
                f"{self.endpoint} did not answer whoami within {self.timeout_s:.0f}s; try again later"
            )
        try:
            if "error" in outcome:
                raise outcome.pop("error")
            info = outcome["info"]
        except HfHubHTTPError as error:
            status = getattr(error.response, "status_code", None)
            if status in (401, 403):
                raise InvalidToken(
                    f"{self.endpoint} did not accept the Hugging Face token; create a token at "
                    "https://huggingface.co/settings/tokens (no scope is needed) and try again"
                ) from None
            raise IdentityUnavailable(f"{self.endpoint} answered HTTP {status} to whoami; try again later") from None
        except Exception as error:  # network errors from the hub's HTTP client: never show the request
            raise IdentityUnavailable(
                f"could not reach {self.endpoint} to check the token ({type(error).__name__}); try again later"
            ) from None
        name = info.get("name") if isinstance(info, dict) else None
        if not isinstance(name, str) or not name:
            raise IdentityUnavailable(f"{self.endpoint} answered whoami without a user name; try again later")
        return name

    def describe(self) -> str:
        return f"Hugging Face whoami at {self.endpoint}"


class TokenFileIdentity:
    """Tokens listed in a local JSON or YAML file ``{token_key: username}``, re-read when it changes.

    A key is ``sha256:<hex of sha256(token)>`` (what ``write_demo_token_file`` writes, so the file
    never holds a token in clear) or, for hand-written files, the token itself.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._loaded_stamp: tuple[float, int] | None = None
        self._users: dict[str, str] = {}
        self._load()

    def resolve(self, token: Secret) -> str:
        users = self._load()
        wanted = f"sha256:{token_fingerprint(token)}"
        for key, name in users.items():
            candidate = key if _HASHED_KEY.match(key) else f"sha256:{token_fingerprint(Secret(key))}"
            if hmac.compare_digest(candidate, wanted):
                return name
        raise InvalidToken(
            "the token is not one of those listed in the swarm's token file; ask the swarm operator for one"
        )

    def describe(self) -> str:
        return f"token file {self.path}"

    def _load(self) -> dict[str, str]:
        with self._lock:
            try:
                status = self.path.stat()
            except FileNotFoundError:
                raise IdentityUnavailable(
                    f"the token file {self.path} does not exist; create it or fix the path"
                ) from None
            stamp = (status.st_mtime, status.st_size)
            if stamp != self._loaded_stamp:
                self._users = _parse_token_file(self.path)
                self._loaded_stamp = stamp
            return self._users


def _parse_token_file(path: Path) -> dict[str, str]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise IdentityUnavailable(f"the token file {path} cannot be read ({type(error).__name__})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in data.items()):
        raise IdentityUnavailable(f"the token file {path} must map each token (or sha256:<hex>) to a user name")
    return dict(data)


def write_demo_token_file(path: Path, username: str = "demo") -> str:
    """Create a random token for ``username``, add its hash to the token file, return the token.

    The token is returned once, for the launcher to hand to the demo client; the file keeps only its hash.
    """
    path = Path(path)
    token = "agora_" + secrets.token_urlsafe(32)
    users = _parse_token_file(path) if path.exists() else {}
    users[f"sha256:{token_fingerprint(Secret(token))}"] = username
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(users, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return token
