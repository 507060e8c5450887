"""The memory plan of one stage: GPU and host bytes from the run config's shapes alone, allocating nothing.

One function, ``plan_stage``, serves ``agora describe`` and the join-time fit check.

GPU, resident: fp32 weights, fp32 gradients (they accumulate between optimizer steps), the frozen
basis U (E_f is hashed on demand, never stored), and the AdamW moments unless they are offloaded.
GPU, per microbatch: what autograd saves during the recomputed forward of a backward request
(counted tensor by tensor below, mirroring agora_client/model/layers.py, stages.py and loss.py),
then a transient while backward runs (an estimate: the largest gradient buffers alive at once).
Host: the moments when offloaded, and SPARTA's averaging buffers; with a compressed payload (sparta.payload
bf16 or int8) also the residuals of its error feedback, 4 bytes per trainable parameter once every slice has
been averaged, and three more slices while a round's result is applied; with an outer step (sparta.outer_momentum
or outer_lr) also its anchors and momenta, 8 bytes per trainable parameter (4 without momentum), and one more
slice while it is computed. A worker that publishes snapshots or writes checkpoints also keeps a host copy of its
weights and moments (snapshots/background.py).

Two layouts (``LAYOUTS``). "fp32", the reference's: fp32 weights and gradients on the GPU. "offload", for a card the
fp32 layout does not fit (ZeRO-Offload's split, serving/device_copy.py): bf16 weights on the GPU (autocast makes no
second copy of them), each gradient streamed to a pinned bf16 staging buffer as backward produces it, then summed
into fp32 gradients beside fp32 master weights on the host, where AdamW steps; the step's new weights go back to the
GPU in bf16. The layout a card gets is the first that fits it (``choose_layout``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from agora_client.config import ModelConfig, RunConfig, SpartaConfig
from agora_client.model.loss import LOSS_CHUNK_TOKENS

FP32, BF16, TOKEN_ID = 4, 2, 8
LAYOUTS = ("fp32", "offload")
OPTIMIZER_CHUNK_BYTES = 3 * 4 * (1 << 22)  # OffloadAdamW's device chunks: exp_avg, exp_avg_sq, denominator
CUDA_RESERVED_BYTES = 1 << 30  # CUDA context, kernels' workspaces and allocator slack, outside the plan


@dataclass(frozen=True)
class StageShapes:
    """Element counts of the tensors a stage builds."""

    trainable: int  # parameters (and, element for element, their gradients and each AdamW moment)
    matmul_weights: int  # of those, the ones a matmul reads (cast to bf16 and saved under autocast)
    frozen: int  # the basis U
    lifts: int  # products with U per forward (each saves its own bf16 copy of U under autocast)
    largest_weight: int  # the largest single weight of a block (its gradient is a block's biggest backward buffer)


@dataclass(frozen=True)
class StagePlan:
    stage: str
    microbatch: int
    mixed_precision: bool
    offload_optimizer: bool
    layout: str  # one of LAYOUTS
    trainable: int  # parameters
    weights: int  # on the GPU: fp32, or bf16 in the offload layout
    gradients: int  # on the GPU between requests (none in the offload layout: they stream to the host)
    frozen: int
    moments: int
    saved_activations: int  # per microbatch
    backward_transient: int
    averaging: int
    master_weights: int  # host, offload layout: fp32 weights that the optimizer, SPARTA and snapshots read
    gradient_sum: int  # host, offload layout: the fp32 sum of the epoch's gradients
    staging: int  # host, pinned, offload layout: the bf16 mirror gradients and new weights cross PCIe through
    pcie_per_microbatch: int  # bytes across PCIe per backward request beyond its inputs and outputs
    pcie_per_step: int  # bytes across PCIe per optimizer step
    host_traffic_per_microbatch: int  # host memory bytes read and written to add a microbatch's gradients there
    flops_per_microbatch: int  # a worker's matmul work per microbatch: forward, then the recomputing backward

    @property
    def offloads_moments(self) -> bool:
        return self.offload_optimizer or self.layout == "offload"

    @property
    def gpu_resident(self) -> int:
        return self.weights + self.gradients + self.frozen + (0 if self.offloads_moments else self.moments)

    @property
    def gpu_peak(self) -> int:
        """The most the stage holds at once: during a recomputing backward (or the optimizer step, if larger)."""
        backward = self.gpu_resident + self.saved_activations + self.backward_transient
        chunks = OPTIMIZER_CHUNK_BYTES if self.offload_optimizer and self.layout == "fp32" else 0
        return max(backward, self.gpu_resident + chunks)  # the offload layout steps on the host

    @property
    def host(self) -> int:
        kept = self.master_weights + self.gradient_sum + self.staging
        return kept + (self.moments if self.offloads_moments else 0) + self.averaging

    @property
    def snapshot(self) -> int:
        """A snapshot of the stage: its fp32 weights and AdamW's two moments (the basis U is rebuilt, not stored)."""
        return self.trainable * FP32 + self.moments

    def host_need(self, on_gpu: bool, *, writes_state: bool = False) -> int:
        """Host memory a worker of this stage needs: a GPU worker's offloaded moments and averaging buffers
        (snapshots load tensor by tensor), and in the offload layout its masters, gradient sum and staging; a CPU
        worker holds the whole stage there. One that publishes snapshots or writes checkpoints (``writes_state``)
        also keeps their host copy, a snapshot's size."""
        need = self.host if on_gpu else self.host + self.gpu_peak
        return need + (self.snapshot if writes_state else 0)

    @property
    def disk_need(self) -> int:
        """Disk a worker of this stage needs: the snapshot in use, and room to fetch the next one beside it."""
        return 2 * self.snapshot

    def seconds(self, flops_per_s: float, pcie_bytes_per_s: float) -> dict[str, float]:
        """A microbatch's compute at ``flops_per_s`` beside its PCIe transfers, and the optimizer step's transfers."""
        return {
            "compute": self.flops_per_microbatch / flops_per_s,
            "pcie_microbatch": self.pcie_per_microbatch / pcie_bytes_per_s,
            "pcie_step": self.pcie_per_step / pcie_bytes_per_s,
        }

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "gpu_resident": self.gpu_resident,
            "gpu_peak": self.gpu_peak,
            "host": self.host,
            "snapshot": self.snapshot,
        }


