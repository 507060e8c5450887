"""Fixed-length training sequences from a trainer's shard: a seeded shuffle buffer, packing, a resumable position.

Documents enter a buffer of ``data.shuffle_buffer``; once it is full each new document takes the place of a
random one, which leaves for packing (the buffer is flushed in shuffled order at the end of a pass). Packing
concatenates documents, each followed by the tokenizer's end-of-document ids, and cuts windows of
``seq_len + 1`` tokens (inputs and shifted labels). ``position()`` is everything needed to continue with the
next token: the pass, the ``datasets`` stream's own state, the texts drawn but not yet packed (the buffer and
the rest of the batch being tokenized), the random generator and the tokens packed but not yet cut. A stream built with
that position yields exactly what the first one would have.

Documents held out for evaluation (``heldout.py``) never enter the stream.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Callable, Iterator

import torch

from agora_client.config import DataConfig, EvalConfig
from agora_client.data.heldout import is_held_out
from agora_client.data.sources import DataError, Shard, open_split, shard_of, texts_of
from agora_client.data.tokenizer import RunTokenizer

POSITION_VERSION = 1
ENCODE_BATCH = 64  # documents tokenized together (the tokenizers backend spreads a batch over threads)...
ENCODE_BATCH_CHARS = 1 << 18  # ...or fewer, long ones: the batch's rest is part of the saved position


class TokenStream:
    def __init__(
        self,
        spec: DataConfig,
        held_out: EvalConfig,
        tokenizer: RunTokenizer,
        seq_len: int,
        shard: Shard,
        *,
        seed: int = 0,
        position: dict[str, Any] | None = None,
    ):
        self.spec, self.held_out, self.tokenizer, self.window, self.shard = (
            spec,
            held_out,
            tokenizer,
            seq_len + 1,
            shard,
        )
        self.seed = seed
        self.pass_index = 0
        self.rng = random.Random(self._pass_seed(0))
        self.buffer: list[tuple[str, list[int]]] = []
        self.pending: deque[tuple[str, list[int]]] = deque()  # drawn and tokenized, not yet in the buffer
        self.carry: list[int] = []
        self.source_state: dict[str, Any] | None = None
        self.sequences_out = 0
        self._dataset = None
        if position is not None:
            self._restore(position)

    def _pass_seed(self, pass_index: int) -> int:
        return (self.seed * 1_000_003 + self.shard.index) * 1_000_003 + pass_index

    def position(self) -> dict[str, Any]:
        """JSON-ready: where the next sequence starts."""
        return {
            "v": POSITION_VERSION,
            "shard": str(self.shard),
            "pass": self.pass_index,
            "sequences": self.sequences_out,
            "source": self.source_state,
            "buffer": [text for text, _ in self.buffer],
            "pending": [text for text, _ in self.pending],
            "carry": list(self.carry),
            "rng": _rng_to_json(self.rng),
            "tokenizer_sha256": self.tokenizer.sha256,
            "data": self._data_identity(),
        }

    def _data_identity(self) -> dict[str, Any]:
        """What a position is a position in: the source as named, and how documents are drawn from it."""
        return self.spec.model_dump(mode="json") | {"seed": self.seed}

    def _restore(self, position: dict[str, Any]) -> None:
        if position.get("v") != POSITION_VERSION or position.get("shard") != str(self.shard):
            raise DataError(
                f"the saved data position is for shard {position.get('shard')}, not {self.shard}: "
                "resume with as many trainers as the run had"
            )
        if position.get("tokenizer_sha256") != self.tokenizer.sha256:
            raise DataError("the saved data position was cut with another tokenizer than the run's")
        if position.get("data") != self._data_identity():
            raise DataError(
                f"the saved data position is in other data ({position.get('data')}) than this trainer reads "
                f"({self._data_identity()}): resume with the data the run had"
            )
        self.pass_index, self.sequences_out = int(position["pass"]), int(position["sequences"])
        self.source_state = position["source"]
        self.buffer = self._tokenized(position["buffer"])
        self.pending = deque(self._tokenized(position["pending"]))
        self.carry = [int(token) for token in position["carry"]]
        self.rng.setstate(_rng_from_json(position["rng"]))

    def _tokenized(self, texts: list[str]) -> list[tuple[str, list[int]]]:
        return list(zip(texts, self.tokenizer.encode_batch(list(texts)), strict=True))

    def sequences(self) -> Iterator[torch.Tensor]:
        """Endless int64 windows of seq_len + 1 tokens; a new pass over the shard starts when one ends."""
        while True:
            produced = False
            for window in self._one_pass():
                produced = True
                yield window
            if not produced and self.pass_index == 0 and self.sequences_out == 0:
                raise DataError(
                    f"this trainer's shard of {self.spec.source or 'the standard library'} is shorter than one sequence"
                )
            self.pass_index += 1
            self.rng = random.Random(self._pass_seed(self.pass_index))
            self.source_state = None

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """[batch, seq_len + 1] int64 microbatches."""
        sequences = self.sequences()
        while True:
            yield torch.stack([next(sequences) for _ in range(batch_size)])

    def _one_pass(self) -> Iterator[torch.Tensor]:
        yield from self._drain()  # the rest of a batch drawn before a restored position
        dataset = shard_of(open_split(self.spec, self.spec.split), self.shard)
        if self.source_state is not None:
            dataset.load_state_dict(self.source_state)
        texts = texts_of(dataset, self.spec)
        for batch in _batched(self._training_texts(texts), lambda: self._note_source(dataset)):
            self.pending.extend(self._tokenized(batch))
            yield from self._drain()
        self.rng.shuffle(self.buffer)
        for _, ids in self.buffer:
            self._pack(ids)
        self.buffer = []
        yield from self._cut()

    def _drain(self) -> Iterator[torch.Tensor]:
        """Documents enter the buffer one at a time, windows cut after each: the carry stays short."""
        while self.pending:
            self._admit(*self.pending.popleft())
            yield from self._cut()

    def _note_source(self, dataset) -> None:
        self.source_state = dataset.state_dict()

    def _training_texts(self, texts: Iterator[str]) -> Iterator[str]:
        if self.held_out.split is not None:
            return texts  # the held-out documents are a split of their own
        return (text for text in texts if not is_held_out(text, self.held_out.holdout_fraction))

    def _admit(self, text: str, ids: list[int]) -> None:
        if len(self.buffer) < self.spec.shuffle_buffer:
            self.buffer.append((text, ids))
            return
        slot = self.rng.randrange(len(self.buffer))
        self._pack(self.buffer[slot][1])
        self.buffer[slot] = (text, ids)

    def _pack(self, ids: list[int]) -> None:
        self.carry.extend(ids)
        self.carry.extend(self.tokenizer.document_end)

    def _cut(self) -> Iterator[torch.Tensor]:
        while len(self.carry) >= self.window:
            window = torch.tensor(self.carry[: self.window], dtype=torch.int64)
            del self.carry[: self.window]
            self.sequences_out += 1
            yield window


def _batched(texts: Iterator[str], after_batch: Callable[[], None]) -> Iterator[list[str]]:
    """Lists of up to ENCODE_BATCH texts or ENCODE_BATCH_CHARS characters; ``after_batch`` runs once a batch is
    drawn, before it is handed on."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_BATCH_CHARS:
            after_batch()
            yield batch
            batch, chars = [], 0
    if batch:
        after_batch()
        yield batch


def _rng_to_json(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _rng_from_json(data: list) -> tuple:
    version, state, gauss = data
    return version, tuple(state), gauss
