"""The train engine both halves train through. It knows nothing of RL.

It owns the model, the optimizer, the LR schedule, the wrapping over the ranks
(``actor.strategy``: DDP or FSDP2, tidal.strategies), gradient accumulation (no gradient sync
on all but the last micro-batch), clipping (the global norm, over shards too), bf16 autocast, the non-finite guard
and its checkpoint state. A trainer hands it micro-batches and a loss function::

    engine = TrainEngine(model, cfg.actor, total_steps=cfg.runner.max_steps)
    for minibatch in minibatches:
        metrics = engine.train_batch(micro_batches(minibatch), loss_fn)
    engine.end_step()   # one training step done: the LR schedule advances

``loss_fn(module, micro_batch) -> (loss, metrics)`` returns the micro-batch's share of the
minibatch loss (the shares sum to the minibatch loss): the engine backpropagates it as is.

``MultiOptimizerEngine`` is its sibling for a model whose parts step on losses of their own
(SAC's agent), with the same clipping and non-finite guard (``clip_and_step``, ``SkipGuard``).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.checkpoint import (
    load_checkpoint,
    load_extra,
    load_strict,
    rng_state,
    save_checkpoint,
    set_rng_state,
    staging_folder,
    staging_path,
)
from tidal.config import ConfigError
from tidal.config.common import ActorConfig
from tidal.runtime.offload import HostOffload, module_and_optimizer_tensors
from tidal.strategies import make_strategy

log = logging.getLogger("tidal.engine")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]
OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite gradient."""


class SkipGuard:
    """An optimizer's steps skipped for a non-finite gradient (a non-finite update would poison
    the weights): each is warned about, and ``limit`` in a row (``actor.max_skipped_steps``)
    stop the run, naming ``name``. The train engine and SAC's optimizers keep one each."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit, self.in_a_row = name, limit, 0

    def stepped(self) -> None:
        self.in_a_row = 0

    def skipped(self, where: str, in_all: int) -> None:
        """A skip at ``where`` (e.g. the training step), ``in_all`` skips so far."""
        self.in_a_row += 1
        log.warning(
            "%s: non-finite gradient norm at %s: step skipped (%d in a row, %d in all)",
            self.name,
            where,
            self.in_a_row,
            in_all,
        )
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.name}: {self.in_a_row} consecutive optimizer steps had a non-finite "
                f"gradient ({where}; actor.max_skipped_steps={self.limit})"
            )


def make_optimizer(cfg: ActorConfig, params, lr: float, **options) -> torch.optim.Optimizer:
    """``actor.optimizer`` over ``params`` at ``lr``, with the actor's epsilon and weight decay."""
    return OPTIMIZERS[cfg.optimizer](
        params, lr=lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, **options
    )


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    finite: bool = True,
) -> float:
    """Clip ``params``' gradients to a global norm of ``max_norm`` (None: no clipping) and step,
    unless the gradient is not finite (a non-finite update would poison the weights) or is
    known not to be (``finite`` false: e.g. another rank's loss). Returns the norm: not finite
    when the step was skipped."""
    if not finite:
        return math.nan
    norm = global_grad_norm(params)
    if params and max_norm is not None:  # (by a factor of exactly 1 when under max_norm)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    norm = float(norm)
    if math.isfinite(norm):
        optimizer.step()
    return norm


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The LR factor at a training step: linear warm-up, then constant, linear or cosine decay."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


class TrainEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ActorConfig,
        total_steps: int,
        distributed: bool = False,
        name: str = "actor",
    ):
        self.cfg, self.name = cfg, name
        self.model = model
        self.distributed = distributed
        self.strategy = make_strategy(cfg, distributed)
        self.module = self.strategy.wrap(model)  # what the loss calls
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(cfg, params, cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
        )
        self.step = 0  # training steps done (each: one or more optimizer steps, then end_step)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.skips = SkipGuard(name, cfg.max_skipped_steps)
        self._host = HostOffload()

    # -- training --------------------------------------------------------------------------

    @property
    def consecutive_skips(self) -> int:
        return self.skips.in_a_row

    def autocast(self):
        device = "cuda" if next(self.model.parameters()).is_cuda else "cpu"
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def train_batch(self, micro_batches: Sequence, loss_fn: LossFn) -> dict[str, list[float]]:
        """One optimizer step over ``micro_batches`` (gradient accumulation); returns each
        micro-batch's metrics and the step's ``grad_norm``."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.before_step(self.module)
        metrics: dict[str, list[float]] = defaultdict(list)
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            # gradients are reduced over the ranks once, on the last backward of the minibatch
            with self.strategy.accumulate(self.module, sync=i == last):
                with self.autocast():
                    loss, info = loss_fn(self.module, micro)
                loss.backward()
            for k, v in info.items():
                metrics[k].append(v)
        norm = self._optimizer_step()
        metrics = host_floats(metrics)
        metrics["grad_norm"] = [norm]
        return metrics

    def train_epochs(
        self,
        batch: dict[str, torch.Tensor],
        loss_for: Callable[[list[dict[str, torch.Tensor]]], LossFn],
        *,
        epochs: int,
        minibatch: int,
        micro_batch: int,
        generator: torch.Generator,
        stop: Callable[[dict[str, list[float]]], bool] | None = None,
    ) -> dict[str, list[float]]:
        """``epochs`` shuffled passes over a flat batch (``{name: [N, ...]}``): every
        ``minibatch`` rows are one optimizer step accumulated over ``micro_batch`` rows, with
        the loss function ``loss_for(micro_batches)`` makes for that minibatch (it may need
        counts over all of it). ``stop(epoch_metrics)`` true ends the passes after that epoch."""
        size = next(iter(batch.values())).shape[0]
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(epochs):
            order = torch.randperm(size, generator=generator)
            epoch: dict[str, list[float]] = defaultdict(list)
            for start in range(0, size, minibatch):
                rows = order[start : start + minibatch].split(micro_batch)
                micro_batches = [{k: v[i] for k, v in batch.items()} for i in rows]
                for k, v in self.train_batch(micro_batches, loss_for(micro_batches)).items():
                    epoch[k].extend(v)
            for k, v in epoch.items():
                metrics[k].extend(v)
            if stop is not None and stop(epoch):
                break
        return metrics

    def _optimizer_step(self) -> float:
        """Clip and step, unless the gradient is not finite: then skip the step, warn, and
        abort after too many in a row."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clip_and_step(self.optimizer, params, self.cfg.max_grad_norm)
        self.optimizer_steps += 1
        if math.isfinite(norm):
            self.skips.stepped()
        else:
            self.skipped_steps += 1
            where = f"training step {self.step + 1} (optimizer step {self.optimizer_steps})"
            self.skips.skipped(where, self.skipped_steps)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def end_step(self) -> dict[str, float]:
        """A training step is done: advance the LR schedule; returns the engine's metrics."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        return {"train/lr": lr, "train/skipped_steps": float(self.skipped_steps)}

    # -- collocated offload (actor.offload) -------------------------------------------------

    def offload(self) -> int:
        """Parameters, gradients and optimizer state to host memory while another worker uses
        the device (tidal.runtime.offload); returns the bytes freed."""
        return self._host.offload(module_and_optimizer_tensors(self.model, self.optimizer))

    def onload(self) -> int:
        """Back on the device before training; bitwise as before ``offload``."""
        return self._host.onload()

    # -- checkpoints -----------------------------------------------------------------------

    def full_state_dict(self, rank: int = 0, dtype: torch.dtype | None = None):
        """The whole model's weights on rank 0 (None on the others, which must call it too:
        a sharded model is gathered), floating tensors in ``dtype`` (None: as they are)."""
        state = self.strategy.full_state_dict(self.model, rank)
        if state is None or dtype is None:
            return state
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    def full_state_groups(self, rank: int, group_of: Callable[[str], str] = str):
        """The whole model's weights a group of keys at a time, on rank 0 (every rank reads
        it to the end: a sharded model is gathered as it is read)."""
        return self.strategy.full_state_groups(self.model, rank, group_of)

    def save(
        self,
        path: str | Path,
        meta: dict,
        extra: dict[str, Any] | None = None,
        rank: int = 0,
    ) -> Path | None:
        """Every rank calls it (a sharded strategy writes every rank's part); the folder's path
        on rank 0, else None."""
        state = {
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "engine": {
                "step": self.step,
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
            },
        }
        meta = {**meta, "strategy": self.strategy.name}
        return self.strategy.save(self.model, self.optimizer, Path(path), state, meta, extra, rank)

    def load(self, path: str | Path) -> dict:
        """Model, optimizer, schedule, RNG and counters from a checkpoint, strictly: a key
        missing or unexpected is an error that names it."""
        state, meta = self.strategy.load(self.model, self.optimizer, Path(path))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        counters = state.get("engine", {})
        self.step = counters.get("step", meta.get("step", 0))
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        self.skipped_steps = counters.get("skipped_steps", 0)
        return meta


class MultiOptimizerEngine:
    """The train engine's sibling for a model whose parts each step on a loss of their own
    (SAC: the actor, the critics, the temperature): one optimizer per part, each step with the
    same non-finite guard and clipping as ``TrainEngine``'s; over several ranks the model starts
    as rank 0's and each step averages the part's gradients over the ranks (one flat
    all-reduce, which also tells every rank whether any rank's loss was not finite, so all
    skip alike); offload and the checkpoint state (per-rank state included) as the engine's.

    ``step`` counts training steps (``end_step``), the version of the weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        parts: dict[str, tuple[list[torch.nn.Parameter], float]],
        cfg: ActorConfig,
        world_size: int = 1,
        name: str = "actor",
    ):
        self.model, self.cfg, self.world_size = model, cfg, world_size
        self.optimizers = {
            part: make_optimizer(cfg, params, lr, foreach=True)
            for part, (params, lr) in parts.items()
        }
        # per part: one may keep failing while the others step
        self.skips = {part: SkipGuard(f"{name} {part}", cfg.max_skipped_steps) for part in parts}
        self.step = 0
        self.skipped_steps = 0  # over all parts
        self._host = HostOffload()
        if world_size > 1:
            broadcast_from_rank0(model)

    def step_loss(self, part: str, loss: torch.Tensor) -> bool:
        """One optimizer step of ``part`` on ``loss``; whether it was applied (a non-finite loss
        or gradient on any rank is skipped, counted, and warned about)."""
        optimizer = self.optimizers[part]
        optimizer.zero_grad(set_to_none=True)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        if self.world_size > 1:  # the mean of an overflowed gradient overflows on every rank
            finite = average_gradients(params, finite, self.world_size)
        with_grad = [p for p in params if p.grad is not None]
        norm = clip_and_step(optimizer, with_grad, self.cfg.max_grad_norm, finite)
        if math.isfinite(norm):
            self.skips[part].stepped()
            return True
        self.skipped_steps += 1
        self.skips[part].skipped(f"update {self.step + 1}", self.skipped_steps)
        return False

    def end_step(self) -> None:
        self.step += 1

    def offload(self) -> int:
        """As ``TrainEngine.offload``, every part's optimizer state included."""
        tensors = module_and_optimizer_tensors(self.model, None)
        for optimizer in self.optimizers.values():
            tensors += [
                v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            ]
        return self._host.offload(tensors)

    def onload(self) -> int:
        return self._host.onload()

    # -- checkpoints -----------------------------------------------------------------------

    def save(
        self, path: str | Path, meta: dict, extra: dict | None, rank: int, own: dict
    ) -> Path | None:
        """The model (``model.safetensors``: the ranks hold the same), rank 0's optimizers, and
        each rank's own state (``own``, with its RNG and the engine's counters): rank 0's in
        ``state.pt``, a rank > 0's in ``rank_file(rank)`` of the staging folder rank 0 then
        renames into place (a crash before leaves older checkpoints whole). Every rank calls
        it; the folder's path on rank 0."""
        counters = {"updates": self.step, "skipped": self.skipped_steps}
        own = {**own, "rng": rng_state(), "counters": {**counters, **own.get("counters", {})}}
        meta = {**meta, "version": self.step, "actor_ranks": self.world_size}
        staged = None
        if self.world_size > 1:
            import torch.distributed as dist

            staged = staging_folder(path, "ranks") if rank == 0 else None
            dist.barrier()  # the folder exists
            if rank != 0:
                torch.save(own, staging_path(path, "ranks") / rank_file(rank))
            dist.barrier()  # every rank's file is written
            if rank != 0:
                return None
        own["optimizers"] = {k: o.state_dict() for k, o in self.optimizers.items()}
        return save_checkpoint(path, self.model.state_dict(), own, meta, extra, staged)

    def load(self, path: str | Path, rank: int) -> tuple[dict, dict]:
        """Model, optimizers, RNG and counters, strictly; this rank's own state and the meta.
        A checkpoint of another number of ranks is refused (each rank kept its own state)."""
        model_state, state, meta = load_checkpoint(path)
        saved_ranks = meta.get("actor_ranks", 1)
        if saved_ranks != self.world_size:
            raise ConfigError(
                f"cluster.placement: the checkpoint {path} was trained on {saved_ranks} actor "
                f"rank(s), each with state of its own; resume it on {saved_ranks}, got "
                f"{self.world_size}"
            )
        load_strict(self.model, model_state, str(path))
        for k, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][k])
        own = state if rank == 0 else load_extra(path, rank_file(rank))
        set_rng_state(own["rng"])
        self.step, self.skipped_steps = own["counters"]["updates"], own["counters"]["skipped"]
        return own, meta


