"""The local swarm's model in one process, for the benches that compare the two (not a bench itself).

``InProcessPipeline`` chains the preset's stages in this process and trains them as the swarm's workers
do, and evaluates them as a trainer evaluates the swarm; ``trainer_batches`` is the batch stream of a trainer.
Used by pipeline_throughput and data_throughput (speed), convergence and the rehearsal (loss at equal token counts).
"""

from __future__ import annotations

from typing import Iterator

import torch

from agora_client.config import RunConfig
from agora_client.data.sources import Shard
from agora_client.data.stream import TokenStream
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.model import build_stage
from agora_client.model.layers import autocast_context
from agora_client.worker.optimizer import build_optimizer

ONLY_TRAINER = Shard(0, 1)


def trainer_batches(config: RunConfig, shard: Shard = ONLY_TRAINER) -> Iterator[torch.Tensor]:
    """The microbatches a trainer of ``shard`` draws (default: a swarm's only trainer): the stream it builds (the
    run's data and tokenizer, its shard, the run's seed, from the start), cut into the run's microbatches."""
    stream = TokenStream(
        config.data, config.eval, load_run_tokenizer(config), config.model.seq_len, shard, seed=config.seed
    )
    return stream.batches(config.optim.microbatch_size)


class InProcessPipeline:
    """The stages chained in this process, trained as the swarm's workers train them (and evaluated as a trainer
    evaluates the swarm: the same forward passes, no gradient).

    Same construction and seed as a worker's stage, the workers' optimizer (``build_optimizer``: AdamW with
    the run's settings), the run's autocast, float32 between stages, and the same stage epochs: a step every
    target_batch_size samples, gradients averaged over them, stage-wise clipping.
    """

    def __init__(self, config: RunConfig):
        self.config = config
        self.stages = [build_stage(config.model, name, seed=config.seed) for name in config.model.stage_names]
        self.parameters = [[p for p in stage.parameters() if p.requires_grad] for stage in self.stages]
        self.optimizers = [build_optimizer(parameters, config) for parameters in self.parameters]
        self.clip = [config.clip_norm(name) for name in config.model.stage_names]
        self.autocast = autocast_context(torch.device("cpu"), config.use_mixed_precision)
        self.samples = 0
        self.steps = 0

    def train_microbatch(self, batch: torch.Tensor) -> float:
        losses = self._losses(batch)
        losses.sum().backward()  # each sample's loss with weight 1, as the trainer sends it
        self.samples += batch.shape[0]
        if self.samples >= self.config.optim.target_batch_size:
            self._step()
        return float(losses.detach().mean())

    @torch.no_grad()
    def eval_loss(self, sample: torch.Tensor) -> float:
        """Mean per-sequence loss of a held-out sample, forward only, in microbatches as the trainer sends them."""
        total = sum(float(self._losses(batch).sum()) for batch in sample.split(self.config.optim.microbatch_size))
        return total / len(sample)

    def _losses(self, batch: torch.Tensor) -> torch.Tensor:
        """The per-sequence losses of a [B, T+1] batch through every stage."""
        tokens, labels = batch[:, :-1], batch[:, 1:]
        head, *bodies, tail = self.stages
        boundary = self._forward(head, tokens)
        for body in bodies:
            boundary = self._forward(body, boundary, tokens)
        return self._forward(tail, boundary, tokens, labels)

    def _forward(self, stage: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        """One stage's forward as a worker runs it: under the run's autocast, handing on float32."""
        with self.autocast():
            return stage(*inputs).float()

    def _step(self) -> None:
        for parameters, optimizer, clip in zip(self.parameters, self.optimizers, self.clip, strict=True):
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.div_(self.samples)
            torch.nn.utils.clip_grad_norm_(parameters, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.samples = 0
        self.steps += 1
