"""Training data: local corpora in three formats, shards that never share a sample, clear errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agora_client.trainer.data import DOCUMENT_SEPARATOR, DataError, SequenceStream, Shard, decode, documents

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 31  # a window is 32 tokens: each test document plus its separator fills exactly one window


def _document(index: int) -> str:
    """A unique 30-byte document: with the 2-byte separator it is exactly one sequence window."""
    text = f"document {index:04d} ".ljust(SEQ_LEN + 1 - len(DOCUMENT_SEPARATOR), "x")
    assert len(text.encode()) + len(DOCUMENT_SEPARATOR) == SEQ_LEN + 1
    return text


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text, "id": n}) + "\n" for n, text in enumerate(texts)))
    return path


def _one_pass(stream: SequenceStream, count: int) -> list[str]:
    sequences = stream.sequences()
    return [decode(next(sequences).tolist()) for _ in range(count)]


def test_two_shards_share_no_sequence_and_together_cover_the_corpus(tmp_path):
    texts = [_document(n) for n in range(101)]  # odd count: the shards differ in size
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", texts)
    whole = {text + DOCUMENT_SEPARATOR.decode() for text in texts}
    first = _one_pass(SequenceStream(str(corpus), SEQ_LEN, Shard(0, 2), seed=0), 51)
    second = _one_pass(SequenceStream(str(corpus), SEQ_LEN, Shard(1, 2), seed=1), 50)

    assert len(set(first)) == 51 and len(set(second)) == 50, "a sequence repeated within one pass of a shard"
    assert set(first).isdisjoint(second)
    assert set(first) | set(second) == whole


def test_a_shard_is_reshuffled_on_every_pass_but_keeps_its_documents(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [_document(n) for n in range(40)])
    passes = _one_pass(SequenceStream(str(corpus), SEQ_LEN, Shard(1, 2), seed=3, buffer_docs=8), 40)
    first, second = passes[:20], passes[20:]
    assert set(first) == set(second)
    assert first != second


def test_batches_are_microbatches_of_window_length(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [_document(n) for n in range(10)])
    batch = next(SequenceStream(str(corpus), SEQ_LEN, Shard(0, 1)).batches(4))
    assert tuple(batch.shape) == (4, SEQ_LEN + 1)
    assert int(batch.max()) < 256 and int(batch.min()) >= 0


def test_txt_jsonl_and_parquet_files_are_read(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file\nwith two lines")
    _write_jsonl(tmp_path / "b.jsonl", ["first json record", "second json record"])
    pq.write_table(pa.table({"text": ["parquet row one", "parquet row two"], "n": [1, 2]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("not,a,corpus\n")

    assert list(documents(str(tmp_path / "a.txt"))) == ["plain text file\nwith two lines"]
    assert list(documents(str(tmp_path / "c.parquet"))) == ["parquet row one", "parquet row two"]
    assert list(documents(str(tmp_path))) == [  # a folder: its files in name order
        "plain text file\nwith two lines",
        "first json record",
        "second json record",
        "parquet row one",
        "parquet row two",
    ]


def test_a_bad_jsonl_line_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:4 is not valid JSON"):
        list(documents(str(path)))
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r'broken\.jsonl:2 has no "text" string field'):
        list(documents(str(path)))


def test_a_parquet_file_without_a_text_column_is_refused(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r'has no "text" column \(columns: body\)'):
        list(documents(str(tmp_path / "t.parquet")))


def test_a_corpus_shorter_than_one_sequence_is_refused(tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(DataError, match="shorter than one sequence"):
        next(SequenceStream(str(tmp_path / "short.txt"), SEQ_LEN, Shard(0, 1)).sequences())


def test_a_shard_that_does_not_exist_is_refused():
    with pytest.raises(DataError, match="shard 2 does not exist among 2 trainers"):
        Shard(2, 2)


def test_a_hub_name_that_cannot_be_reached_names_data(monkeypatch):
    # A stand-in `datasets` module whose load_dataset raises what the real one raised on this offline
    # machine (ConnectionError after its retries), so the test does not depend on the network or its speed.
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"looks offline; pass local \.txt/\.jsonl/\.parquet files with --data PATH"):
        list(documents("someone/corpus"))


def _trainer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "agora_cli.py"), "trainer", "--seeds", "/ip4/127.0.0.1/tcp/9/p2p/none", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **(env or {})})


def test_the_trainer_refuses_a_bad_jsonl_with_one_error_before_joining(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    result = _trainer("--data", str(path))
    assert result.returncode == 2
    assert f"[ERROR] {path}:2 is not valid JSON" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_the_trainer_offline_with_a_hub_name_says_to_use_data():
    # Real `datasets`, in its offline mode: it raises the same ConnectionError an unreachable hub gives,
    # without waiting for network retries.
    result = _trainer("--data", "someone/corpus", env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[ERROR] could not stream 'someone/corpus'" in result.stdout
    assert "--data PATH" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_malformed_shard_is_refused_with_the_expected_form():
    from agora_client.trainer.main import _parse_shard

    assert _parse_shard("1/2") == Shard(1, 2)
    for text in ("3", "a/b", "1/2/3"):
        with pytest.raises(DataError, match=r"is not INDEX/COUNT; pass e\.g\. --shard 0/2"):
            _parse_shard(text)
