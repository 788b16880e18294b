"""The trainer for causal language models: proximal / reference log-probs, advantages from the registry,
decoupled or standard PPO over micro-batches packed by token budget."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tidal.algorithms.objectives import PolicyInputs, minibatch_denominators, staleness_metrics
from tidal.algorithms.prefix import group_micro_batches, shared_prefix_logprobs
from tidal.algorithms.tokens import (
    length_grouped_micro_batches,
    sequence_token_advantages,
    token_logprobs,
)
from tidal.data import LLMBatch
from tidal.models.llm import load_causal_lm
from tidal.models.lora import apply_lora, save_pretrained_folder
from tidal.runtime import ConfigSections
from tidal.runtime.devices import to_device
from tidal.trainer import Trainer


def trained_model(m, weights: bool = True) -> torch.nn.Module:
    """The model ``model.*`` (``m``) describes, as the actor trains it: loaded from
    ``model.path`` (``weights=False``: from its config.json only), with LoRA adapters when
    ``model.lora.rank`` > 0."""
    options = (m.dtype, m.attn_implementation, m.gradient_checkpointing)
    model, _ = load_causal_lm(m.path, *options, weights=weights)
    return apply_lora(model, m.lora, repr(m.path))


class LLMActor(Trainer):
    """The language actor: token log-probs, advantages and PPO-family steps over token-budget
    micro-batches; the model, its reference, the engine, the weights out and the checkpoints
    are the ``Trainer``'s (tidal/trainer.py)."""

    config_sections = ("cluster", "runner", "rollout", "model", "actor", "algorithm")

    def __init__(self, cfg: ConfigSections):
        self.setup_rank(cfg)
        # fsdp2: only rank 0 reads the weights; the others fill their shards from it
        self.build_trainer(functools.partial(trained_model, cfg.model))
        self.temperature = cfg.rollout.temperature

    def save_weights_folder(self, folder: str) -> int:
        """The weights as a ``save_pretrained`` safetensors folder (for servers that reload from
        disk, e.g. vLLM), merged under LoRA; returns their version."""
        weights = self.weight_tensors()  # gathered from the shards under fsdp2
        if self.rank == 0:
            save_pretrained_folder(self.model, folder, dict(weights))
        return self.version

    def my_rows(self, minibatch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous block of a global minibatch's rows: equal blocks, or one row
        more on the first ranks where they do not divide (an agent's episodes give a row per
        call), so that no row is dropped; the loss divides by the whole minibatch's counts."""
        if len(minibatch) < self.world_size:  # a rank without rows would skip the gradient sync
            raise RuntimeError(
                f"a minibatch of {len(minibatch)} rows cannot feed {self.world_size} actor ranks: "
                "lower actor.ppo_minibatches or the actor's ranks"
            )
        return minibatch.tensor_split(self.world_size)[self.rank]

    @torch.no_grad()
    def compute_logp(
        self, batch: LLMBatch, model=None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token log-probs of ``rows`` (default all) under ``model`` at their generated tokens;
        other rows and positions stay 0."""
        model = model or self.model
        model.eval()
        out = torch.zeros(batch.input_ids.shape, device=self.compute_device)
        rows = torch.arange(out.shape[0], device=self.compute_device) if rows is None else rows
        for i, w in self.micro_batches(batch, rows):
            out[i, :w] = self._logprobs(model, batch, i, w)
        return out

    def micro_batches(self, batch: LLMBatch, rows: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """``rows`` packed by token budget: whole groups with ``actor.shared_prefix`` (each
        packs its prompt once), else sorted by length."""
        budget = self.cfg.actor.max_tokens_per_mb
        if self.cfg.actor.shared_prefix:
            return group_micro_batches(batch.attention_mask, batch.group_ids, rows, budget)
        return length_grouped_micro_batches(batch.attention_mask, rows, budget)

    def _logprobs(self, model, batch: LLMBatch, i: torch.Tensor, w: int) -> torch.Tensor:
        """Log-probs of rows ``i`` (width ``w``) at their generated tokens, the only ones any
        loss or metric reads; 0 elsewhere."""
        ids, attention, wanted = (
            x[i, :w] for x in (batch.input_ids, batch.attention_mask, batch.loss_mask)
        )
        if self.cfg.actor.shared_prefix:
            groups = batch.group_ids[i]
            return shared_prefix_logprobs(model, ids, attention, groups, self.temperature, wanted)
        return token_logprobs(model, ids, attention, self.temperature, wanted=wanted)

    def advantages(self, batch: LLMBatch, ref_logp: torch.Tensor | None) -> torch.Tensor:
        alg = self.cfg.algorithm
        kl_coef = alg.kl_coef if self.ref is not None and alg.kl_in == "reward" else 0.0
        return sequence_token_advantages(
            batch, ref_logp, alg, self.cfg.rollout.group_size, kl_coef=kl_coef
        )

    def train_step(self, batch: LLMBatch) -> dict[str, float]:
        """One PPO step on the whole batch (every rank receives it): advantages over all of it,
        then each global minibatch is split over the ranks, DDP averages the gradients, and each
        loss is weighted by the tokens (or sequences) of the global minibatch."""
        a, alg = self.cfg.actor, self.cfg.algorithm
        batch = to_device(batch, self.compute_device)  # once: every pass below reads it there
        metrics: dict[str, list[float]] = {}
        mask = batch.loss_mask
        minibatches = torch.arange(mask.shape[0], device=self.compute_device).chunk(
            a.ppo_minibatches
        )
        mine = torch.cat([self.my_rows(mb) for mb in minibatches])
        stale = (self.version - batch.versions)[mask]
        ref_logp = None
        if self.ref is not None:
            # KL in the reward shapes the advantages, which every rank computes over all rows
            with self.reference.in_use() as ref:
                ref_logp = self.compute_logp(batch, ref, None if alg.kl_in == "reward" else mine)
        prox = self.compute_logp(batch, rows=mine) if self.objective.needs_prox else None
        adv = self.advantages(batch, ref_logp)
        for minibatch in minibatches:
            # every rank divides by the global minibatch's count over the ranks DDP averages
            norm = minibatch_denominators([mask[minibatch]], None, alg.loss_agg, self.world_size)
            minibatch = self.my_rows(minibatch)
            micro_batches = self.micro_batches(batch, minibatch)
            loss_fn = functools.partial(
                self._micro_batch_loss,
                batch=batch,
                prox=prox,
                ref_logp=ref_logp,
                adv=adv,
                norm=norm,
            )
            for k, v in self.engine.train_batch(micro_batches, loss_fn).items():
                metrics.setdefault(k, []).extend(v)
        out = {f"train/{k}": float(np.mean(v)) for k, v in metrics.items()}
        out.update(
            {
                **self.engine.end_step(),
                **staleness_metrics(stale, buckets=4),
            }
        )
        out = self.all_reduce_mean(out)
        out["train/tokens"] = float(mask.sum())
        return out

    def _micro_batch_loss(
        self, model, micro, *, batch, prox, ref_logp, adv, norm
    ) -> tuple[torch.Tensor, dict]:
        """The loss of a micro-batch's rows ``i`` (trimmed to width ``w``) as its share of the
        minibatch's (``norm``), and its terms. The version is the weights' before this step."""
        i, w = micro
        alg, mask, behave = self.cfg.algorithm, batch.loss_mask, batch.logprobs
        logp = self._logprobs(model, batch, i, w)
        m = mask[i, :w]
        policy = PolicyInputs(
            logp=logp,
            behave=behave[i, :w],
            advantages=adv[i, :w],
            mask=m,
            version=self.version,
            prox=None if prox is None else prox[i, :w],
            versions=batch.versions[i, :w],
            ref=None if ref_logp is None else ref_logp[i, :w],
        )
        loss, info = self.objective.loss(policy, norm=norm, agg=alg.loss_agg)
        return loss, {k: v.detach() if torch.is_tensor(v) else float(v) for k, v in info.items()}