def rank_file(rank: int) -> str:
    """What rank ``rank`` > 0 of a ``MultiOptimizerEngine`` keeps in a checkpoint."""
    return f"actor_rank{rank}.pt"


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Rank 0's weights on every rank (the seeds agree; this makes it certain)."""
    import torch.distributed as dist

    for t in model.state_dict().values():
        dist.broadcast(t, 0)


def average_gradients(params: list[torch.nn.Parameter], finite: bool, world_size: int) -> bool:
    """The mean of the ranks' gradients in place, as one flat all-reduce that also counts the
    ranks whose loss was finite; whether all were."""
    import torch.distributed as dist

    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flag = torch.tensor([float(finite)], device=grads[0].device)
    flat = torch.cat([*(g.reshape(-1) for g in grads), flag])
    dist.all_reduce(flat)
    if flat[-1].item() < world_size:
        return False
    flat /= world_size
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return True


def host_floats(metrics: dict[str, list]) -> dict[str, list[float]]:
    """Micro-batch metrics (floats or 0-d tensors, e.g. on the GPU) as floats: the tensors are
    read in one transfer per optimizer step, not one sync per micro-batch and metric."""
    tensors = [
        v.detach().float().reshape(()) for vs in metrics.values() for v in vs if torch.is_tensor(v)
    ]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return {
        k: [next(read) if torch.is_tensor(v) else float(v) for v in vs] for k, vs in metrics.items()
    }


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all the gradients together; over every rank's shards when they are
    DTensors (FSDP2), so every rank clips by the same factor."""
    if not params:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
