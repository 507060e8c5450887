"""Checkpoints by timestamp: retention, selection of a consistent set, the writer, errors, the OLMo2 export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agora_client.checkpoints import CheckpointError, Retention, list_sets, parse_time, run_record, select_set
from agora_client.checkpoints.export import export_set, load_set
from agora_client.checkpoints.writer import CheckpointWriter
from agora_client.cli import main
from agora_client.config import load_config
from agora_client.data.byte_tokenizer import byte_tokenizer_json
from agora_client.data.heldout import held_out_sample
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.events import EventWriter
from agora_client.model import build_stage
from agora_client.snapshots import LocalStore, StoredSnapshot
from agora_client.snapshots.background import BackgroundWriter
from agora_client.snapshots.store import ABANDONED_STAGING_S

T0 = 1_790_000_000.0  # a fixed wall-clock origin for the tests
CONFIG = load_config("tiny")


def perturbed_stage(stage: str, seed: int, config=CONFIG):
    """A stage whose weights moved away from the init (so logits are far from uniform)."""
    module = build_stage(config.model, stage, seed=config.seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return module, torch.optim.AdamW(module.parameters())


def save(
    store: LocalStore,
    stage: str,
    at: float,
    *,
    epoch: int = 1,
    seed: int = 0,
    loss: float | None = None,
    config=CONFIG,
    record: dict | None = None,
):
    """A checkpoint of ``stage``; ``record`` replaces the run record run_record(config) would write."""
    module, optimizer = perturbed_stage(stage, seed, config)
    extra = {"run": record or run_record(config), "training": {"loss": loss}}
    return store.save(stage, module, optimizer, epoch, extra=extra, timestamp=at)


def full_set(store: LocalStore, at: float, **kwargs) -> dict[str, StoredSnapshot]:
    stages = kwargs.get("config", CONFIG).model.stage_names
    return {stage: save(store, stage, at, seed=index, **kwargs) for index, stage in enumerate(stages)}


# -- retention ---------------------------------------------------------------------------------------------


def _snapshots(times: list[float]) -> list[StoredSnapshot]:
    return [StoredSnapshot(t, "head", f"{i:08d}-x") for i, t in enumerate(sorted(times))]


def test_retention_keeps_all_young_then_hourly_then_daily():
    hour, day = 3600.0, 86400.0
    now = T0 + 30 * day
    young = [now - 60 * i for i in range(1, 6)]  # five in the last minutes: all kept
    two_days_ago = [now - 2 * day - minute * 60 for minute in (1, 10, 20, 70, 80)]  # two UTC hours: one each
    month_ago = [now - 20 * day - hour * h for h in (1, 2, 3)]  # within a day or two: one per UTC day
    snapshots = _snapshots(young + two_days_ago + month_ago)
    kept = Retention(keep_all_s=day, keep_hourly_s=7 * day)(snapshots, now)
    by_time = {s.timestamp: s.name for s in snapshots}
    assert {by_time[t] for t in young} <= kept
    hours = {int(t // hour) for t in two_days_ago}
    kept_two_days = [t for t in two_days_ago if by_time[t] in kept]
    assert len(kept_two_days) == len(hours)
    for bucket in hours:  # the newest of each hour
        assert max(t for t in two_days_ago if int(t // hour) == bucket) in kept_two_days
    days = {int(t // day) for t in month_ago}
    assert len([t for t in month_ago if by_time[t] in kept]) == len(days)


def test_prune_removes_what_retention_drops_and_never_the_newest(tmp_path):
    store = LocalStore(tmp_path)
    old = [save(store, "head", T0 + 600 * i, epoch=i) for i in range(4)]  # every 10 min, one UTC hour or two
    removed = store.prune("head", Retention(keep_all_s=0, keep_hourly_s=10**9), now=T0 + 10 * 86400)
    left = store.list("head")
    assert old[-1] in left and {s.name for s in removed}.isdisjoint(s.name for s in left)
    assert len(left) == len({int(s.timestamp // 3600) for s in old})
    assert all(not store.path(s).exists() for s in removed)


def test_prune_removes_staging_a_dead_writer_left_and_spares_one_being_written(tmp_path):
    store = LocalStore(tmp_path)
    kept = save(store, "head", T0, epoch=1)
    abandoned, writing = tmp_path / "head" / ".tmp-dead-1", tmp_path / "head" / ".tmp-live-2"
    for staging in (abandoned, writing):
        staging.mkdir()
        (staging / "params.safetensors").write_bytes(b"half a file")
    now = (abandoned / "params.safetensors").stat().st_mtime + ABANDONED_STAGING_S + 60
    for path in (abandoned / "params.safetensors", abandoned):
        os.utime(path, (now - ABANDONED_STAGING_S - 1, now - ABANDONED_STAGING_S - 1))
    os.utime(writing / "params.safetensors", (now - 5, now - 5))  # its writer wrote a moment ago
    store.prune("head", Retention(keep_all_s=10**9, keep_hourly_s=10**9), now=now)
    assert not abandoned.exists() and writing.exists() and store.list("head") == [kept]


# -- selection ---------------------------------------------------------------------------------------------


def test_each_stage_gets_its_checkpoint_nearest_t_when_stages_checkpoint_at_different_times(tmp_path):
    store = LocalStore(tmp_path)
    times = {"head": [0, 100, 200], "body1": [30, 130, 230], "body2": [90, 160], "tail": [10, 110, 210]}
    written = {stage: [save(store, stage, T0 + t, epoch=t) for t in offsets] for stage, offsets in times.items()}
    chosen = select_set(store, T0 + 120)
    assert chosen.members == {
        "head": written["head"][1],
        "body1": written["body1"][1],
        "body2": written["body2"][0],
        "tail": written["tail"][1],
    }
    newest = select_set(store)
    assert newest.members == {stage: found[-1] for stage, found in written.items()}
    # a tie goes to the later checkpoint: 150 is 50 from body1's 100 and 200 in head
    assert select_set(store, T0 + 150).members["head"] == written["head"][2]
    assert [s.at for s in list_sets(store)] == [T0 + 10, T0 + 110, T0 + 210]  # one set per tail checkpoint


def test_parse_time_accepts_iso_and_unix_and_names_bad_input():
    assert parse_time("1790000000") == T0
    assert parse_time("2026-09-21T14:13:20Z") == T0
    assert parse_time("2026-09-21T16:13:20+02:00") == T0
    with pytest.raises(CheckpointError, match="not a time"):
        parse_time("yesterday")


def test_checkpoints_command_lists_sets_with_stage_times_and_loss(tmp_path, capsys):
    store = LocalStore(tmp_path)
    full_set(store, T0, loss=3.25)
    full_set(store, T0 + 60, loss=2.5)
    assert main(["checkpoints", "--store", str(tmp_path), "--json"]) == 0
    sets = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["loss"] for s in sets] == [3.25, 2.5]
    assert all(set(s["stages"]) == set(CONFIG.model.stage_names) and not s["missing"] for s in sets)
    assert main(["checkpoints", "--store", str(tmp_path), "--at", str(T0 + 50)]) == 0
    table = capsys.readouterr().out
    assert "loss 2.5000  eval n/a  complete" in table and table.count("epoch 1") == 4  # no trainer record: no eval loss


# -- bad input ---------------------------------------------------------------------------------------------


def test_missing_stage_is_named(tmp_path):
    store = LocalStore(tmp_path)
    for stage in ("head", "body1", "tail"):
        save(store, stage, T0)
    chosen = select_set(store)
    assert chosen.missing == ["body2"]
    with pytest.raises(CheckpointError, match="no checkpoint of stage body2"):
        export_set(store, chosen, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupted_file_is_named_and_nothing_is_left_half_written(tmp_path):
    store = LocalStore(tmp_path / "store")
    written = full_set(store, T0)
    params = store.path(written["body2"]) / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-5] ^= 0xFF
    params.write_bytes(bytes(data))
    assert main(["export", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(CheckpointError, match=r"stage body2.*params\.safetensors does not match its sha256"):
        export_set(store, select_set(store), tmp_path / "out")
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]  # no output, no staging directory


def test_shapes_from_another_run_config_are_refused(tmp_path):
    wider = load_config("tiny", {"model": {"d_model": 128}})
    store = LocalStore(tmp_path)
    full_set(store, T0)
    save(store, "body1", T0 + 1, config=wider)
    chosen = select_set(store, T0 + 1)
    with pytest.raises(CheckpointError, match=r"body1 checkpoint .* another run config .*d_model: 128 vs 256"):
        chosen.run()
    with pytest.raises(CheckpointError, match=r"another run config than tiny.*d_model"):
        _only(wider, tmp_path / "w").check_config(CONFIG)


def _only(config, root: Path):
    store = LocalStore(root)
    for stage in config.model.stage_names:
        save(store, stage, T0, config=config)
    return select_set(store)


def test_export_refuses_an_existing_output(tmp_path):
    store = LocalStore(tmp_path / "store")
    full_set(store, T0)
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        export_set(store, select_set(store), tmp_path / "out")


# -- the writer --------------------------------------------------------------------------------------------


def test_writer_checkpoints_every_period_with_run_and_training_stats(tmp_path):
    config = load_config("tiny", {"checkpoint": {"period_s": 1.0}})
    module, optimizer = perturbed_stage("tail", 0)
    lock = threading.Lock()
    messages = []
    events = EventWriter()
    events.emit = lambda event: messages.append(event.message)  # type: ignore[method-assign]
    store = LocalStore(tmp_path)
    background = BackgroundWriter(module, optimizer, lock)
    writer = CheckpointWriter(store, config, "tail", background, grad_norm=lambda: 0.5, events=events)
    writer.on_epoch(1, 4.0, averaging=False)  # not due yet
    assert store.list("tail") == []
    writer.last_written -= 1.2
    writer.on_epoch(2, 3.0, averaging=True)  # due, but waits for an epoch without an averaging round
    assert background.last_lock_hold_s is None  # nothing was copied
    writer.on_epoch(3, 2.0, averaging=False)
    assert background.wait(30)
    writer.last_written -= 2.1  # overdue by a whole period: written even while a round is in flight
    writer.on_epoch(4, 1.0, averaging=True)
    assert background.wait(30)
    writer.close(5)
    first, overdue, final = store.list("tail")
    assert (first.epoch, overdue.epoch, final.epoch) == (3, 4, 5)
    assert store.manifest(overdue)["training"]["loss"] == 1.0
    manifest = store.manifest(first)
    assert manifest["training"]["loss"] == pytest.approx(3.0)  # mean of the epochs since the last checkpoint
    assert (
        manifest["training"]["clip_norm"] == config.clip_norm("tail") and manifest["training"]["last_grad_norm"] == 0.5
    )
    assert manifest["run"] == run_record(config)
    assert any("checkpoint" in message and "written" in message for message in messages)


def test_worker_runtime_imports_neither_boto3_nor_transformers():
    code = (
        "import sys, agora_client.runtime, agora_client.worker.node, agora_client.joining.contributor; "
        "print(sorted(m for m in ('boto3', 'transformers', 'moto') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- export ------------------------------------------------------------------------------------------------


SAMPLE_TEXTS = [
    "Grüße, world\n",
    "日本語のテキスト 🙂 and naïve café",
    "def f(x):\n\treturn {'a': x ** 2}  # comment\n",
    "    \n\n\n        indented\t\t tabs   and  runs   ",
    "",
]
BYTES_CONFIG = load_config(
    "tiny", {"model": {"vocab_size": 256}, "tokenizer": {"source": "bytes", "sha256": None, "eos_token": None}}
)


def pipeline_boundary(stages: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The stages before the tail run in sequence in this process, as the trainer chains them over the network."""
    names = list(stages)
    boundary = stages[names[0]](tokens)
    for name in names[1:-1]:
        boundary = stages[name](boundary, tokens)
    return boundary