def _layer_shapes(config: ModelConfig, constrained: bool) -> tuple[int, int, int]:
    """(matmul weight elements, norm gains, largest weight) of one block."""
    d, kv, f, k = config.d_model, config.kv_width, config.ffn_hidden, config.subspace_rank
    writers = k * d + k * f if constrained else d * d + f * d  # o_proj, down_proj
    matmul = d * d + 2 * d * kv + 2 * d * f + writers
    norms = d + kv + (0 if constrained else 2 * d)  # q_norm, k_norm; output norms are frozen scalars when constrained
    return matmul, norms, d * f


def stage_shapes(config: ModelConfig, stage: str) -> StageShapes:
    spec, first, tail_first = config.stage(stage), config.first_layer(stage), config.first_layer("tail")
    subspace, d, k = config.subspace.enabled, config.d_model, config.subspace_rank
    matmul = norms = largest = lifts = 0
    for index in range(first, first + spec.layers):
        constrained = subspace and index < tail_first
        layer_matmul, layer_norms, layer_largest = _layer_shapes(config, constrained)
        matmul, norms, largest = matmul + layer_matmul, norms + layer_norms, max(largest, layer_largest)
        lifts += 2 if constrained else 0
    extra = 0
    if stage == "head":
        extra = config.vocab_size * (k if subspace else d)  # the token embedding, low-rank under subspace
        lifts += 1 if subspace else 0
    if stage == "tail":
        extra = (
            d + config.vocab_size * d
        )  # final_norm, lm_head (read by the loss in chunks, never cast whole and saved)
    if subspace:
        lifts += (stage != "head") + (stage != "tail")  # receive c U^T, send (h - E_f) U
    return StageShapes(
        trainable=matmul + norms + extra,
        matmul_weights=matmul,
        frozen=d * k if subspace else 0,
        lifts=lifts,
        largest_weight=largest,
    )


def _block_activation_bytes(config: ModelConfig, tokens: int, width: int) -> int:
    """Bytes one block saves for backward over `tokens` tokens; `width` is the matmuls' dtype size."""
    d, kv, f, heads = config.d_model, config.kv_width, config.ffn_hidden, config.n_heads
    attention = (
        d * width  # x in the matmul dtype, read by q, k and v
        + (d + kv) * width
        + 2 * FP32  # q and k before QK-norm, and their 1/rms
        + (d + kv) * width  # rotated q and k (saved by attention)
        + kv * width  # v
        + d * width
        + heads * FP32  # attention output and its log-sum-exp
        + d * width  # heads merged back to [tokens, d], read by o_proj
        + d * width
        + FP32  # o_proj's output and its 1/rms in the output norm
    )
    mlp = (
        d * width  # x in the matmul dtype, read by gate and up
        + 4 * f * width  # gate output, silu(gate), up output, their product
        + d * width
        + FP32  # down_proj's output and its 1/rms in the output norm
    )
    return tokens * (attention + mlp)


