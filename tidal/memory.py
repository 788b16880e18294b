"""The memory a config implies on each actor rank, planned before anything is built.

The model the actor trains is built on the meta device (shapes and dtypes, no weights), so a
billion-parameter plan costs no memory. Per rank: parameters (every one), gradients and
optimizer state (the trainable ones: Adam keeps two moments of each, in its dtype), times the
share the strategy leaves a rank (``ddp``: all; ``fsdp2``: 1/world). Activations, the
reference model and the communication buffers (DDP's gradient buckets hold one more copy of
the gradients) are not counted.

Trainable parameters are counted from ``requires_grad``: whatever freezes part of the model
(adapters over a frozen base, ``model.lora``) does so on the meta model too, in the function
that builds it (the half's ``meta_training_model``), and the plan follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.strategies import STRATEGIES, shard_units

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the parameter's shape and dtype


@dataclass
class MemoryPlan:
    strategy: str
    world_size: int
    num_params: int
    num_trainable: int
    param_bytes: int  # per rank
    grad_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # the largest unit a sharded rank gathers at once (0: not sharded)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def lines(self) -> list[str]:
        share = "all of it" if self.world_size == 1 or self.strategy == "ddp" else "1/world"
        out = [
            f"actor memory per rank ({self.strategy}, {self.world_size} rank(s), {share}; "
            f"{self.num_params:,} parameters, {self.num_trainable:,} trainable):",
            f"  parameters       {human(self.param_bytes)}",
            f"  gradients        {human(self.grad_bytes)}",
            f"  optimizer state  {human(self.optimizer_bytes)}",
            f"  total            {human(self.total_bytes)}"
            " (activations, the KL reference and communication buffers not included)",
        ]
        if self.gathered_bytes:
            out.append(f"  + gathered at once for compute: up to {human(self.gathered_bytes)}")
        return out


def plan(model: nn.Module, actor_cfg, world_size: int) -> MemoryPlan:
    """The plan for ``model`` (on the meta device, trainable parameters marked by
    ``requires_grad``) trained by ``actor_cfg``'s strategy over ``world_size`` ranks."""
    strategy = STRATEGIES.get(actor_cfg.strategy)(actor_cfg, world_size > 1)
    share = strategy.state_shares(world_size)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    all_bytes = sum(tensor_bytes(p) for p in params)
    train_bytes = sum(tensor_bytes(p) for p in trainable)
    gathered = largest_unit_bytes(model, torch.bfloat16 if actor_cfg.bf16 else None)
    return MemoryPlan(
        strategy=actor_cfg.strategy,
        world_size=world_size,
        num_params=sum(p.numel() for p in params),
        num_trainable=sum(p.numel() for p in trainable),
        param_bytes=int(all_bytes * share),
        grad_bytes=int(train_bytes * share),
        optimizer_bytes=int(ADAM_MOMENTS * train_bytes * share),
        gathered_bytes=gathered if share < 1 else 0,
    )


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def largest_unit_bytes(model: nn.Module, dtype: torch.dtype | None) -> int:
    """The most a sharded rank gathers at once: one unit whole (a decoder layer, or the root's
    own parameters: embeddings, head), in the compute ``dtype`` (None: the parameters')."""
    units = shard_units(model)
    inner = {id(p) for u in units for p in u.parameters()}
    groups = [list(u.parameters()) for u in units]
    groups.append([p for p in model.parameters() if id(p) not in inner])
    size = (lambda p: p.numel() * dtype.itemsize) if dtype is not None else tensor_bytes
    return max(sum(size(p) for p in group) for group in groups)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def state_bytes_counted(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank really holds, counted from its tensors (sharded ones: the local shard):
    parameters, gradients, optimizer state (benchmarks and tests compare it with the plan)."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(tensor_bytes(local(p)) for p in model.parameters())
    grads = sum(tensor_bytes(local(p.grad)) for p in model.parameters() if p.grad is not None)
    optim = sum(
        tensor_bytes(local(v))
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optimizer": optim}
