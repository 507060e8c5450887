"""Trainers without the signing key: the operator makes a credential on the auth host, the auth service
exchanges it for trainer tickets, and a revoked credential gets none (a real AuthServer on 127.0.0.1)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    write_demo_token_file,
)
from agora_client.auth.client import AuthFailed
from agora_client.auth.secret import Secret
from agora_client.auth.tickets import TRAINER, verify_ticket
from agora_client.auth.trainer_credentials import TrainerCredentials
from agora_client.auth.trainer_tickets import IssuedTrainerTickets
from agora_client.cli import main

TRAINER_PEERS = ("12D3KooWtrainerHead", "12D3KooWtrainerTail")


@pytest.fixture
def auth(tmp_path: Path):
    settings = ServiceSettings(policy=AdmissionPolicy(stages=("head", "tail"), pacing_s=0.0), snapshot_url=None)
    write_demo_token_file(tmp_path / "tokens.json", "alice")  # contributors' tokens: trainers need none
    service = AuthService(settings, TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "state")
    with AuthServer(service) as server:
        yield server, service


def test_a_credential_buys_trainer_tickets_for_each_of_the_trainers_peers(auth):
    server, service = auth
    tickets = IssuedTrainerTickets(server.url, TrainerCredentials(service.state_dir).add("trainer-host-1"))
    for peer_id in TRAINER_PEERS:
        claims = verify_ticket(service.public_key, tickets.ticket_for(peer_id))
        assert (claims.peer_id, claims.role, claims.stage, claims.identity) == (
            peer_id,
            TRAINER,
            TRAINER,
            "trainer:trainer-host-1",
        )
    assert tickets.ticket_for(TRAINER_PEERS[0]) == tickets.ticket_for(TRAINER_PEERS[0])  # held, not asked again


def test_a_revoked_credential_gets_no_new_ticket(auth):
    server, service = auth
    credentials = TrainerCredentials(service.state_dir)
    token = credentials.add("leaked-host")
    tickets = IssuedTrainerTickets(server.url, token)
    held = tickets.ticket_for(TRAINER_PEERS[0])
    assert credentials.revoke("leaked-host") and not credentials.revoke("leaked-host")
    assert tickets.ticket_for(TRAINER_PEERS[0]) == held  # issued before: it serves until its renewal is due
    with pytest.raises(AuthFailed, match="was revoked"):  # but the service issues nothing new
        tickets.ticket_for(TRAINER_PEERS[1])
    with pytest.raises(AuthFailed, match="was revoked"):
        IssuedTrainerTickets(server.url, token).ticket_for(TRAINER_PEERS[0])


def test_an_unknown_credential_is_refused_in_plain_words(auth):
    server, _ = auth
    with pytest.raises(AuthFailed, match="unknown trainer credential"):
        IssuedTrainerTickets(server.url, Secret("agora-trainer-guessed")).ticket_for(TRAINER_PEERS[0])


def test_the_operator_adds_lists_and_revokes_credentials_from_the_command_line(tmp_path: Path, capsys):
    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["trainer-credential", *args, "--state-dir", str(tmp_path)])
        printed = capsys.readouterr()
        return code, printed.out, printed.err

    code, token, said = cli("add", "gpu-box")
    token = token.strip()
    assert code == 0 and token.startswith("agora-trainer-") and "not shown again" in said
    assert token not in (tmp_path / "trainer_credentials.json").read_text()  # only its hash is kept
    assert (tmp_path / "trainer_credentials.json").stat().st_mode & 0o077 == 0
    assert TrainerCredentials(tmp_path).holder(Secret(token)) == "gpu-box"
    code, _, said = cli("add", "gpu-box")
    assert code == 2 and "exists already" in said
    assert cli("add", "bad name!")[0] == 2 and cli("revoke", "nobody")[0] == 2
    assert cli("revoke", "gpu-box")[0] == 0
    code, listed, _ = cli("list")
    assert code == 0 and listed.startswith("gpu-box") and "revoked" in listed


def test_a_trainer_takes_its_tickets_from_one_source_and_says_what_is_missing(tmp_path: Path):
    from agora_client.trainer.main import _ticket_source

    def source(**flags):
        return _ticket_source(
            argparse.Namespace(
                **{"ticket_key": None, "credential_file": None, "auth_url": None, "insecure": False, **flags}
            )
        )

    credential = tmp_path / "credential"
    credential.write_text("agora-trainer-abc\n")
    assert isinstance(source(credential_file=credential, auth_url="https://auth.example"), IssuedTrainerTickets)
    assert source() is None
    assert isinstance(source(credential_file=credential, auth_url="http://10.0.0.2:8000"), IssuedTrainerTickets)
    assert isinstance(
        source(credential_file=credential, auth_url="http://11.77.0.2:8000", insecure=True), IssuedTrainerTickets
    )
    for flags, words in (
        ({"ticket_key": tmp_path / "key.pem", "credential_file": credential}, "not both"),
        ({"credential_file": credential}, "needs --auth-url"),
        ({"credential_file": tmp_path / "missing", "auth_url": "https://a"}, "cannot read"),
        ({"credential_file": credential, "auth_url": "http://11.77.0.2:8000"}, "in clear text"),
    ):
        with pytest.raises(ValueError, match=words):
            source(**flags)
    credential.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        source(credential_file=credential, auth_url="https://auth.example")
