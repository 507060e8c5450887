"""The run's data: local files and hub-like datasets read through ``datasets``, shards that share nothing and
cover everything, packing with the end-of-document token, held-out documents kept out, a token-exact resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agora_client.config import DataConfig, EvalConfig, load_config
from agora_client.data.heldout import held_out_sample, is_held_out
from agora_client.data.sources import DataError, Shard, open_documents
from agora_client.data.stream import TokenStream
from agora_client.data.tokenizer import load_run_tokenizer

REPO = Path(__file__).resolve().parents[1]
BYTES = load_run_tokenizer(
    load_config("tiny", {"model": {"vocab_size": 256}, "tokenizer": {"source": "bytes", "sha256": None}})
)
BPE = load_run_tokenizer(load_config("tiny"))
NO_HOLDOUT = EvalConfig(split="validation")  # held-out data comes from a split: the training stream filters nothing
WHOLE = Shard(0, 1)  # one shard: every document
SEQ_LEN = 31  # a window is 32 byte tokens: each test document plus its blank line fills exactly one


def _document(index: int) -> str:
    """A unique 30-byte document: with the 2-byte end of document it is exactly one window."""
    return f"document {index:04d} ".ljust(SEQ_LEN - 1, "x")


def _hub_like(root: Path, texts: list[str], files: int = 4, field: str = "content") -> Path:
    """A folder laid out like a hub dataset repo: subset "sample" with train and validation parquet files."""
    (root / "sample").mkdir(parents=True)
    for part in range(files):
        rows = texts[part::files]
        pq.write_table(
            pa.table({field: rows, "id": list(range(len(rows)))}), root / "sample" / f"train-{part:05d}.parquet"
        )
    pq.write_table(pa.table({field: ["held out " * 20], "id": [0]}), root / "sample" / "validation-00000.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample\n  data_files:\n  - split: train\n    path: sample/train-*.parquet\n"
        "  - split: validation\n    path: sample/validation-*.parquet\n---\n"
    )
    return root


def _stream(spec: DataConfig, shard: Shard = WHOLE, *, tokenizer=BYTES, held_out=NO_HOLDOUT, seed=0, position=None):
    return TokenStream(spec, held_out, tokenizer, SEQ_LEN, shard, seed=seed, position=position)


def _texts(stream: TokenStream, count: int) -> list[str]:
    sequences = stream.sequences()
    return [BYTES.decode(next(sequences).tolist()) for _ in range(count)]


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "id": n}) + "\n" for n, text in enumerate(texts)))
    return path


def test_dataset_hub_like_subset_and_text_field_are_read_through_load_dataset(tmp_path):
    texts = [_document(n) for n in range(12)]
    spec = DataConfig(source=str(_hub_like(tmp_path / "hub", texts)), subset="sample", text_field="content")
    assert sorted(open_documents(spec, Shard(0, 1))) == sorted(texts)
    assert list(open_documents(spec, Shard(0, 1), split="validation")) == ["held out " * 20]


@pytest.mark.parametrize("files", [4, 3], ids=["file-level", "example-level"])
def test_dataset_two_trainers_shards_are_disjoint_and_cover_the_dataset(tmp_path, files):
    texts = [_document(n) for n in range(101)]  # odd count: the shards differ in size
    spec = DataConfig(
        source=str(_hub_like(tmp_path / "hub", texts, files)), subset="sample", text_field="content", shuffle_buffer=8
    )
    documents = [list(open_documents(spec, Shard(index, 2))) for index in range(2)]
    assert set(documents[0]).isdisjoint(documents[1]) and sorted(documents[0] + documents[1]) == sorted(texts)
    counts = [len(part) for part in documents]
    windows = [_texts(_stream(spec, Shard(index, 2), seed=index), count) for index, count in enumerate(counts)]
    whole = {text + "\n\n" for text in texts}
    assert all(len(set(part)) == len(part) for part in windows), "a document repeated within one pass of a shard"
    assert set(windows[0]).isdisjoint(windows[1]) and set(windows[0]) | set(windows[1]) == whole


def test_dataset_missing_field_subset_and_split_list_what_exists(tmp_path):
    root = _hub_like(tmp_path / "hub", [_document(n) for n in range(4)])
    with pytest.raises(DataError, match=r"no text field 'text'; fields: content, id"):
        list(open_documents(DataConfig(source=str(root), subset="sample"), Shard(0, 1)))
    with pytest.raises(DataError, match=r"no subset 'nope'.*sample"):
        list(open_documents(DataConfig(source=str(root), subset="nope", text_field="content"), Shard(0, 1)))
    with pytest.raises(DataError, match=r"no split 'test'; splits: .*train.*validation"):
        list(
            open_documents(
                DataConfig(source=str(root), subset="sample", split="test", text_field="content"), Shard(0, 1)
            )
        )


def test_dataset_txt_jsonl_and_parquet_files_are_read(tmp_path):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("plain text file\nwith two lines")
    (tmp_path / "txt" / "b.txt").write_text("second file")
    _write_jsonl(tmp_path / "b.jsonl", ["first json record", "second json record"], field="body")
    pq.write_table(pa.table({"text": ["parquet row one", "parquet row two"], "n": [1, 2]}), tmp_path / "c.parquet")

    assert list(open_documents(DataConfig(source=str(tmp_path / "txt")), Shard(0, 1))) == [
        "plain text file\nwith two lines",
        "second file",
    ]  # a .txt file is one document
    assert list(open_documents(DataConfig(source=str(tmp_path / "b.jsonl"), text_field="body"), Shard(0, 1))) == [
        "first json record",
        "second json record",
    ]
    assert list(open_documents(DataConfig(source=str(tmp_path / "c.parquet")), Shard(0, 1))) == [
        "parquet row one",
        "parquet row two",
    ]


def test_dataset_bad_input_gets_one_clear_error(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"broken\.jsonl: a record could not be read"):
        list(open_documents(DataConfig(source=str(broken)), Shard(0, 1)))
    with pytest.raises(DataError, match="does not exist"):
        list(open_documents(DataConfig(source=str(tmp_path / "missing.parquet")), Shard(0, 1)))
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(DataError, match="shorter than one sequence"):
        next(_stream(DataConfig(source=str(tmp_path / "short.txt"))).sequences())
    with pytest.raises(DataError, match="shard 2 does not exist among 2 trainers"):
        Shard(2, 2)


def test_dataset_documents_are_packed_with_the_end_of_document_token(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", ["def first():\n    return 1\n", "class Second:\n    pass\n"] * 20)
    stream = TokenStream(DataConfig(source=str(corpus), shuffle_buffer=1), NO_HOLDOUT, BPE, 63, Shard(0, 1))
    window = next(stream.sequences()).tolist()
    eos = BPE.backend.token_to_id("<|endoftext|>")
    assert BPE.document_end == (eos,) and eos in window
    first_end = window.index(eos)
    assert BPE.decode(window[:first_end]) == "def first():\n    return 1\n"  # a document, then its end
    assert max(window) < BPE.vocab_size


def test_dataset_shuffle_is_seeded_and_differs_between_passes(tmp_path):
    spec = DataConfig(
        source=str(_write_jsonl(tmp_path / "corpus.jsonl", [_document(n) for n in range(40)])), shuffle_buffer=8
    )
    one_seed = [_texts(_stream(spec, seed=3), 80) for _ in range(2)]
    assert one_seed[0] == one_seed[1]
    first, second = one_seed[0][:40], one_seed[0][40:]
    assert set(first) == set(second) and first != second
    assert _texts(_stream(spec, seed=4), 40) != first


def test_dataset_resume_continues_with_the_next_token(tmp_path):
    """Stop anywhere (mid-pass, across a pass boundary), resume from the saved position: the same tokens follow."""
    texts = [f"document {n} " + "y" * (n % 17) for n in range(60)]  # uneven lengths: windows cut documents
    spec = DataConfig(source=str(_write_jsonl(tmp_path / "corpus.jsonl", texts)), shuffle_buffer=8)
    uninterrupted = _stream(spec, seed=1).sequences()
    expected = [next(uninterrupted).tolist() for _ in range(150)]  # more than one pass of the corpus
    for stop_at in (1, 37, 71, 120):
        first = _stream(spec, seed=1)
        sequences = first.sequences()
        before = [next(sequences).tolist() for _ in range(stop_at)]
        saved = json.loads(json.dumps(first.position()))  # as written to and read from the store
        after = _stream(spec, seed=1, position=saved).sequences()
        assert before + [next(after).tolist() for _ in range(150 - stop_at)] == expected, f"stopped after {stop_at}"


def test_dataset_a_position_from_another_shard_tokenizer_or_data_is_refused(tmp_path):
    spec = DataConfig(source=str(_write_jsonl(tmp_path / "corpus.jsonl", [_document(n) for n in range(8)])))
    stream = _stream(spec, Shard(0, 2))
    next(stream.sequences())
    with pytest.raises(DataError, match="for shard 0/2, not 1/2"):
        _stream(spec, Shard(1, 2), position=stream.position())
    with pytest.raises(DataError, match="another tokenizer"):
        _stream(spec, Shard(0, 2), tokenizer=BPE, position=stream.position())
    with pytest.raises(DataError, match="in other data"):
        _stream(spec.model_copy(update={"shuffle_buffer": 7}), Shard(0, 2), position=stream.position())


def test_dataset_held_out_documents_never_enter_training(tmp_path):
    texts = [f"document number {n}: " + "z" * 40 for n in range(200)]
    config = load_config(
        "tiny",
        {
            "model": {"seq_len": SEQ_LEN},
            "data": {"source": str(_write_jsonl(tmp_path / "c.jsonl", texts))},
            "eval": {"holdout_fraction": 0.2, "sequences": 4},
        },
    )
    held = [text for text in texts if is_held_out(text, 0.2)]
    assert 10 < len(held) < 70
    stream = TokenStream(config.data, config.eval, BPE, 1000, Shard(0, 1))
    trained = BPE.decode(next(stream.sequences()).tolist() + next(stream.sequences()).tolist())
    assert not any(text in trained for text in held)
    sample = held_out_sample(config, BPE)
    assert tuple(sample.shape) == (4, SEQ_LEN + 1)
    assert BPE.decode(sample[0].tolist()).startswith(held[0][:20])
    assert (held_out_sample(config, BPE) == sample).all()  # a fixed sample: the same at every evaluation


def _trainer(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "agora_cli.py"), "trainer", "--seeds", "/ip4/127.0.0.1/tcp/9/p2p/none", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_dataset_the_trainer_refuses_a_bad_jsonl_with_one_error_before_joining(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    result = _trainer("--data", str(path))
    assert result.returncode == 2
    assert f"[ERROR] {path}: a record could not be read" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_dataset_the_trainer_offline_with_a_hub_name_says_to_use_data():
    # Real `datasets`, in its offline mode (conftest.py): it raises the same ConnectionError an unreachable hub
    # gives, without waiting for network retries.
    result = _trainer("--data", "someone/corpus")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[ERROR] could not reach the Hugging Face hub for 'someone/corpus'" in result.stdout
    assert "--data PATH" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_dataset_a_malformed_shard_is_refused_with_the_expected_form():
    from agora_client.trainer.main import _parse_shard

    assert _parse_shard("1/2") == Shard(1, 2)
    for text in ("3", "a/b", "1/2/3"):
        with pytest.raises(DataError, match=r"is not INDEX/COUNT; pass e\.g\. --shard 0/2"):
            _parse_shard(text)
