"""Training data: a byte-level tokenizer, corpora, and shards that never overlap between trainers.

The default corpus is the Python standard library's own source, present on every machine that
runs this. ``--data`` takes local .txt, .jsonl (a "text" field per line) or .parquet (a "text"
column) files or folders, or a Hugging Face dataset name streamed with ``datasets``.
Documents are assigned to trainers by index (document i goes to trainer i mod n), so two trainers
never see the same sample.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

VOCAB_SIZE = 256
DOCUMENT_SEPARATOR = b"\n\n"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")


class DataError(ValueError):
    """The data source cannot be used; the message says why and what to pass instead."""


def encode(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of the text, ids 0..255."""
    return list(text.encode("utf-8"))


def decode(tokens: Iterable[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise DataError(f"shard {self.index} does not exist among {self.count} trainers")

    def owns(self, document_index: int) -> bool:
        return document_index % self.count == self.index


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py") if "site-packages" not in path.parts)


def local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise DataError(f"{path} holds no {', '.join(LOCAL_SUFFIXES)} files")
        return files
    if path.suffix not in LOCAL_SUFFIXES:
        raise DataError(f"{path}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)}")
    return [path]


def _read_documents(path: Path) -> Iterator[str]:
    if path.suffix == ".py" or path.suffix == ".txt":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"{path}:{number} is not valid JSON") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f'{path}:{number} has no "text" string field')
                yield record["text"]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise DataError(f'{path} has no "text" column (columns: {", ".join(table.column_names)})')
        yield from (text for text in table.column("text").to_pylist() if isinstance(text, str))


def hub_documents(name: str, split: str = "train") -> Iterator[str]:
    """Stream a Hugging Face dataset's "text" field; offline, fail with a message that names --data."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"streaming {name!r} needs the `datasets` package; or pass local files with --data PATH") from None
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
        for record in stream:
            yield record["text"]
    except (ConnectionError, OSError) as error:
        raise DataError(
            f"could not stream {name!r} from the Hugging Face hub ({error.__class__.__name__}): this machine looks "
            "offline; pass local .txt/.jsonl/.parquet files with --data PATH"
        ) from None


def documents(source: str | None) -> Iterator[str]:
    """Documents of a source in a fixed order: None = the standard library, a path, or a hub dataset name."""
    if source is None:
        for path in stdlib_files():
            yield from _read_documents(path)
    elif Path(source).expanduser().exists() or Path(source).suffix in LOCAL_SUFFIXES:
        if not Path(source).expanduser().exists():
            raise DataError(f"{source} does not exist")
        for path in local_files(source):
            yield from _read_documents(path)
    else:
        yield from hub_documents(source)


class SequenceStream:
    """Endless fixed-length token sequences from this trainer's shard, reshuffled every pass."""

    def __init__(self, source: str | None, seq_len: int, shard: Shard, *, seed: int = 0, buffer_docs: int = 256):
        self.source, self.window, self.shard, self.seed = source, seq_len + 1, shard, seed
        self.buffer_docs = buffer_docs

    def _shard_documents(self) -> Iterator[tuple[int, str]]:
        for index, text in enumerate(documents(self.source)):
            if self.shard.owns(index):
                yield index, text

    def sequences(self) -> Iterator[torch.Tensor]:
        """int64 tensors of seq_len + 1 tokens (inputs and shifted labels come from one window)."""
        for data_pass in range(1 << 30):
            rng = random.Random(self.seed * 1_000_003 + data_pass)
            produced = False
            buffer: list[int] = []
            for chunk in _shuffled_in_blocks(self._shard_documents(), self.buffer_docs, rng):
                buffer.extend(chunk)
                while len(buffer) >= self.window:
                    produced = True
                    yield torch.tensor(buffer[: self.window], dtype=torch.int64)
                    del buffer[: self.window]
            if not produced:
                raise DataError(f"this trainer's shard of {self.source or 'the standard library'} is shorter than one sequence")

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """[batch, seq_len + 1] int64 microbatches."""
        sequences = self.sequences()
        while True:
            yield torch.stack([next(sequences) for _ in range(batch_size)])


def _shuffled_in_blocks(items: Iterator[tuple[int, str]], block: int, rng: random.Random) -> Iterator[list[int]]:
    """Shuffle documents within blocks of ``block``: streaming sources cannot be shuffled whole."""
    pending: list[str] = []
    for _, text in items:
        pending.append(text)
        if len(pending) == block:
            rng.shuffle(pending)
            yield from (encode(doc) + list(DOCUMENT_SEPARATOR) for doc in pending)
            pending = []
    rng.shuffle(pending)
    yield from (encode(doc) + list(DOCUMENT_SEPARATOR) for doc in pending)
