"""The train engine both halves train through. It knows nothing of RL.

It owns the model, the optimizer, the LR schedule, DDP wrapping, gradient accumulation
(``no_sync`` on all but the last micro-batch), clipping, bf16 autocast, the non-finite guard
and its checkpoint state. A trainer hands it micro-batches and a loss function::

    engine = TrainEngine(model, cfg.actor, total_steps=cfg.runner.max_steps)
    for minibatch in minibatches:
        metrics = engine.train_batch(micro_batches(minibatch), loss_fn)
    engine.end_step()   # one training step done: the LR schedule advances

``loss_fn(module, micro_batch) -> (loss, metrics)`` returns the micro-batch's share of the
minibatch loss (the shares sum to the minibatch loss): the engine backpropagates it as is.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.checkpoint import (
    load_checkpoint,
    load_trained_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    trained_state_dict,
)
from tidal.config.common import ActorConfig

log = logging.getLogger("tidal.engine")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]
OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite gradient."""


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
        # DDP averages gradients over the ranks (the process group is the worker's to start)
        self.module = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = OPTIMIZERS[cfg.optimizer](
            params, lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
        )
        self.step = 0  # training steps done (each: one or more optimizer steps, then end_step)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0

    # -- training --------------------------------------------------------------------------

    def autocast(self):
        device = "cuda" if next(self.model.parameters()).is_cuda else "cpu"
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def train_batch(self, micro_batches: Sequence, loss_fn: LossFn) -> dict[str, list[float]]:
        """One optimizer step over ``micro_batches`` (gradient accumulation); returns each
        micro-batch's metrics and the step's ``grad_norm``."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, list[float]] = defaultdict(list)
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            # gradients are all-reduced once, on the last backward of the minibatch
            sync = (
                contextlib.nullcontext()
                if i == last or not self.distributed
                else self.module.no_sync()
            )
            with sync:
                with self.autocast():
                    loss, info = loss_fn(self.module, micro)
                loss.backward()
            for k, v in info.items():
                metrics[k].append(float(v))
        metrics["grad_norm"].append(self._optimizer_step())
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
        """Clip and step, unless the gradient is not finite: then skip the step (a non-finite
        update would poison the weights), warn, and abort after too many in a row."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self.optimizer_steps += 1
        if math.isfinite(norm):
            self.optimizer.step()
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            log.warning(
                "%s: non-finite gradient norm at training step %d (optimizer step %d): step skipped "
                "(%d in a row, %d in all)",
                self.name,
                self.step + 1,
                self.optimizer_steps,
                self.consecutive_skips,
                self.skipped_steps,
            )
            if self.consecutive_skips >= self.cfg.max_skipped_steps:
                raise NonFiniteError(
                    f"{self.name}: {self.consecutive_skips} consecutive optimizer steps had a non-finite gradient "
                    f"(training step {self.step + 1}; actor.max_skipped_steps={self.cfg.max_skipped_steps})"
                )
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def end_step(self) -> dict[str, float]:
        """A training step is done: advance the LR schedule; returns the engine's metrics."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        return {"train/lr": lr, "train/skipped_steps": float(self.skipped_steps)}

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, path: str | Path, meta: dict, extra: dict[str, Any] | None = None) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "engine": {
                "step": self.step,
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
            },
        }
        return save_checkpoint(path, trained_state_dict(self.model), state, meta, extra)

    def load(self, path: str | Path) -> dict:
        """Model (its trained part: frozen parameters are not saved), optimizer, schedule, RNG
        and counters from a checkpoint, strictly: a key missing or unexpected is an error that
        names it."""
        model_state, state, meta = load_checkpoint(path)
        load_trained_state(self.model, model_state, str(path))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        counters = state.get("engine", {})
        self.step = counters.get("step", meta.get("step", 0))
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        self.skipped_steps = counters.get("skipped_steps", 0)
        return meta