def pipeline_logits(stages: dict, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stages[list(stages)[-1]].logits(pipeline_boundary(stages, tokens), tokens)


def pipeline_loss(stages: dict, sample: torch.Tensor) -> float:
    """The tail's own loss over [B, T+1] sequences: every position predicts the next token, mean over all of them."""
    inputs, labels = sample[:, :-1], sample[:, 1:]
    with torch.no_grad():
        return stages[list(stages)[-1]](pipeline_boundary(stages, inputs), inputs, labels).mean().item()


def exported_loss(model, sample: torch.Tensor) -> float:
    """The same predictions by the Hugging Face model: logits of sample[:, :-1] against sample[:, 1:]."""
    with torch.no_grad():
        logits = model(sample[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample[:, 1:].reshape(-1)).item()


def assert_export_matches_stages(store, chosen, out: Path, cache: Path) -> None:
    """The export of ``chosen`` is the stages' model: the same logits, the run's tokenizer, the same held-out loss."""
    transformers = pytest.importorskip("transformers")
    export_set(store, chosen, out)
    run, stages = load_set(store, chosen, cache)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Olmo2ForCausalLM"
    tokens = torch.randint(0, run.model.vocab_size, (2, run.model.seq_len), generator=torch.Generator().manual_seed(5))
    ours = pipeline_logits(stages, tokens)
    with torch.no_grad():
        theirs = model(tokens).logits
    assert ours.abs().max() > 1.0  # far from uniform: a wrong weight would show
    torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=1e-4)
    tokenizer = load_run_tokenizer(run)
    assert_tokenizer_is_the_runs(transformers.AutoTokenizer.from_pretrained(out), tokenizer, model, out)
    assert_generates_the_pipelines_tokens(transformers.AutoTokenizer.from_pretrained(out), model, stages)
    sample = held_out_sample(run, tokenizer)
    assert sample.shape[1] == run.model.seq_len + 1
    # the logits agree within 2e-4, so each token's loss within 4e-4; predictions off by one token (or on other text)
    # move the perturbed model's loss by 0.01 or more, hidden inside a 1% tolerance
    assert exported_loss(model, sample) == pytest.approx(pipeline_loss(stages, sample), abs=1e-3)


def assert_tokenizer_is_the_runs(exported, tokenizer, model, out: Path) -> None:
    assert (out / "tokenizer.json").read_bytes() == tokenizer.content
    for text in SAMPLE_TEXTS:
        ids = exported(text, add_special_tokens=False).input_ids
        assert ids == tokenizer.encode(text), text
        assert exported.decode(ids) == tokenizer.decode(ids) == text
    if tokenizer.eos_token is None:  # bytes: documents end with a blank line, there is no end-of-document id
        assert exported.eos_token is None and model.config.eos_token_id is None
        return
    eos_id = tokenizer.document_end[0]
    assert exported.eos_token == tokenizer.eos_token and exported.eos_token_id == eos_id
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos_id
    joined = f"one document{tokenizer.eos_token}the next"
    assert exported(joined, add_special_tokens=False).input_ids == tokenizer.encode(joined)
    assert eos_id in tokenizer.encode(joined)


def assert_generates_the_pipelines_tokens(exported, model, stages) -> None:
    """Greedy generate() from a prompt the exported tokenizer encodes continues with the pipeline's next token."""
    prompt = exported("def main():\n    ", return_tensors="pt")
    length = prompt.input_ids.shape[1]
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated[:, :length], prompt.input_ids) and length < generated.shape[1] <= length + 8
    assert generated[0, length] == pipeline_logits(stages, prompt.input_ids)[0, -1].argmax()


