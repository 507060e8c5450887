"""First-run configuration of the contributor client, saved in the user's config dir.

Where: ``--config-dir``, else ``$XDG_CONFIG_HOME/agora``, else ``~/.config/agora``.
``config.json`` holds the swarm URL, the GPU choice and the upload cap (``--max-upload-mbit``, kept until
another is given; 0: none); the Hugging Face token, when the user
typed it, goes to ``secrets.json`` with mode 0600 (never into config.json, argv or logs).

Token, first found wins: ``HF_TOKEN`` in the environment; the token saved here; the token saved
by ``hf auth login`` (huggingface_hub) once the user confirms it (``--use-hf-login-token`` where nobody can be
asked); else the user is asked. ``--reconfigure`` asks again
(``HF_TOKEN`` still wins). The swarm (its auth service URL) is asked for when none was given or saved. The GPU is asked
for when NVML sees several and none was chosen.
"""

from __future__ import annotations

import getpass
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from agora_client.upload_cap import parse_cap_mbit

CONFIG_FILE = "config.json"
SECRETS_FILE = "secrets.json"
TOKEN_PAGE = "https://huggingface.co/settings/tokens"
_HF_TOKEN = re.compile(r"^hf_[A-Za-z0-9]{8,}$")
TOKEN_RULE = "a token is hf_ followed by at least 8 letters or digits, and nothing else"
# Said once before the first token prompt: why the swarm needs it, what it may do, where it goes and stays.
TOKEN_WHY = (
    "The swarm credits your work to a Hugging Face account: its auth service asks Hugging Face whose token this is, "
    "and nothing more. Give a read-only token (or a fine-grained one with no permission), made at "
    f"{TOKEN_PAGE}; the client refuses to send a token that can write. It is saved in {{path}}, readable by you alone."
)
# Said before asking whether to send the token of `hf auth login`: what it is, why it may be risky, what follows.
LOGIN_TOKEN_WHY = (
    "Found the Hugging Face token saved by `hf auth login`. It was made for your own tools and can often write to "
    "your repositories; the swarm only needs to learn your account. If you say yes, the client first asks Hugging "
    "Face what the token may do and does not send one that can write; say no (the default) to give a read-only "
    f"token instead, made at {TOKEN_PAGE}."
)
SWARM_WHY = "The swarm's operator publishes its address; the client reads the run it trains from there."
GPU_WHY = "Your worker holds one stage of the model on one GPU; choose which."
SWARM_HINT = "the address of the swarm's auth service, e.g. https://host:8470 (the swarm's operator publishes it)"
_MAX_ATTEMPTS = 3


class ClientConfigError(ValueError):
    """A client config that cannot be used; the message says what was wrong and what to do."""


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    swarm_url: str | None = None  # None: the runtime's default auth service
    gpu_index: int | None = None
    max_upload_mbit: float = 0.0  # the upload cap, Mbit/s; 0: none

    @field_validator("max_upload_mbit", mode="before")
    @classmethod
    def _upload_cap(cls, value: object) -> float:
        return parse_cap_mbit(value)


@dataclass(frozen=True)
class ResolvedClient:
    config: ClientConfig
    token: str = field(repr=False)
    token_source: str  # "HF_TOKEN", "saved", "hf auth login", "typed" or "kept"
    config_dir: Path


@dataclass
class Prompts:
    """How the client talks to the user; tests inject their own functions."""

    ask: Callable[[str], str] = input
    ask_secret: Callable[[str], str] = getpass.getpass
    say: Callable[[str], None] = print
    interactive: bool = True


def default_config_dir(env: Mapping[str, str] = os.environ) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "agora"


def validate_swarm_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ClientConfigError(
            f"--swarm {url!r} is not an http(s) URL: give the auth service address, e.g. https://host:8470"
        )
    return url.rstrip("/")


def looks_like_hf_token(token: str) -> bool:
    return bool(_HF_TOKEN.match(token))


def hf_login_token() -> str | None:
    """The token saved by ``hf auth login``, if any."""
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:  # a broken huggingface_hub install must not stop the client
        return None


