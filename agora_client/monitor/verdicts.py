"""Trainers name the workers their spot checks caught lying; the monitor withholds those workers' compute points.

A trainer stores a ``Verdict`` under key ``agora.verdicts`` with subkey
``<worker peer id>/<trainer peer id> + [owner:<the trainer's RSA public key>]``, signed by that key
(hivemind's ``RSASignatureValidator`` on every DHT node refuses it otherwise). The monitor keeps a
verdict only if
- the owner key *is* the trainer the verdict names (its libp2p peer id equals ``verdict.trainer``),
- the verdict's ticket verifies with the auth service's public key, is a trainer's ticket
  (``stage == TRAINER_ROLE``) and names that same trainer.

So only a trainer holding the operator's ticket can cost a worker its points. The trainer issues its
own ticket with the auth service's signing key (``trainer_ticket``): trainers run on the operator's host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agora_client.auth.tickets import InvalidTicket, issue_ticket, verify_ticket
from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.monitor.records import owner_subkey, signer_of

VERDICTS_KEY = "agora.verdicts"
TRAINER_ROLE = "trainer"  # a trainer's ticket names this role where a worker's names its stage
TRAINER_TICKET_TTL = 3600.0


class Verdict(BaseModel):
    """A trainer's finding: this worker's outputs disagreed with its stage's majority this often."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1
    trainer: str = Field(description="peer id of the trainer's RSA key, which signs the record")
    ticket: str = Field(description="the trainer's ticket (role trainer)")
    peer_id: str = Field(description="the worker caught")
    uid: str
    stage: str
    checks: int = Field(ge=1, description="spot checks the worker took part in")
    disagreements: int = Field(ge=1, description="checks where it disagreed with the majority")
    ts: float

    @property
    def subkey_name(self) -> str:
        return f"{self.peer_id}/{self.trainer}"


def trainer_peer_id(validator: RSASignatureValidator) -> str:
    """The peer id of the key this validator signs with (the ``[owner:...]`` wrapper removed)."""
    return peer_id_of_public_key(validator.local_public_key.removeprefix(b"[owner:").removesuffix(b"]"))


def trainer_ticket(auth_key: Ed25519PrivateKey, validator: RSASignatureValidator) -> str:
    return issue_ticket(
        auth_key, identity=TRAINER_ROLE, peer_id=trainer_peer_id(validator), stage=TRAINER_ROLE, slot=0,
        ttl_s=TRAINER_TICKET_TTL,
    )


def publish_verdict(dht: DHT, verdict: Verdict, validator: RSASignatureValidator, ttl: float) -> bool:
    """Store the verdict signed by the trainer's key; True if at least one DHT node accepted it."""
    return bool(
        dht.store(
            VERDICTS_KEY,
            verdict.model_dump(mode="json"),
            expiration_time=get_dht_time() + ttl,
            subkey=owner_subkey(verdict.subkey_name, validator),
        )
    )


def check_verdict(subkey: object, value: object, auth_public_key: str, *, now: float | None = None) -> Verdict:
    """Verify one DHT entry of ``agora.verdicts``. Raises ValueError why not."""
    try:
        verdict = Verdict.model_validate(value)
    except ValidationError as error:
        raise ValueError(f"malformed verdict: {error.errors()[0]['msg']}") from None
    signer = signer_of(subkey, verdict.subkey_name)
    if signer != verdict.trainer:
        raise ValueError(f"verdict of trainer {verdict.trainer} is signed by the key of peer {signer}")
    try:
        claims = verify_ticket(auth_public_key, verdict.ticket, now=now)
    except InvalidTicket as error:
        raise ValueError(f"invalid trainer ticket: {error}") from None
    if (claims.stage, claims.peer_id) != (TRAINER_ROLE, verdict.trainer):
        raise ValueError(
            f"ticket is for {claims.stage} {claims.peer_id}, not for trainer {verdict.trainer}: only trainers judge workers"
        )
    return verdict


def fetch_verdicts(
    dht: DHT, auth_public_key: str, *, now: float | None = None, on_reject: Callable[[str], None] | None = None
) -> list[Verdict]:
    """Every verified verdict in the DHT."""
    found = dht.get(VERDICTS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    verdicts = []
    for subkey, entry in found.value.items():
        try:
            verdicts.append(check_verdict(subkey, entry.value, auth_public_key, now=now))
        except ValueError as error:
            if on_reject is not None:
                on_reject(f"verdict: {error}")
    return verdicts
