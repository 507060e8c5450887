"""Trainers' receipts (agora_client/trainer/receipts.py): the compute a worker's claim is checked against.

A receipt counts only if its owner key is the trainer it names and its ticket, signed by the auth service,
is a trainer's ticket naming that trainer: a worker cannot vouch for itself, nor can any peer without the
operator's ticket. The store keeps, per trainer process (``run_id``) and worker, the highest count seen, so
receipts that expire from the DHT, or a trainer that restarts, lose nothing already receipted.
"""

from __future__ import annotations

from collections.abc import Callable

from hivemind import DHT
from pydantic import ValidationError

from agora_client.auth.tickets import TRAINER as TRAINER_ROLE
from agora_client.discovery.signed_records import RECEIPTS_KEY, Receipt
from agora_client.monitor.signatures import check_signed


def check_receipt(subkey: object, value: object, auth_public_key: str, *, now: float | None = None) -> Receipt:
    """Verify one DHT entry of ``agora.receipts``. Raises ValueError saying why not."""
    try:
        receipt = Receipt.model_validate(value)
    except ValidationError as error:
        raise ValueError(f"malformed receipt: {error.errors()[0]['msg']}") from None
    check_signed(
        subkey,
        receipt.subkey_name,
        record=f"receipt of trainer {receipt.trainer}",
        signer=receipt.trainer,
        ticket=receipt.ticket,
        claims={"peer_id": receipt.trainer, "stage": TRAINER_ROLE},
        auth_public_key=auth_public_key,
        now=now,
    )
    return receipt


def fetch_receipts(
    dht: DHT,
    auth_public_key: str,
    *,
    now: float | None = None,
    on_reject: Callable[[str], None] | None = None,
) -> list[Receipt]:
    """Every verified receipt in the DHT."""
    found = dht.get(RECEIPTS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    receipts = []
    for subkey, entry in found.value.items():
        try:
            receipts.append(check_receipt(subkey, entry.value, auth_public_key, now=now))
        except ValueError as error:
            if on_reject is not None:
                on_reject(f"receipt: {error}")
    return receipts