class ClientConfigStore:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @property
    def config_path(self) -> Path:
        return self.directory / CONFIG_FILE

    @property
    def secrets_path(self) -> Path:
        return self.directory / SECRETS_FILE

    def _read_json(self, path: Path) -> dict | None:
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ClientConfigError(f"{path} is unreadable ({error}); fix it or run with --reconfigure") from None
        if not isinstance(data, dict):
            raise ClientConfigError(f"{path} must hold a JSON object; fix it or run with --reconfigure")
        return data

    def load(self) -> ClientConfig | None:
        data = self._read_json(self.config_path)
        if data is None:
            return None
        try:
            return ClientConfig.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            raise ClientConfigError(
                f"{self.config_path}: {'.'.join(map(str, first['loc']))}: {first['msg']}; fix it or run with "
                "--reconfigure"
            ) from None

    def save(self, config: ClientConfig) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config_path.write_text(config.model_dump_json(indent=2) + "\n", encoding="utf-8")

    def load_token(self) -> str | None:
        data = self._read_json(self.secrets_path) or {}
        token = data.get("hf_token")
        return token if isinstance(token, str) and token else None

    def save_token(self, token: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Created 0600 from the start (no window where another user could read it), and fixed if it existed.
        fd = os.open(self.secrets_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"hf_token": token}, handle)
            handle.write("\n")


def _ask_token(prompts: Prompts, current: str | None, saved_to: Path) -> str:
    if not prompts.interactive:
        raise ClientConfigError(
            "no Hugging Face token: set HF_TOKEN, run `hf auth login`, or start the client once in a "
            f"terminal ({TOKEN_PAGE})"
        )
    prompts.say(TOKEN_WHY.format(path=saved_to))
    keep = " (Enter keeps the current one)" if current else ""
    for _ in range(_MAX_ATTEMPTS):
        token = prompts.ask_secret(f"Hugging Face token{keep}: ").strip()
        if not token and current:
            return current
        if looks_like_hf_token(token):
            return token
        prompts.say(f"That is not a Hugging Face token: {TOKEN_RULE}. Create one at {TOKEN_PAGE}")
    raise ClientConfigError(f"no valid Hugging Face token after {_MAX_ATTEMPTS} tries; create one at {TOKEN_PAGE}")


def _login_token_confirmed(prompts: Prompts, use_login_token: bool) -> bool:
    """The token of ``hf auth login`` is often write-scoped and meant for the user's own tools: it goes to a swarm only
    when the user says so (``--use-hf-login-token``, or yes when asked)."""
    if use_login_token:
        return True
    if not prompts.interactive:
        raise ClientConfigError(
            "a token saved by `hf auth login` was found, but it is sent to a swarm only when you say so: pass "
            "--use-hf-login-token, or set HF_TOKEN to a read-only token"
        )
    prompts.say(LOGIN_TOKEN_WHY)
    answer = prompts.ask("Send the token saved by `hf auth login` to this swarm's auth service? [y/N]: ")
    return answer.strip().lower() in ("y", "yes")


def _ask_swarm(prompts: Prompts, current: str | None) -> str:
    if not prompts.interactive:
        raise ClientConfigError(f"no swarm to join: pass --swarm URL, {SWARM_HINT}")
    prompts.say(SWARM_WHY)
    keep = f" [{current}]" if current else ""
    for _ in range(_MAX_ATTEMPTS):
        answer = prompts.ask(f"Swarm to join: its auth service URL, e.g. https://host:8470{keep}: ").strip()
        if not answer and current:
            return current
        try:
            return validate_swarm_url(answer)
        except ClientConfigError as error:
            prompts.say(str(error).replace("--swarm ", "", 1))
    raise ClientConfigError(f"no valid swarm address after {_MAX_ATTEMPTS} tries; pass --swarm URL, {SWARM_HINT}")


def _ask_gpu(prompts: Prompts, devices: list, current: int | None) -> int:
    listing = "\n".join(
        f"  {device.index}: {device.name} ({device.memory_total / 2**30:.0f} GiB)" for device in devices
    )
    if not prompts.interactive:
        raise ClientConfigError(f"several GPUs are visible; choose one with --gpu N:\n{listing}")
    prompts.say(f"{GPU_WHY} GPUs on this machine:\n{listing}")
    default = current if current is not None else devices[0].index
    for _ in range(_MAX_ATTEMPTS):
        answer = prompts.ask(f"GPU to contribute [{default}]: ").strip()
        if not answer:
            return default
        if answer.isdigit() and int(answer) < len(devices):
            return int(answer)
        prompts.say(f"Type a number from 0 to {len(devices) - 1}.")
    raise ClientConfigError(f"no valid GPU choice after {_MAX_ATTEMPTS} tries; pass --gpu N")