def saved_activation_bytes(
    config: ModelConfig, stage: str, microbatch: int, *, mixed_precision: bool, layout: str = "fp32"
) -> int:
    """What autograd keeps between the recomputed forward and the backward, for `microbatch` sequences."""
    width = BF16 if mixed_precision else FP32
    seq, d = config.seq_len, config.d_model
    tokens = microbatch * seq
    shapes = stage_shapes(config, stage)
    total = config.stage(stage).layers * _block_activation_bytes(config, tokens, width)
    total += 2 * seq * (config.head_dim // 2) * width  # rotary cos and sin, shared by the stage's layers
    if mixed_precision:  # autocast's bf16 copies of U per product, and of every matmul weight not already bf16
        total += shapes.lifts * shapes.frozen * BF16 + (shapes.matmul_weights * BF16 if layout == "fp32" else 0)
    if stage == "head":
        total += tokens * TOKEN_ID  # the embedding's indices
    if stage == "tail":
        total += tokens * (d * FP32 + FP32)  # final_norm's input and 1/rms
        total += tokens * (d * width + TOKEN_ID)  # the loss's hidden state (matmul dtype) and labels
    return total


def backward_transient_bytes(
    config: ModelConfig, stage: str, microbatch: int, *, mixed_precision: bool, layout: str = "fp32"
) -> int:
    """An estimate of the largest buffers backward holds at once on top of the saved activations.

    Inside a block: the gradients of the four [tokens, ffn] activations and of the largest weight
    (in bf16, then its fp32 cast; in the offload layout bf16 only, streamed to the host as it is made).
    In the tail's loss: lm_head's fp32 gradient sum, one chunk's product and the bf16 copy of the weight
    (fp32 layout) or the sum's bf16 cast (offload), one chunk of logits (and their bf16 / fp32 forms),
    the hidden state's gradient.
    """
    width = BF16 if mixed_precision else FP32
    tokens = microbatch * config.seq_len
    shapes = stage_shapes(config, stage)
    if layout == "offload":
        weight_grad = shapes.largest_weight * BF16
    else:
        weight_grad = shapes.largest_weight * (FP32 + (width if mixed_precision else 0))
    block = 4 * tokens * config.ffn_hidden * width + weight_grad + tokens * config.d_model * FP32
    if stage != "tail":
        return block
    vocab, d = config.vocab_size, config.d_model
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    loss = vocab * d * 2 * FP32 + chunk * vocab * (3 * FP32 if mixed_precision else 2 * FP32) + tokens * d * FP32
    return max(block, loss)


def flops_per_microbatch(config: ModelConfig, stage: str, microbatch: int) -> int:
    """Matmul FLOPs a worker spends on one microbatch: the forward request, then the backward request's forward
    again and its backward (twice a forward): four forwards' worth, of the weights and of causal attention."""
    shapes, tokens = stage_shapes(config, stage), microbatch * config.seq_len
    weights = shapes.matmul_weights + (config.vocab_size * config.d_model if stage == "tail" else 0)
    attention = config.stage(stage).layers * microbatch * 2 * config.seq_len**2 * config.d_model  # causal: half
    return 4 * (2 * weights * tokens + attention)


def _check_plan_request(microbatch: int, layout: str, mixed_precision: bool) -> None:
    if microbatch < 1:
        raise ValueError(f"microbatch must be at least 1 sequence, got {microbatch}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "offload" and not mixed_precision:
        raise ValueError("the offload layout keeps bf16 weights on the GPU: it needs use_mixed_precision")


def plan_stage(
    run: RunConfig,
    stage: str,
    microbatch: int | None = None,
    *,
    layout: str = "fp32",
    mixed_precision: bool | None = None,
) -> StagePlan:
    """The stage's GPU and host bytes at `microbatch` sequences per pass (default: the run's microbatch) in `layout`.

    ``mixed_precision`` is the precision the device really runs (default: the run's); a device without native bf16
    runs fp32 (model/layers.py, runs_bf16). The offload layout runs bf16 by construction."""
    microbatch = run.optim.microbatch_size if microbatch is None else microbatch
    mixed = run.use_mixed_precision if mixed_precision is None else mixed_precision
    _check_plan_request(microbatch, layout, mixed)
    config = run.model
    shapes = stage_shapes(config, stage)
    trainable, offload = shapes.trainable, layout == "offload"
    slice_size = math.ceil(trainable / run.sparta.num_partitions)
    moments = 2 * trainable * FP32
    if offload:
        pcie_step = trainable * BF16  # the new weights, host to GPU
    else:
        pcie_step = 2 * moments if run.offload_optimizer else 0  # OffloadAdamW's moments, there and back
    return StagePlan(
        stage=stage,
        microbatch=microbatch,
        mixed_precision=mixed,
        offload_optimizer=run.offload_optimizer,
        layout=layout,
        trainable=trainable,
        weights=trainable * (BF16 if offload else FP32),
        gradients=0 if offload else trainable * FP32,
        frozen=shapes.frozen * FP32,
        moments=moments,
        saved_activations=saved_activation_bytes(config, stage, microbatch, mixed_precision=mixed, layout=layout),
        backward_transient=backward_transient_bytes(config, stage, microbatch, mixed_precision=mixed, layout=layout),
        averaging=averaging_bytes(trainable, slice_size, run.sparta.payload)
        + outer_step_bytes(trainable, slice_size, run.sparta),
        master_weights=trainable * FP32 if offload else 0,
        gradient_sum=trainable * FP32 if offload else 0,
        staging=trainable * BF16 if offload else 0,
        pcie_per_microbatch=trainable * BF16 if offload else 0,  # the gradients, GPU to host
        pcie_per_step=pcie_step,
        # DMA writes the bf16 staging; the add reads it and the fp32 sum, and writes the sum
        host_traffic_per_microbatch=trainable * (2 * BF16 + 2 * FP32) if offload else 0,
        flops_per_microbatch=flops_per_microbatch(config, stage, microbatch),
    )


def averaging_bytes(trainable: int, slice_size: int, payload: str) -> int:
    """SPARTA's host bytes: its shared buffer and the gathered slice. A compressed payload adds what it sent (the
    slice plus its residual), the buffer as hivemind compressed it and what the reducers decoded of that, and
    one float32 residual per trainable parameter (averaging/compression.py, SlicePayload)."""
    if payload == "fp32":
        return 2 * slice_size * FP32
    return 5 * slice_size * FP32 + trainable * FP32


def outer_step_bytes(trainable: int, slice_size: int, sparta: SpartaConfig) -> int:
    """The outer step's host bytes (averaging/outer_momentum.py): one float32 anchor per trainable parameter, one
    momentum more when sparta.outer_momentum > 0, and the step's slice while it is computed."""
    if not sparta.outer_step:
        return 0
    buffers = 2 if sparta.outer_momentum > 0 else 1
    return buffers * trainable * FP32 + slice_size * FP32


def usable_bytes(memory_total: int) -> int:
    """What a card of memory_total bytes leaves for the stage once CUDA has taken its share."""
    return memory_total - CUDA_RESERVED_BYTES


def layouts_for(run: RunConfig) -> tuple[str, ...]:
    """The layouts a GPU worker of this run may take, in the order they are tried (offload needs bf16)."""
    return LAYOUTS if run.use_mixed_precision else ("fp32",)


def largest_microbatch(run: RunConfig, stage: str, memory_total: int, limit: int = 64, *, layout: str = "fp32") -> int:
    """The most sequences per pass whose planned peak fits a card of memory_total bytes (0: not even one)."""
    usable, best = usable_bytes(memory_total), 0
    for microbatch in range(1, limit + 1):
        if plan_stage(run, stage, microbatch, layout=layout).gpu_peak > usable:
            break
        best = microbatch
    return best


def choose_layout(run: RunConfig, stage: str, memory_total: int) -> str | None:
    """The first layout in which a card of memory_total bytes takes the run's microbatch on this stage (None:
    none does). A stage that fits in fp32 keeps the reference's layout."""
    needed = max(1, run.optim.microbatch_size)
    for layout in layouts_for(run):
        if largest_microbatch(run, stage, memory_total, layout=layout) >= needed:
            return layout
    return None


def card_layout(run: RunConfig, stage: str, memory_total: int) -> str:
    """The layout a card of memory_total bytes takes this stage in: the first that fits, else the last (the one that
    holds the most on a GPU, in which the fit check refuses it with its numbers)."""
    return choose_layout(run, stage, memory_total) or layouts_for(run)[-1]


def holds_stage(run: RunConfig, stage: str, memory_total: int, host_available: int | None = None) -> bool:
    """Whether a card of memory_total bytes takes the run's microbatch on this stage (the join-time fit rule), and,
    given ``host_available``, whether the host holds what that layout keeps there."""
    layout = choose_layout(run, stage, memory_total)
    if layout is None:
        return False
    return host_available is None or plan_stage(run, stage, layout=layout).host_need(True) <= host_available


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
