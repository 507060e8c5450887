"""Trainers name the workers their spot checks caught lying; the monitor withholds those workers' compute points.

A trainer stores a ``Verdict`` under key ``agora.verdicts`` with subkey
``<worker peer id>/<trainer peer id> + [owner:<the trainer's RSA public key>]``, signed by that key
(hivemind's ``RSASignatureValidator`` on every DHT node refuses it otherwise). The monitor keeps a
verdict only if
- the owner key *is* the trainer the verdict names (its libp2p peer id equals ``verdict.trainer``),
- the verdict's ticket verifies with the auth service's public key, is a trainer's ticket
  (``stage == TRAINER_ROLE``) and names that same trainer.

So only a trainer holding the operator's ticket can cost a worker its points: one that signs its own with the
auth service's key on the auth host, or one the service issued for a trainer credential.
The record's schema and key are in agora_client.discovery.signed_records, the signature checks in
``signatures``.
"""

from __future__ import annotations

from collections.abc import Callable

from hivemind import DHT
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.auth.tickets import TRAINER as TRAINER_ROLE
from agora_client.discovery.signed_records import VERDICTS_KEY, Verdict
from agora_client.engine.records import RSASignatureValidator, owner_marker
from agora_client.monitor.signatures import check_signed, owner_subkey


def trainer_peer_id(validator: RSASignatureValidator) -> str:
    """The peer id of the key this validator signs with (the ``[owner:...]`` wrapper removed)."""
    return peer_id_of_public_key(owner_marker(validator).removeprefix(b"[owner:").removesuffix(b"]"))


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
    check_signed(  # only a trainer's ticket (stage TRAINER_ROLE) lets a verdict count
        subkey,
        verdict.subkey_name,
        record=f"verdict of trainer {verdict.trainer}",
        signer=verdict.trainer,
        ticket=verdict.ticket,
        claims={"peer_id": verdict.trainer, "stage": TRAINER_ROLE},
        auth_public_key=auth_public_key,
        now=now,
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
