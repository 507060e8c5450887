"""Run config: the model, its stage split, the optimizer, SPARTA, the sync phases, the tokenizer, data and evaluation.

Presets ship as YAML in ``agora_client/presets``. Every field is validated and a bad
file fails with one message that names the field and says how to fix it.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

STAGE_NAME = re.compile(r"^(head|body[1-9][0-9]*|tail)$")


class ConfigError(ValueError):
    """A run config that cannot be used; the message says which field and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageSpec(_Strict):
    name: str = Field(description="head, body1..bodyN or tail")
    layers: int = Field(ge=1, description="transformer layers held by this stage")


class SubspaceConfig(_Strict):
    enabled: bool = False
    compression_rate: int = Field(default=100, ge=1, description="k = d_model // compression_rate")


class ModelConfig(_Strict):
    vocab_size: int = Field(ge=2)
    d_model: int = Field(ge=8)
    n_heads: int = Field(ge=1)
    n_kv_heads: int | None = Field(
        default=None, ge=1, description="key/value heads (grouped-query attention); default n_heads"
    )
    ffn_hidden: int = Field(ge=8)
    n_layers: int = Field(ge=3)
    seq_len: int = Field(ge=2, description="tokens per sequence fed to the head")
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    subspace: SubspaceConfig = SubspaceConfig()
    stages: tuple[StageSpec, ...]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def kv_width(self) -> int:
        """Width of the key and value projections' outputs: n_kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def subspace_rank(self) -> int:
        return self.d_model // self.subspace.compression_rate

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(stage.name for stage in self.stages)

    def stage(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise ConfigError(f"unknown stage {name!r}: this run has stages {', '.join(self.stage_names)}")

    def first_layer(self, name: str) -> int:
        """Index of the stage's first layer in the unsplit model."""
        offset = 0
        for spec in self.stages:
            if spec.name == name:
                return offset
            offset += spec.layers
        raise ConfigError(f"unknown stage {name!r}: this run has stages {', '.join(self.stage_names)}")

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads}): "
                "every key/value head serves the same number of query heads"
            )
        if self.head_dim % 2:
            raise ValueError("model.d_model / model.n_heads must be even for rotary embeddings")
        if self.subspace.enabled and not 1 <= self.subspace_rank <= self.d_model:
            raise ValueError(
                f"model.subspace.compression_rate ({self.subspace.compression_rate}) leaves no subspace for "
                f"d_model {self.d_model}: use a rate between 1 and {self.d_model}"
            )
        names = [spec.name for spec in self.stages]
        expected = ["head", *(f"body{i}" for i in range(1, len(names) - 1)), "tail"]
        if len(names) < 2 or names != expected:
            raise ValueError(
                f"model.stages must be named {', '.join(expected)} in that order (got {', '.join(names) or 'none'})"
            )
        total = sum(spec.layers for spec in self.stages)
        if total != self.n_layers:
            split = " + ".join(f"{spec.name} {spec.layers}" for spec in self.stages)
            raise ValueError(
                f"model.stages hold {total} layers ({split}) but model.n_layers is {self.n_layers}: "
                "make the stage layers add up to n_layers"
            )
        return self


class OptimConfig(_Strict):
    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.1, ge=0)
    microbatch_size: int = Field(default=8, ge=1, description="sequences per trainer request")
    target_batch_size: int = Field(default=64, ge=1, description="samples a stage sums before every worker steps")
    clip_body: float | None = Field(
        default=None, description="gradient-norm clip for head and bodies; default 1/sqrt(stages)"
    )
    clip_tail: float | None = Field(default=None, description="gradient-norm clip for the tail; default 5/sqrt(stages)")
    inflight: int = Field(
        default=3,
        ge=1,
        description="microbatches each trainer keeps in flight: more keep the stages busier, and more backward passes "
        "meet a stage that stepped since their forward (staleness; what counts is the samples in flight against "
        "target_batch_size)",
    )
    share_scaling: Literal["none", "linear", "sqrt"] = Field(
        default="none",
        description="scale each worker's optimizer step (its lr, for that step) by its share of the stage epoch's "
        "samples (linear) or by the square root of that share (sqrt); none: every worker steps at the full lr",
    )


