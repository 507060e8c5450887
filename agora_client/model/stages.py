"""The decoder cut into pipeline stages (head, bodies, tail), and the same decoder unsplit.

Every stage input and output has batch as dim 0 so a hivemind ModuleBackend can host it:
  head.forward(tokens)                   -> boundary
  body.forward(boundary, tokens)         -> boundary
  tail.forward(boundary, tokens, labels) -> per-sample loss [B]
boundary is c [B, T, k] when the stage compresses its boundaries, else the hidden state h [B, T, d].
Parameter names are global (``layers.<index in the unsplit model>``) and every parameter is
initialized from (seed, its name), so stages built anywhere match each other and the unsplit model.
"""

from __future__ import annotations

import torch
from torch import nn

from agora_client.config import ConfigError, ModelConfig
from agora_client.model.layers import Block, RMSNorm, autocast_context, compute_dtype, rotary_tables
from agora_client.model.loss import per_sample_loss
from agora_client.model.seeding import generator_for
from agora_client.model.subspace import Subspace


def is_constrained(config: ModelConfig, layer_index: int) -> bool:
    """A layer writes into span(U) when subspace is on and its output reaches a boundary (all but the tail's)."""
    return config.subspace.enabled and layer_index < config.first_layer("tail")


def boundary_width(config: ModelConfig, compress_boundary: bool) -> int:
    return config.subspace_rank if compress_boundary else config.d_model


def _layer_dict(config: ModelConfig, indices: range) -> nn.ModuleDict:
    return nn.ModuleDict({str(i): Block(config, is_constrained(config, i)) for i in indices})


def _run_layers(layers: nn.ModuleDict, h: torch.Tensor, config: ModelConfig, subspace: Subspace | None) -> torch.Tensor:
    rotary = rotary_tables(h.shape[1], config.head_dim, config.rope_theta, h.device, compute_dtype(h))
    for layer in layers.values():
        h = layer(h, rotary, subspace)
    return h


def _embed(embed: nn.Embedding, subspace: Subspace | None, tokens: torch.Tensor) -> torch.Tensor:
    """Dense: emb(tokens). Subspace: h0 = E_f[tokens] + emb'(tokens) U^T, emb' of width k."""
    trainable = embed(tokens)
    return trainable if subspace is None else subspace.embed(tokens) + subspace.lift(trainable)


def _check_tokens(name: str, tokens: torch.Tensor, config: ModelConfig, batch_like: torch.Tensor | None = None) -> None:
    if tokens.dtype != torch.int64 or tokens.dim() != 2:
        raise ValueError(f"{name} must be int64 [batch, seq]; got {tokens.dtype} of shape {tuple(tokens.shape)}")
    if batch_like is not None and tuple(batch_like.shape[:2]) != tuple(tokens.shape):
        raise ValueError(
            f"{name} shape {tuple(tokens.shape)} does not match the boundary's [batch, seq] "
            f"{tuple(batch_like.shape[:2])}"
        )
    if not tokens.is_meta and tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < config.vocab_size:
        raise ValueError(
            f"{name} must lie in [0, {config.vocab_size}); got values {int(tokens.min())}..{int(tokens.max())}"
        )


