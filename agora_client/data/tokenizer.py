"""The run's tokenizer: one ``tokenizers`` JSON file, named by the run config, pinned by its sha256.

``tokenizer.source`` in the run config is one of:
  ``bytes``                      byte-level ids 0..255 (for tests where the tokenizer does not matter)
  ``<name>.json``                a file: a path, or a file shipped in agora_client/data/tokenizers
  ``https://...``                a URL
  ``<org>/<repo>[@<revision>]``  a Hugging Face hub repo's tokenizer.json, fetched with huggingface_hub

Trainers, the auth service, ``describe`` and ``export`` load it here; contributors get the same bytes from
the auth service and check them against the sha256 the run description carries (``from_served``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from agora_client.config import RunConfig, TokenizerConfig
from agora_client.data.byte_tokenizer import byte_tokenizer_json

BYTES = "bytes"
BYTE_DOCUMENT_END = b"\n\n"  # 256 ids leave no room for an end-of-document token: documents end with a blank line
MAX_TOKENIZER_BYTES = 64 << 20  # Llama 3's tokenizer.json is 9 MB
HUB_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """The run's tokenizer cannot be used; the message says which and why."""


class TokenizerUnavailable(TokenizerError):
    """The tokenizer file could not be read or fetched (missing file, network, hub): nothing was checked yet."""


@dataclass(frozen=True)
class RunTokenizer:
    """Text to ids and back, with the end-of-document ids that separate packed documents."""

    source: str
    sha256: str  # of the JSON file
    content: bytes  # the JSON file, as the auth service serves it and export writes it
    backend: Tokenizer
    eos_token: str | None  # None for bytes, whose documents end with a blank line
    document_end: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once: the ``tokenizers`` backend encodes them in parallel threads."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def sha256_of(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def load_run_tokenizer(config: RunConfig) -> RunTokenizer:
    """The tokenizer the run config names, checked against its pin and the model's vocabulary."""
    spec = config.tokenizer
    content = byte_tokenizer_json() if spec.source == BYTES else _read_source(spec.source)
    return _checked(spec, content, config.model.vocab_size, where=spec.source)


def from_served(config: RunConfig, content: bytes, sha256: str, where: str) -> RunTokenizer:
    """The tokenizer an auth service served: its bytes must hash to what the run description says."""
    if sha256_of(content) != sha256:
        raise TokenizerError(
            f"the tokenizer from {where} has sha256 {sha256_of(content)[:16]}..., but the run description says "
            f"{sha256[:16]}...: it was altered or truncated on the way; try again, or tell the swarm's operator"
        )
    return _checked(config.tokenizer, content, config.model.vocab_size, where=where)


def _checked(spec: TokenizerConfig, content: bytes, vocab_size: int, where: str) -> RunTokenizer:
    digest = sha256_of(content)
    if spec.sha256 is not None and digest != spec.sha256:
        raise TokenizerError(
            f"the tokenizer {where} has sha256 {digest}, but the run config pins {spec.sha256}: "
            "it is not the file this run was set up with"
        )
    try:
        backend = Tokenizer.from_str(content.decode("utf-8"))
    except Exception as error:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{where} is not a tokenizers JSON file: {error}") from None
    if spec.source == BYTES:
        tokenizer = RunTokenizer(BYTES, digest, content, backend, None, tuple(BYTE_DOCUMENT_END))
    else:
        eos_token = _eos_token(backend, spec, where)
        tokenizer = RunTokenizer(spec.source, digest, content, backend, eos_token, (backend.token_to_id(eos_token),))
    if tokenizer.vocab_size != vocab_size:
        raise TokenizerError(
            f"the tokenizer {where} has {tokenizer.vocab_size:,} tokens but model.vocab_size is {vocab_size:,}: "
            "set model.vocab_size to the tokenizer's size, or name the tokenizer this model was built for"
        )
    return tokenizer


def _eos_token(backend: Tokenizer, spec: TokenizerConfig, where: str) -> str:
    if spec.eos_token is None:
        raise TokenizerError(f"tokenizer.eos_token is not set: name the token of {where} that ends a document")
    if backend.token_to_id(spec.eos_token) is None:
        raise TokenizerError(f"the tokenizer {where} has no token {spec.eos_token!r} (tokenizer.eos_token)")
    return spec.eos_token


def _read_source(source: str) -> bytes:
    if source.startswith(("https://", "http://")):
        return _download(source)
    if source.endswith(".json"):
        return _read_file(source)
    return _read_hub(source)


def shipped_path(name: str) -> Path:
    return Path(str(resources.files("agora_client") / "data" / "tokenizers" / name))


def _read_file(source: str) -> bytes:
    for path in (Path(source).expanduser(), shipped_path(source)):
        if path.is_file():
            return path.read_bytes()
    raise TokenizerUnavailable(f"tokenizer file {source} not found (nor shipped in {shipped_path('')})")


def _download(url: str) -> bytes:
    try:
        with httpx.stream("GET", url, timeout=30.0, follow_redirects=True) as response:
            if response.status_code != 200:
                raise TokenizerUnavailable(f"{url} answered HTTP {response.status_code}; check tokenizer.source")
            content = b""
            for chunk in response.iter_bytes():
                content += chunk
                if len(content) > MAX_TOKENIZER_BYTES:
                    raise TokenizerError(f"{url} is larger than {MAX_TOKENIZER_BYTES >> 20} MiB: not a tokenizer file")
            return content
    except httpx.HTTPError as error:
        raise TokenizerUnavailable(
            f"could not download the tokenizer {url} ({type(error).__name__}); check the URL and network"
        ) from None


def _read_hub(source: str) -> bytes:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, revision = source.partition("@")
    try:
        return Path(hf_hub_download(repo, HUB_FILE, revision=revision or None)).read_bytes()
    except RepositoryNotFoundError:
        raise TokenizerUnavailable(
            f"no Hugging Face repo {repo!r} (or it is gated: log in with `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError:
        raise TokenizerUnavailable(
            f"could not fetch {HUB_FILE} of {repo!r} from the Hugging Face hub: this machine looks offline and has no "
            "cached copy; name a local tokenizer file or URL in tokenizer.source"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise TokenizerUnavailable(
            f"could not fetch {HUB_FILE} of {repo!r} from the Hugging Face hub: {error}"
        ) from None


def describe_tokenizer(tokenizer: RunTokenizer) -> dict:
    """What ``describe`` and the run description say about it."""
    return {
        "source": tokenizer.source,
        "sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "eos_token": tokenizer.eos_token,
    }


def tokenizer_config_json(tokenizer: RunTokenizer, model_max_length: int) -> str:
    """transformers' tokenizer_config.json for an export: the fast tokenizer with its end-of-document token."""
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.eos_token is not None:
        settings["eos_token"] = tokenizer.eos_token
    return json.dumps(settings, indent=2)
