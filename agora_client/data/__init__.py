"""A run's data: its tokenizer (``tokenizer``), where documents come from (``sources``), the packed and resumable
training stream (``stream``) and the held-out sample (``heldout``); ``agora tokenizer train`` makes a BPE tokenizer."""

from .heldout import held_out_sample
from .sources import DataError, Shard
from .stream import TokenStream
from .tokenizer import RunTokenizer, TokenizerError, load_run_tokenizer

__all__ = [
    "DataError",
    "RunTokenizer",
    "Shard",
    "TokenStream",
    "TokenizerError",
    "held_out_sample",
    "load_run_tokenizer",
]