def _list_gpus() -> list:
    from agora_client.system.gpu import GpuProbe

    probe = GpuProbe()
    try:
        return probe.devices()
    finally:
        probe.close()


def resolve_client(
    config_dir: Path,
    *,
    reconfigure: bool = False,
    swarm: str | None = None,
    gpu: int | None = None,
    env: Mapping[str, str] = os.environ,
    prompts: Prompts | None = None,
    login_token: Callable[[], str | None] = hf_login_token,
    list_gpus: Callable[[], list] = _list_gpus,
    need_swarm: bool = True,
    use_gpu: bool = True,
    use_login_token: bool = False,
    max_upload_mbit: float | None = None,
) -> ResolvedClient:
    """Load, complete (asking only what is missing) and save the client config; return it with the token.

    ``need_swarm=False`` (a replayed runtime in tests) does not ask for a swarm address; ``use_gpu=False``
    (``--cpu``) chooses no GPU and keeps the saved choice."""
    prompts = prompts or Prompts()
    store = ClientConfigStore(config_dir)
    previous, stored_token = _load_saved(store, reconfigure)
    swarm_url = validate_swarm_url(swarm) if swarm else (previous.swarm_url if previous else None)
    token, source = _resolve_token(store, prompts, env, login_token, stored_token, reconfigure, use_login_token)
    if need_swarm and (swarm_url is None or (reconfigure and not swarm and prompts.interactive)):
        swarm_url = _ask_swarm(prompts, swarm_url)
    saved_gpu_index = previous.gpu_index if previous else None
    gpu_index = _choose_gpu(prompts, list_gpus(), gpu, saved_gpu_index, reconfigure) if use_gpu else None
    saved_gpu = gpu_index if gpu is None and use_gpu else saved_gpu_index  # --gpu and --cpu are for this run only
    cap = (previous.max_upload_mbit if previous else 0.0) if max_upload_mbit is None else max_upload_mbit
    store.save(ClientConfig(swarm_url=swarm_url, gpu_index=saved_gpu, max_upload_mbit=cap))
    resolved = ClientConfig(swarm_url=swarm_url, gpu_index=gpu_index, max_upload_mbit=cap)
    return ResolvedClient(resolved, token, source, Path(config_dir))


def _load_saved(store: ClientConfigStore, reconfigure: bool) -> tuple[ClientConfig | None, str | None]:
    """The saved config and token; with ``reconfigure``, a broken file counts as none."""
    try:
        return store.load(), store.load_token()
    except ClientConfigError:
        if not reconfigure:
            raise
        return None, None  # --reconfigure starts over from a broken file


def _resolve_token(
    store: ClientConfigStore,
    prompts: Prompts,
    env: Mapping[str, str],
    login_token: Callable[[], str | None],
    stored_token: str | None,
    reconfigure: bool,
    use_login_token: bool = False,
) -> tuple[str, str]:
    """The token and where it came from: HF_TOKEN, saved, hf auth login (confirmed), else asked (and saved if typed)."""
    env_token = (env.get("HF_TOKEN") or "").strip()
    if env_token:
        return env_token, "HF_TOKEN"
    if stored_token and not reconfigure:
        return stored_token, "saved"
    logged_in = login_token()
    if not reconfigure and logged_in and _login_token_confirmed(prompts, use_login_token):
        return logged_in, "hf auth login"
    current = stored_token or (logged_in if use_login_token else None)
    token = _ask_token(prompts, current, store.secrets_path)
    source = "kept" if token == current else "typed"
    if source == "typed":
        store.save_token(token)
    return token, source


def _choose_gpu(prompts: Prompts, devices: list, gpu: int | None, saved: int | None, reconfigure: bool) -> int | None:
    """The GPU to use: ``--gpu`` if it exists, else the saved choice or the user's when several are visible."""
    if gpu is not None:
        if not 0 <= gpu < len(devices):
            found = f"GPUs 0..{len(devices) - 1} are visible" if devices else "no NVIDIA GPU is visible"
            raise ClientConfigError(f"--gpu {gpu} does not exist: {found}")
        return gpu
    if len(devices) > 1:
        valid = saved is not None and saved < len(devices)
        return saved if valid and not reconfigure else _ask_gpu(prompts, devices, saved if valid else None)
    return 0 if devices else None
