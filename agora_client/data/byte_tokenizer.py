"""The byte-level tokenizer as a ``tokenizers`` JSON file: token id = UTF-8 byte value.

A BPE model with no merges over the 256 byte symbols, behind the ByteLevel pre-tokenizer and decoder:
``tokenizers`` and ``AutoTokenizer.from_pretrained`` encode any text to exactly its UTF-8 bytes.
"""

from __future__ import annotations

import json

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


def byte_tokenizer_json() -> bytes:
    """The tokenizer.json of the byte-level tokenizer (the same bytes every time: its sha256 is stable)."""
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
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: byte for byte, symbol in enumerate(byte_symbols())},
            "merges": [],
        },
    }
    return json.dumps(tokenizer, ensure_ascii=False, indent=1).encode("utf-8")
