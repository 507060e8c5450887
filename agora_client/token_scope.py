"""What the contributor's Hugging Face token may do, asked of Hugging Face itself before the token goes to a swarm.

The auth service needs a token only to learn its account (whoami-v2); a token that can write lets whoever holds it
change the contributor's repositories, so the client refuses to send one to a third party's service unless told
``--allow-write-token``. whoami-v2 says ``auth.accessToken.role``: "read", "write" or "fineGrained"; a fine-grained
token lists ``fineGrained.global`` and ``fineGrained.scoped[].permissions`` such as "repo.write".

Where Hugging Face cannot be reached the scope is unknown and the token is not sent: the swarm's auth service must
reach the same whoami to admit it, so waiting costs the contributor little, while a guess could leak a write token.
The endpoint is ``HF_ENDPOINT`` (as for huggingface_hub and the auth service), else https://huggingface.co.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
HF_TOKEN_PREFIX = "hf_"
WHOAMI_TIMEOUT_S = 15.0
READ_ONLY_HINT = (
    "create a read-only token (or a fine-grained one with no permission) at https://huggingface.co/settings/tokens "
    "and give it as HF_TOKEN or with --reconfigure; --allow-write-token sends this one anyway"
)


class TokenRefused(ValueError):
    """The token is not sent to the swarm; the message says why and how to make one that is."""


@dataclass(frozen=True)
class TokenScope:
    role: str  # "read", "write", "fineGrained", or "" when whoami did not say
    write_permissions: tuple[str, ...]  # the write rights it holds ("write" for a classic write token)

    @property
    def can_write(self) -> bool:
        return bool(self.write_permissions)


def scope_of(whoami: dict[str, Any]) -> TokenScope:
    """The token's rights from whoami-v2's JSON."""
    auth = whoami.get("auth") if isinstance(whoami.get("auth"), dict) else {}
    token = auth.get("accessToken") if isinstance(auth.get("accessToken"), dict) else {}
    role = str(token.get("role") or "")
    if role == "write":
        return TokenScope(role, ("write",))
    grained = token.get("fineGrained") if isinstance(token.get("fineGrained"), dict) else {}
    permissions = list(grained.get("global") or [])
    for scoped in grained.get("scoped") or []:
        if isinstance(scoped, dict):
            permissions += list(scoped.get("permissions") or [])
    writes = tuple(sorted({str(item) for item in permissions if str(item).endswith(".write")}))
    return TokenScope(role, writes)


def hf_endpoint() -> str:
    """The Hugging Face endpoint whoami is asked of: ``HF_ENDPOINT`` (as for huggingface_hub), else huggingface.co;
    the auth service asks the same one (auth/identity.py)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


def check_token_scope(token: str, *, allow_write: bool, endpoint: str | None = None) -> TokenScope | None:
    """Ask whoami-v2 what ``token`` may do; raise TokenRefused for a token that can write (unless ``allow_write``),
    one Hugging Face does not accept, or when Hugging Face cannot say. None: not asked (``allow_write``, offline),
    or not a Hugging Face token (a swarm's own identity token, as the local demo's ``agora_...``)."""
    if not token.startswith(HF_TOKEN_PREFIX):
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    endpoint = (endpoint or hf_endpoint()).rstrip("/")
    try:
        info = HfApi(endpoint=endpoint).whoami(token=token)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status == 401:
            raise TokenRefused(f"{endpoint} does not accept this Hugging Face token; {READ_ONLY_HINT}") from None
        return _unknown(endpoint, f"it answered HTTP {status}", allow_write)
    except Exception as error:  # offline, DNS, TLS, a timeout: the scope is unknown
        return _unknown(endpoint, type(error).__name__, allow_write)
    scope = scope_of(info)
    if scope.can_write and not allow_write:
        raise TokenRefused(
            f"this Hugging Face token can write ({', '.join(scope.write_permissions)}): it is not sent to a swarm; "
            + READ_ONLY_HINT
        )
    return scope


def _unknown(endpoint: str, why: str, allow_write: bool) -> None:
    if allow_write:
        return None
    raise TokenRefused(
        f"cannot ask {endpoint} what this token may do ({why}), so it is not sent to the swarm; try again once "
        "Hugging Face is reachable, or pass --allow-write-token to send it unchecked"
    )
