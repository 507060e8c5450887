"""First-run client config: token sources, 0600 secrets, GPU choice, --reconfigure."""

from __future__ import annotations

import json
import stat

import pytest

from agora_client.client_config import (
    ClientConfigError,
    ClientConfigStore,
    Prompts,
    default_config_dir,
    resolve_client,
)
from agora_client.system.gpu import GpuDevice

TYPED = "hf_TypedToken123456789"
LOGIN = "hf_LoginToken123456789"
ENV = "hf_EnvToken1234567890"
TWO_GPUS = [GpuDevice(0, "GPU A", 24 * 2**30), GpuDevice(1, "GPU B", 16 * 2**30)]


class Answers:
    """Scripted prompt answers; records every question asked."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []
        self.said: list[str] = []

    def prompts(self, interactive: bool = True) -> Prompts:
        return Prompts(ask=self._answer, ask_secret=self._answer, say=self.said.append, interactive=interactive)

    def _answer(self, question: str) -> str:
        self.asked.append(question)
        return self.answers.pop(0)


def resolve(tmp_path, answers: Answers, *, env=None, login=None, gpus=(), **kwargs):
    kwargs.setdefault("need_swarm", False)
    return resolve_client(
        tmp_path,
        env=env or {},
        prompts=answers.prompts(),
        login_token=lambda: login,
        list_gpus=lambda: list(gpus),
        **kwargs,
    )


def test_first_run_asks_saves_the_token_0600_and_not_again(tmp_path):
    answers = Answers("not a token", TYPED, "1")
    client = resolve(tmp_path, answers, gpus=TWO_GPUS)
    assert (client.token, client.token_source, client.config.gpu_index) == (TYPED, "typed", 1)
    assert any("hf_ followed by at least 8 letters or digits" in line for line in answers.said)
    secrets = ClientConfigStore(tmp_path).secrets_path
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert TYPED not in (tmp_path / "config.json").read_text()
    again = Answers()
    client = resolve(tmp_path, again, gpus=TWO_GPUS)
    assert (client.token, client.token_source, client.config.gpu_index) == (TYPED, "saved", 1)
    assert again.asked == []


def test_hf_token_env_wins_and_hf_login_token_is_used_only_once_confirmed(tmp_path):
    ClientConfigStore(tmp_path).save_token(TYPED)
    assert resolve(tmp_path, Answers(), env={"HF_TOKEN": ENV}, login=LOGIN).token == ENV
    fresh = tmp_path / "fresh"
    confirmed = Answers("y")
    client = resolve(fresh, confirmed, login=LOGIN)
    assert (client.token, client.token_source) == (LOGIN, "hf auth login")
    assert "hf auth login" in confirmed.asked[0]
    assert any("can often write" in line and "does not send one that can write" in line for line in confirmed.said)
    assert not ClientConfigStore(fresh).secrets_path.exists()  # not copied: hf keeps it
    declined = Answers("n", TYPED)  # declined: the user types another token
    assert resolve(tmp_path / "declined", declined, login=LOGIN).token == TYPED
    headless = dict(env={}, login_token=lambda: LOGIN, list_gpus=list, need_swarm=False)
    with pytest.raises(ClientConfigError, match="--use-hf-login-token"):
        resolve_client(tmp_path / "headless", prompts=Answers().prompts(interactive=False), **headless)
    flagged = resolve_client(
        tmp_path / "flagged", prompts=Answers().prompts(interactive=False), use_login_token=True, **headless
    )
    assert flagged.token == LOGIN


def test_reconfigure_asks_again(tmp_path):
    resolve(tmp_path, Answers(TYPED, "0"), gpus=TWO_GPUS)
    answers = Answers("hf_NewToken0000000000", "1")
    client = resolve(tmp_path, answers, gpus=TWO_GPUS, reconfigure=True)
    assert (client.token, client.config.gpu_index) == ("hf_NewToken0000000000", 1)
    assert len(answers.asked) == 2
    saved = json.loads(ClientConfigStore(tmp_path).secrets_path.read_text())
    assert saved["hf_token"] == "hf_NewToken0000000000"
    keep = Answers("", "")
    assert resolve(tmp_path, keep, gpus=TWO_GPUS, reconfigure=True).token == "hf_NewToken0000000000"


def test_overrides_and_bad_input_give_one_clear_error(tmp_path):
    client = resolve(
        tmp_path, Answers(), env={"HF_TOKEN": ENV}, swarm="https://auth.example:8470/", gpu=1, gpus=TWO_GPUS
    )
    assert (client.config.swarm_url, client.config.gpu_index) == ("https://auth.example:8470", 1)
    with pytest.raises(ClientConfigError, match="--gpu 5 does not exist: GPUs 0..1 are visible"):
        resolve(tmp_path, Answers(), env={"HF_TOKEN": ENV}, gpu=5, gpus=TWO_GPUS)
    with pytest.raises(ClientConfigError, match="not an http"):
        resolve(tmp_path, Answers(), env={"HF_TOKEN": ENV}, swarm="auth.example")
    with pytest.raises(ClientConfigError, match="set HF_TOKEN"):
        resolve_client(
            tmp_path / "none",
            env={},
            prompts=Answers().prompts(interactive=False),
            login_token=lambda: None,
            list_gpus=list,
        )
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ClientConfigError, match="run with --reconfigure"):
        resolve(tmp_path, Answers(), env={"HF_TOKEN": ENV})
    assert resolve(tmp_path, Answers(), env={"HF_TOKEN": ENV}, reconfigure=True).token == ENV


def test_default_config_dir_follows_xdg(tmp_path):
    assert default_config_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "agora"


def test_a_short_token_is_refused_with_the_rule_it_breaks(tmp_path):
    answers = Answers("hf_bogus", TYPED)
    assert resolve(tmp_path, answers).token == TYPED
    why, refusal = answers.said
    assert refusal == (
        "That is not a Hugging Face token: a token is hf_ followed by at least 8 letters or digits, and nothing else. "
        "Create one at https://huggingface.co/settings/tokens"
    )
    # the first prompt says why the token is needed, what it may do, where to make one and where it is kept
    assert "credits your work to a Hugging Face account" in why and "read-only" in why
    assert "https://huggingface.co/settings/tokens" in why and str(tmp_path / "secrets.json") in why


def test_no_saved_swarm_asks_for_its_address_and_saves_it(tmp_path):
    answers = Answers("auth.example", "https://auth.example:8470/")
    client = resolve(tmp_path, answers, env={"HF_TOKEN": ENV}, need_swarm=True)
    assert client.config.swarm_url == "https://auth.example:8470"
    assert len(answers.asked) == 2 and "auth service URL" in answers.asked[0]
    assert "operator publishes its address" in answers.said[0] and "is not an http(s) URL" in answers.said[1]
    again = Answers()
    assert (
        resolve(tmp_path, again, env={"HF_TOKEN": ENV}, need_swarm=True).config.swarm_url == "https://auth.example:8470"
    )
    assert again.asked == []


def test_no_swarm_without_a_terminal_says_what_to_pass(tmp_path):
    with pytest.raises(ClientConfigError, match="no swarm to join: pass --swarm URL"):
        resolve_client(
            tmp_path,
            env={"HF_TOKEN": ENV},
            prompts=Answers().prompts(interactive=False),
            login_token=lambda: None,
            list_gpus=lambda: [],
        )
