"""The run's tokenizer: named by the run config, pinned by sha256, its vocabulary checked against the model's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from agora_client.config import load_config
from agora_client.data.tokenizer import TokenizerError, from_served, load_run_tokenizer, sha256_of, shipped_path
from agora_client.data.tokenizer_training import END_OF_TEXT, train_bpe

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["Grüße, world!\n", "def f(x):\n    return x ** 2  # 平方\n", "  \t\n\n  trailing spaces   ", "😀 emoji"]


@pytest.mark.parametrize("preset_tokenizer", ["demo-bpe", "bytes"])
def test_tokenizer_round_trip(preset_tokenizer):
    overrides = (
        {}
        if preset_tokenizer == "demo-bpe"
        else {"model": {"vocab_size": 256}, "tokenizer": {"source": "bytes", "sha256": None}}
    )
    tokenizer = load_run_tokenizer(load_config("tiny", overrides))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert all(0 <= token < tokenizer.vocab_size for token in ids)
    if preset_tokenizer == "bytes":
        assert tokenizer.encode("Grüße") == list("Grüße".encode("utf-8"))
    else:
        assert len(tokenizer.encode("def __init__(self):\n        return None\n")) < 20  # merges, not bytes
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(text) for text in TEXTS]


def test_tokenizer_the_demo_tokenizer_is_small_and_pinned():
    config = load_config("tiny")
    path = shipped_path(config.tokenizer.source)
    assert path.stat().st_size < 256 * 1024
    assert sha256_of(path.read_bytes()) == config.tokenizer.sha256
    assert load_run_tokenizer(config).vocab_size == config.model.vocab_size == 2048


def test_tokenizer_a_sha256_mismatch_is_refused(tmp_path):
    config = load_config("tiny", {"tokenizer": {"sha256": "0" * 64}})
    with pytest.raises(
        TokenizerError, match=f"has sha256 {load_config('tiny').tokenizer.sha256}, but the run config pins 0000"
    ):
        load_run_tokenizer(config)
    served = shipped_path("demo-bpe-2k.json").read_bytes()
    tampered = served.replace(b'"return"', b'"retvrn"')
    assert tampered != served
    with pytest.raises(TokenizerError, match="altered or truncated on the way"):
        from_served(load_config("tiny"), tampered, sha256_of(served), "http://auth/v1/tokenizer")
    assert from_served(load_config("tiny"), served, sha256_of(served), "auth").encode("x = 1") == load_run_tokenizer(
        load_config("tiny")
    ).encode("x = 1")


def test_tokenizer_a_vocab_mismatch_is_refused_with_both_numbers():
    with pytest.raises(TokenizerError, match=r"has 2,048 tokens but model.vocab_size is 4,096"):
        load_run_tokenizer(load_config("tiny", {"model": {"vocab_size": 4096}}))


def test_tokenizer_file_url_and_missing_eos(tmp_path):
    tokenizer = train_bpe(["alpha beta gamma " * 50, "delta epsilon " * 50], vocab_size=300)
    path = tmp_path / "mine.json"
    tokenizer.save(str(path))
    size = tokenizer.get_vocab_size()
    config = load_config("tiny", {"model": {"vocab_size": size}, "tokenizer": {"source": str(path), "sha256": None}})
    loaded = load_run_tokenizer(config)
    assert (
        loaded.document_end == (0,)
        and loaded.eos_token == END_OF_TEXT
        and loaded.sha256 == sha256_of(path.read_bytes())
    )
    with pytest.raises(TokenizerError, match="has no token '</s>'"):
        load_run_tokenizer(
            load_config(
                "tiny",
                {
                    "model": {"vocab_size": size},
                    "tokenizer": {"source": str(path), "sha256": None, "eos_token": "</s>"},
                },
            )
        )
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="is not a tokenizers JSON file"):
        load_run_tokenizer(
            load_config("tiny", {"tokenizer": {"source": str(tmp_path / "broken.json"), "sha256": None}})
        )


def test_tokenizer_the_8b_preset_names_a_128256_token_tokenizer_and_offline_says_so(hub_offline):
    config = load_config("8b")
    assert config.model.vocab_size == 128_256 and config.tokenizer.source == "meta-llama/Meta-Llama-3-8B"
    assert config.tokenizer.eos_token == "<|end_of_text|>"
    with pytest.raises(TokenizerError, match=r"'meta-llama/Meta-Llama-3-8B'.*looks offline"):
        load_run_tokenizer(config)


def test_tokenizer_train_command_writes_a_loadable_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(5):
        (corpus / f"{index}.txt").write_text(f"document {index} says hello to the tokenizer trainer\n" * 30)
    command = [
        sys.executable,
        str(REPO / "agora_cli.py"),
        "tokenizer",
        "train",
        "--data",
        str(corpus),
        "--vocab-size",
        "300",
        "--out",
        str(tmp_path / "t.json"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[TOKENIZER] wrote" in result.stdout
    size = Tokenizer.from_file(str(tmp_path / "t.json")).get_vocab_size()  # a small corpus may run out of merges first
    assert f"{size} tokens" in result.stdout and 256 < size <= 300
    config = load_config(
        "tiny", {"model": {"vocab_size": size}, "tokenizer": {"source": str(tmp_path / "t.json"), "sha256": None}}
    )
    assert load_run_tokenizer(config).encode("hello") != list(b"hello")
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert again.returncode == 2 and "exists" in again.stdout