class SpartaConfig(_Strict):
    period: int = Field(default=20, ge=1, description="stage epochs between averaging rounds")
    fraction: float = Field(default=0.05, gt=0, le=1, description="share of parameters averaged per round")
    matchmaking_time: float = Field(default=5.0, gt=0, description="seconds to gather a group")
    allreduce_timeout: float = Field(default=30.0, gt=0, description="bound on a whole round")
    sender_timeout: float = Field(default=10.0, gt=0, description="drop a peer that sends nothing this long")
    reducer_timeout: float = Field(default=10.0, gt=0, description="drop a reducer that answers nothing this long")
    max_peer_delta: float = Field(
        default=0.5,
        gt=0,
        description="bound on one peer's pull: its part of a slice may differ from ours by at most this x our "
        "part's norm",
    )
    payload: Literal["fp32", "bf16", "int8"] = Field(
        default="fp32",
        description="what a round sends per value: fp32 (4 bytes), bf16 (2 bytes out, float32 answers) or int8 "
        "(Uniform8BitQuantization both ways); bf16 and int8 keep what compression drops and send it next time",
    )
    assumed_link_mbps: float = Field(
        default=50.0,
        gt=0,
        description="the link (Mbit/s, both ways) a worker assumes until its first round measures it",
    )
    outer_momentum: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Nesterov momentum of an outer step on every averaged slice, as in DiLoCo "
        "(averaging/outer_momentum.py); with outer_lr 1, 0 is plain averaging. Above 0 it keeps two float32 per "
        "trainable parameter in host memory",
    )
    outer_lr: float = Field(
        default=1.0,
        gt=0,
        description="outer step size η: a round moves a slice from its anchor a to a - η(g + μm), g = a - the group's "
        "average, m its momentum, μ outer_momentum; η 1 with μ 0 is plain averaging, another η with μ 0 keeps one "
        "float32 per trainable parameter in host memory",
    )

    @property
    def num_partitions(self) -> int:
        return max(1, round(1 / self.fraction))

    @property
    def outer_step(self) -> bool:
        """Whether rounds take an outer step on the averaged slice instead of adopting the group's average."""
        return self.outer_momentum > 0 or self.outer_lr != 1.0


class SyncConfig(_Strict):
    phase1_steps: int = Field(default=400, ge=0)
    phase2_steps: int = Field(default=100, ge=0)
    max_allowed_stale: int = Field(default=5, ge=0, description="epochs behind the stage before re-entering phase 1")
    skip_phase1_when_fresh: bool = Field(
        default=False,
        description="weights at most max_allowed_stale epochs behind the stage when phase 1 begins pass it at once",
    )


class CheckpointConfig(_Strict):
    period_s: float = Field(default=600.0, gt=0, description="seconds between a stage's checkpoints")
    keep_all_s: float = Field(default=86400.0, ge=0, description="keep every checkpoint younger than this")
    keep_hourly_s: float = Field(
        default=7 * 86400.0, ge=0, description="then one per hour up to this age; older: one per day"
    )


class SpotCheckConfig(_Strict):
    """How trainers check workers against each other (agora_client/trainer/spotcheck.py, calibration.py)."""

    fraction: float = Field(
        default=0.02, ge=0, le=1, description="share of stage requests a trainer also sends to a second worker"
    )
    quantile: float = Field(
        default=0.99,
        gt=0,
        le=1,
        description="a stage's tolerance is this quantile of its recent honest distances, plus margin",
    )
    margin: float = Field(
        default=0.1,
        gt=0,
        lt=0.7,
        description="added to that quantile; a stage whose tolerance comes within it of random "
        "answers' distance (sqrt 2 ~ 1.41) is unverifiable: its disagreements strike no one",
    )
    window: int = Field(default=200, ge=10, description="recent honest distances kept per stage and kind of request")
    min_samples: int = Field(
        default=30,
        ge=3,
        description="honest distances a stage and kind of request needs before its disagreements strike anyone",
    )
    calibration_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="share of checks on a calibrated stage that also ask a third worker, "
        "to keep measuring how far honest replicas drift",
    )
    strikes: int = Field(
        default=3, ge=1, description="disagreements with its stage's majority that get a worker banned"
    )
    ban_seconds: float = Field(default=86400.0, gt=0, description="how long a trainer keeps a caught worker out")
    escrow_window_s: float = Field(
        default=60.0,
        gt=0,
        description="compute served on a stage not judged yet is held in windows this long (each closes with at "
        "least one spot check in it), judged once the stage is verifiable",
    )
    escrow_hold_s: float = Field(
        default=3600.0, gt=0, description="a held window that nothing judged within this long expires unpaid"
    )
    reference_workers: list[str] = Field(
        default_factory=list,
        description="peer ids of operator-run workers whose answers are trusted as the judge (a two-worker stage "
        "needs one to pay); their own work is never held",
    )

    @model_validator(mode="after")
    def _check_window(self) -> "SpotCheckConfig":
        if self.min_samples > self.window:
            raise ValueError(
                f"spot_checks.min_samples ({self.min_samples}) must not exceed spot_checks.window "
                f"({self.window}): a stage would never be calibrated"
            )
        return self


