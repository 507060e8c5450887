"""Tickets as the auth service's key signs them, for tests of what trainers sign (verdicts, receipts)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.crypto import RSASignatureValidator

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.auth.tickets import TRAINER
from agora_client.monitor.verdicts import trainer_peer_id


def trainer_ticket(auth_key: Ed25519PrivateKey, validator: RSASignatureValidator) -> str:
    """A trainer ticket naming the peer id of ``validator``'s key, the one its verdicts and receipts are signed with."""
    return SelfIssuedTickets(auth_key, role=TRAINER, stage=TRAINER).ticket_for(trainer_peer_id(validator))
