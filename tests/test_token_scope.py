"""The contributor's token goes to a swarm only if Hugging Face itself says it cannot write (a local stand-in
answers whoami-v2's documented JSON through HF_ENDPOINT)."""

from __future__ import annotations

import pytest

from agora_client.token_scope import TokenRefused, check_token_scope
from tests.whoami_stand_in import whoami_stand_in


@pytest.fixture
def hub(monkeypatch):
    with whoami_stand_in() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield url


def test_gaming_write_token(hub):
    with pytest.raises(TokenRefused, match="can write \\(write\\)") as refused:
        check_token_scope("hf_write12345678", allow_write=False)
    assert "read-only" in str(refused.value) and "hf_write12345678" not in str(refused.value)
    assert check_token_scope("hf_write12345678", allow_write=True).can_write


def test_gaming_fine_grained_token_with_write_rights(hub):
    with pytest.raises(TokenRefused, match="discussion.write, repo.write"):
        check_token_scope("hf_grainedwrite1", allow_write=False)


def test_read_only_and_no_permission_tokens_are_sent(hub):
    assert check_token_scope("hf_readonly12345", allow_write=False).role == "read"
    assert not check_token_scope("hf_grainedread12", allow_write=False).can_write


def test_a_token_hugging_face_refuses_or_cannot_judge_is_not_sent(hub, monkeypatch):
    with pytest.raises(TokenRefused, match="does not accept"):
        check_token_scope("hf_unknown123456", allow_write=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # nothing listens: offline
    with pytest.raises(TokenRefused, match="cannot ask http://127.0.0.1:1"):
        check_token_scope("hf_readonly12345", allow_write=False)
    assert check_token_scope("hf_readonly12345", allow_write=True) is None
    assert (
        check_token_scope("agora_a-swarms-own-token", allow_write=False) is None
    )  # no Hugging Face token: no secret of it


def test_the_client_refuses_to_start_with_a_write_token_and_never_prints_it(hub, monkeypatch, capsys, tmp_path):
    from agora_client.cli import build_parser
    from agora_client.frontend.client import prepare

    flags = ["--headless", "--swarm", "http://127.0.0.1:9", "--config-dir", str(tmp_path)]
    monkeypatch.setenv("HF_TOKEN", "hf_write12345678")
    assert prepare(build_parser().parse_args(flags)) == 2
    said = capsys.readouterr().err
    assert "can write" in said and "read-only" in said and "hf_write12345678" not in said
    assert not isinstance(prepare(build_parser().parse_args([*flags, "--allow-write-token"])), int)
    monkeypatch.setenv("HF_TOKEN", "hf_readonly12345")
    assert not isinstance(prepare(build_parser().parse_args(flags)), int)
