"""Held-out data: a fixed sample the trainers evaluate (forward passes only) and nobody trains on.

With ``eval.split`` set, the sample is the start of that split. Without one, a document is held out when the
hash of its text falls in the first ``eval.holdout_fraction`` of the hash range: the same documents on every
trainer and every run, whatever the shard, and the training streams skip them.
"""

from __future__ import annotations

import hashlib

import torch

from agora_client.config import RunConfig
from agora_client.data.sources import DataError, Shard, open_documents
from agora_client.data.tokenizer import RunTokenizer

_HASH_RANGE = 1 << 64


def is_held_out(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * _HASH_RANGE


def held_out_texts(config: RunConfig):
    spec, held_out = config.data, config.eval
    if held_out.split is not None:
        return open_documents(spec, Shard(0, 1), split=held_out.split)
    return (text for text in open_documents(spec, Shard(0, 1)) if is_held_out(text, held_out.holdout_fraction))


def held_out_sample(config: RunConfig, tokenizer: RunTokenizer) -> torch.Tensor:
    """[eval.sequences, seq_len + 1] int64: the held-out documents packed in order, the same on every call."""
    window, wanted = config.model.seq_len + 1, config.eval.sequences
    tokens: list[int] = []
    for text in held_out_texts(config):
        tokens.extend(tokenizer.encode(text))
        tokens.extend(tokenizer.document_end)
        if len(tokens) >= window * wanted:
            break
    count = min(wanted, len(tokens) // window)
    if count == 0:
        raise DataError(
            f"the held-out data of {config.data.source or 'the standard library'} holds less than one sequence: "
            "raise eval.holdout_fraction or name a held-out split (eval.split)"
        )
    return torch.tensor(tokens[: count * window], dtype=torch.int64).view(count, window)