def older_bytes_set(store: LocalStore) -> None:
    """A set written before runs named a tokenizer: no "tokenizer" in its run record, byte-level ids."""
    record = run_record(BYTES_CONFIG)
    del record["tokenizer"]
    full_set(store, T0, config=BYTES_CONFIG, record=record)


@pytest.mark.parametrize("kind", ["subspace", "dense", "older bytes record"])
def test_export_gives_the_same_logits_tokens_and_held_out_loss_as_the_stages(tmp_path, kind):
    store = LocalStore(tmp_path / "store")
    if kind == "older bytes record":
        older_bytes_set(store)
    else:
        full_set(store, T0, config=load_config("tiny", {"model": {"subspace": {"enabled": kind == "subspace"}}}))
    assert_export_matches_stages(store, select_set(store), tmp_path / "hf", tmp_path / "cache")
    provenance = json.loads((tmp_path / "hf" / "agora_export.json").read_text())
    assert set(provenance["stages"]) == set(CONFIG.model.stage_names)
    exported_source = provenance["run"]["tokenizer"]["source"]
    assert exported_source == ("bytes" if kind == "older bytes record" else CONFIG.tokenizer.source)
    if kind == "older bytes record":
        assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == byte_tokenizer_json()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"tokenizer": {"source": "no-such-tokenizer.json", "sha256": None}},
            "tokenizer file no-such-tokenizer.json not found",
        ),
        ({"tokenizer": {"source": "agora-test/no-such-tokenizer", "sha256": None}}, "this machine looks offline"),
        ({"tokenizer": {"sha256": "0" * 64}}, "but the run config pins 0000"),
        ({"model": {"vocab_size": 4096}}, "has 2,048 tokens but model.vocab_size is 4,096"),
    ],
    ids=["missing file", "hub offline", "sha256 pin", "vocab size"],
)
def test_export_fails_before_writing_anything_when_the_tokenizer_cannot_be_used(
    tmp_path, capsys, hub_offline, overrides, message
):
    store = LocalStore(tmp_path / "store")
    full_set(store, T0, config=load_config("tiny", overrides))
    assert main(["export", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out" / "hf")]) == 2
    error = capsys.readouterr().err
    assert "cannot export with the run's tokenizer" in error and message in error
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]  # no output, no staging directory, not even its parent


def test_export_refuses_stages_that_record_different_tokenizers(tmp_path):
    store = LocalStore(tmp_path)
    full_set(store, T0)
    unpinned = load_config("tiny", {"tokenizer": {"sha256": None}})  # the same model, another tokenizer record
    save(store, "body2", T0 + 1, config=unpinned)
    with pytest.raises(
        CheckpointError,
        match=r"body2 checkpoint records the tokenizer .*'sha256': None.* but the head checkpoint "
        r".*'sha256': 'f2290bf2",
    ):
        export_set(store, select_set(store, T0 + 1), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_command_picks_the_set_at_t(tmp_path, capsys):
    store = LocalStore(tmp_path / "store")
    older = full_set(store, T0)
    full_set(store, T0 + 3600)
    assert (
        main(["export", "--store", str(tmp_path / "store"), "--at", str(T0 + 60), "--out", str(tmp_path / "hf")]) == 0
    )
    assert f"tokenizer {CONFIG.tokenizer.source}" in capsys.readouterr().out
    provenance = json.loads((tmp_path / "hf" / "agora_export.json").read_text())
    assert {stage: entry["checkpoint"] for stage, entry in provenance["stages"].items()} == {
        s: c.name for s, c in older.items()
    }
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "agora_export.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_model_field_added_later_with_its_default_still_matches():
    from agora_client.checkpoints.sets import CheckpointSet

    older = run_record(CONFIG)
    del older["model"]["rope_theta"]  # as if written before the field existed; its default is the same
    members = {stage: StoredSnapshot(T0, stage, "00000001-x") for stage in CONFIG.model.stage_names}
    checkpoints = CheckpointSet(T0, members, {stage: {"run": older} for stage in members}, CONFIG.model.stage_names)
    checkpoints.check_config(CONFIG)
    changed = load_config("tiny", {"model": {"rope_theta": 500000.0}})
    with pytest.raises(CheckpointError, match="rope_theta: 10000.0 vs 500000.0"):
        checkpoints.check_config(changed)
