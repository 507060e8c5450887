"""`agora tokenizer train`: a byte-level BPE tokenizer trained with ``tokenizers`` on a run's data.

The demo's tokenizer (``data/tokenizers/demo-bpe-2k.json``) is made this way from the default corpus,
the Python standard library's source: ``agora tokenizer train --vocab-size 2048 --out demo-bpe-2k.json``.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from agora_client.config import DataConfig
from agora_client.data.sources import DataError, Shard, open_documents

END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2's pre-tokenizer and byte alphabet: any text encodes), id 0 = end of text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = sub.add_parser("train", help="train a byte-level BPE tokenizer on a data source")
    train.add_argument("--out", type=Path, required=True, help="the tokenizer JSON file to write")
    train.add_argument("--vocab-size", type=int, default=2048)
    train.add_argument(
        "--data", default=None, help="a data source as `trainer --data` takes it (default: the standard library)"
    )
    train.add_argument("--documents", type=int, default=0, help="train on the first N documents only (0: all)")


def run(args: argparse.Namespace) -> int:
    if args.out.exists():
        print(f"[ERROR] {args.out} exists; choose another --out")
        return 2
    try:
        texts = open_documents(DataConfig(source=args.data), Shard(0, 1))
        tokenizer = train_bpe(itertools.islice(texts, args.documents or None), args.vocab_size)
    except DataError as error:
        print(f"[ERROR] {error}")
        return 2
    tokenizer.save(str(args.out))
    print(f"[TOKENIZER] wrote {args.out}: {tokenizer.get_vocab_size()} tokens, {END_OF_TEXT} = id 0")
    return 0
