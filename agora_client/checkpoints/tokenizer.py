"""Tokenizer files for the byte-level tokenizer the trainers use (token id = UTF-8 byte value).

Written as a ``tokenizers`` BPE model with no merges over the 256 byte symbols, behind the ByteLevel
pre-tokenizer and decoder: ``AutoTokenizer.from_pretrained`` loads it without custom code and
encodes any text to exactly its UTF-8 bytes, the ids ``agora_client.trainer.data.encode`` produces.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES = 256
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def byte_symbols() -> list[str]:
    """The printable character the ByteLevel pre-tokenizer maps each byte to (GPT-2's table), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(BYTES):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(BYTES + extra)
            extra += 1
    return [symbols[byte] for byte in range(BYTES)]


def write_tokenizer(directory: Path, model_max_length: int) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns the file names."""
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": _BYTE_LEVEL,
        "post_processor": None,
        "decoder": _BYTE_LEVEL,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {symbol: byte for byte, symbol in enumerate(byte_symbols())},
            "merges": [],
        },
    }
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (Path(directory) / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1), encoding="utf-8")
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return ["tokenizer.json", "tokenizer_config.json"]