class TokenizerConfig(_Strict):
    source: str = Field(
        default="bytes",
        description="bytes, a tokenizers JSON file (path or shipped name), an https URL, or a hub repo id[@revision]",
    )
    sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="pins the file: any other content is refused"
    )
    eos_token: str | None = Field(default=None, description="the token that ends a document when documents are packed")


class DataConfig(_Strict):
    source: str | None = Field(
        default=None,
        description="None: the Python standard library's source; a .txt/.jsonl/.parquet file or folder; a hub dataset",
    )
    subset: str | None = Field(default=None, description="the dataset's config name, e.g. sample-10BT")
    split: str = "train"
    text_field: str = "text"
    shuffle_buffer: int = Field(default=1024, ge=1, description="documents in the seeded shuffle buffer")


class EvalConfig(_Strict):
    every_s: float = Field(default=300.0, gt=0, description="seconds between held-out evaluations")
    sequences: int = Field(default=16, ge=1, description="held-out sequences per evaluation (forward passes only)")
    split: str | None = Field(
        default=None, description="a held-out split of the dataset; None: hold out documents by hash"
    )
    holdout_fraction: float = Field(
        default=0.01, gt=0, lt=1, description="share of documents held out when there is no split"
    )


class RunConfig(_Strict):
    name: str
    seed: int = 0
    model: ModelConfig
    optim: OptimConfig = OptimConfig()
    sparta: SpartaConfig = SpartaConfig()
    sync: SyncConfig = SyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    spot_checks: SpotCheckConfig = SpotCheckConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    announce_period: float = Field(default=30.0, gt=0, description="seconds between a worker's DHT announcements")
    metrics_period: float = Field(
        default=15.0,
        gt=0,
        description="seconds between a contributor's signed metrics "
        "records, which its points are counted from, and its points estimates",
    )
    use_mixed_precision: bool = Field(
        default=True, description="forward under bf16 autocast; weights and grads stay fp32"
    )
    offload_optimizer: bool = Field(
        default=True, description="AdamW moments in (pinned) host memory, stepped in chunks"
    )

    def clip_norm(self, stage: str) -> float:
        """Stage-wise gradient clipping: 1/sqrt(S) for head and bodies, 5/sqrt(S) for the tail."""
        scale = len(self.model.stages) ** 0.5
        if stage == "tail":
            return self.optim.clip_tail if self.optim.clip_tail is not None else 5.0 / scale
        return self.optim.clip_body if self.optim.clip_body is not None else 1.0 / scale


def describe_validation_error(error: ValidationError, heading: str) -> str:
    """One line per wrong field under ``heading``, naming the field (also for the operator's deploy file)."""
    lines = [heading]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key; remove it or check its spelling")
        else:
            lines.append(f"  {where}: {item['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "(dict)") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, f"invalid run config {source}:")) from None


def preset_names() -> list[str]:
    folder = resources.files("agora_client") / "presets"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def load_config(name_or_path: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a shipped preset by name (``tiny``, ``8b``) or a YAML file by path, then apply nested overrides."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text, source = path.read_text(), str(path)
    else:
        entry = resources.files("agora_client") / "presets" / f"{name_or_path}.yaml"
        if not entry.is_file():
            raise ConfigError(f"no preset or file named {name_or_path!r}; presets: {', '.join(preset_names())}")
        text, source = entry.read_text(), f"preset {name_or_path!r}"
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping of settings at the top level")
    return parse_config(_merge(data, overrides or {}), source)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