class StageModule(nn.Module):
    """One pipeline stage: its layers, plus the embedding (head) or the loss (tail)."""

    def __init__(self, config: ModelConfig, stage: str, compress_boundary: bool) -> None:
        super().__init__()
        self.config = config
        self.stage = stage
        self.compress_boundary = compress_boundary
        self.subspace = Subspace(config) if config.subspace.enabled else None
        first = config.first_layer(stage)
        self.layers = _layer_dict(config, range(first, first + config.stage(stage).layers))

    @property
    def boundary_width(self) -> int:
        """Last dim of the boundary tensors this stage receives and sends."""
        return boundary_width(self.config, self.compress_boundary)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def _tokens(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.config.seq_len, dtype=torch.int64, device=self._device())

    def _boundary(self, batch_size: int) -> torch.Tensor:
        shape = (batch_size, self.config.seq_len, self.boundary_width)
        return torch.zeros(shape, dtype=torch.float32, device=self._device(), requires_grad=True)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Zeros shaped like forward's inputs (boundary marked requires_grad), for hivemind schemas."""
        raise NotImplementedError

    def warm_up(self, mixed_precision: bool) -> None:
        """One forward of one sequence in the precision requests run in, to pay the first forward's one-time costs
        (torch's lazy imports, kernel set-up) ahead of them. Without autograd, so it keeps nothing: with autograd and
        in fp32, the 8b head held 33 GiB on an H200 (fp32 attention over grouped-query heads has no fused kernel,
        so each layer kept its 40 x 4096 x 4096 scores), more than a 24 GiB card has."""
        with torch.no_grad(), autocast_context(self._device(), mixed_precision)():
            self(*self.example_inputs(1))

    def receive(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden state h from an incoming boundary."""
        expected = (self.boundary_width,)
        if boundary.dim() != 3 or tuple(boundary.shape[2:]) != expected or not boundary.is_floating_point():
            raise ValueError(
                f"stage {self.stage} expects a float boundary [batch, seq, {self.boundary_width}]; "
                f"got {boundary.dtype} of shape {tuple(boundary.shape)} "
                f"(is subspace compression set the same on both sides of this boundary?)"
            )
        _check_tokens("tokens", tokens, self.config, boundary)
        return self.subspace.expand(boundary, tokens) if self.compress_boundary else boundary

    def send(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The outgoing boundary for hidden state h."""
        return self.subspace.compress(hidden, tokens) if self.compress_boundary else hidden


def _embedding(vocab_size: int, width: int) -> nn.Embedding:
    # left uninitialized (_materialize fills every parameter): nn.Embedding's own normal_ on the meta device
    # imports torch._dynamo, seconds for param_counts (the join preflight, the auth service's memory plan)
    return nn.Embedding(vocab_size, width, _weight=torch.empty(vocab_size, width))


class HeadStage(StageModule):
    def __init__(self, config: ModelConfig, stage: str, compress_boundary: bool) -> None:
        super().__init__(config, stage, compress_boundary)
        width = config.subspace_rank if config.subspace.enabled else config.d_model
        self.embed = _embedding(config.vocab_size, width)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return (self._tokens(batch_size),)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens("tokens", tokens, self.config)
        h = _run_layers(self.layers, _embed(self.embed, self.subspace, tokens), self.config, self.subspace)
        return self.send(h, tokens)


class BodyStage(StageModule):
    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return self._boundary(batch_size), self._tokens(batch_size)

    def forward(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = _run_layers(self.layers, self.receive(boundary, tokens), self.config, self.subspace)
        return self.send(h, tokens)


class TailStage(StageModule):
    def __init__(self, config: ModelConfig, stage: str, compress_boundary: bool) -> None:
        super().__init__(config, stage, compress_boundary)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)  # untied from the embedding

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return self._boundary(batch_size), self._tokens(batch_size), self._tokens(batch_size)

    def forward(self, boundary: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample mean cross-entropy, float32 [B], computed in chunks (the full logits never exist)."""
        _check_tokens("labels", labels, self.config, boundary)
        return per_sample_loss(self._final_hidden(boundary, tokens), self.lm_head.weight, labels)

    def logits(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, T, vocab] (what the loss is computed from; export checks compare them)."""
        return self.lm_head(self._final_hidden(boundary, tokens))

    def _final_hidden(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = _run_layers(self.layers, self.receive(boundary, tokens), self.config, self.subspace)
        return self.final_norm(h)


class FullModel(nn.Module):
    """The unsplit decoder with the same parameter names as the stages; the reference for split tests."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.subspace = Subspace(config) if config.subspace.enabled else None
        width = config.subspace_rank if config.subspace.enabled else config.d_model
        self.embed = _embedding(config.vocab_size, width)
        self.layers = _layer_dict(config, range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _check_tokens("tokens", tokens, self.config)
        _check_tokens("labels", labels, self.config, tokens)
        h = _run_layers(self.layers, _embed(self.embed, self.subspace, tokens), self.config, self.subspace)
        return per_sample_loss(self.final_norm(h), self.lm_head.weight, labels)


@torch.no_grad()
def _initialize(module: nn.Module, seed: int, std: float, *, weights: bool = True) -> None:
    """Norm gains to 1, every other parameter N(0, std) from (seed, its name); U and E_f from the seed.
    weights=False: only U and E_f (the caller loads every weight)."""
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False) if weights else ():
            if isinstance(sub, RMSNorm):
                param.fill_(1.0)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                param.copy_(torch.randn(param.shape, generator=generator_for(seed, name)).mul_(std))
        if isinstance(sub, Subspace):
            sub.regenerate(seed)


def _materialize(
    module: nn.Module, config: ModelConfig, seed: int, device: str | torch.device, weights: bool = True
) -> nn.Module:
    # Built on meta first so nothing is allocated twice; then filled on the target device.
    device = torch.device(device)
    if device.type != "meta":
        module.to_empty(device=device)
        _initialize(module, seed, config.init_std, weights=weights)
    return module


def build_stage(
    config: ModelConfig,
    stage: str,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    compress_boundary: bool | None = None,
    seeded_weights: bool = True,
    weight_dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Build one stage; compress_boundary defaults to config.subspace.enabled. ``weight_dtype`` is the trainable
    parameters' (bf16: the GPU copy of the offload layout, serving/device_copy.py); frozen tensors stay fp32.

    seeded_weights=False leaves the weights uninitialized for a caller that loads all of them (a snapshot):
    a large stage's random init costs seconds to minutes of CPU that the load would throw away.
    """
    config.stage(stage)  # unknown names raise ConfigError naming the valid ones
    if compress_boundary is None:
        compress_boundary = config.subspace.enabled
    if compress_boundary and not config.subspace.enabled:
        raise ConfigError("compress_boundary needs model.subspace.enabled: true (boundaries are only in span(U) then)")
    stage_class = HeadStage if stage == "head" else TailStage if stage == "tail" else BodyStage
    with torch.device("meta"):
        module = stage_class(config, stage, compress_boundary)
        for param in module.parameters():
            if param.requires_grad:
                param.data = param.data.to(weight_dtype)
    return _materialize(module, config, seed, device, weights=seeded_weights)


def build_full_model(config: ModelConfig, *, seed: int, device: str | torch.device = "cpu") -> FullModel:
    with torch.device("meta"):
        module = FullModel(config)
    return _materialize(module, config, seed, device)


def trainable_parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def param_counts(config: ModelConfig) -> dict[str, int]:
    """Trainable parameters per stage, counted on the meta device (nothing allocated)."""
    return {
        name: trainable_parameter_count(build_stage(config, name, seed=0, device="meta")) for name in config.stage_names
    }
