"""Token-level math of the language trainer: chosen-token log-probs, micro-batches packed by
token budget, and per-token advantages of sequence rewards. The embodied twin is ``chunks.py``.

Batch-major throughout: ``input_ids``, ``attention_mask``, ``loss_mask`` are ``[B, L]``.
"""

from __future__ import annotations

import torch

from tidal.algorithms.advantages import get_advantage
from tidal.algorithms.kl import kl_estimate


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``out[:, t]`` = log-prob of ``input_ids[:, t]`` given the tokens before it, under
    ``softmax(logits / temperature)`` (the engine's definition); column 0 is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits[:, :-1].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sequence indices whose padded size (count x longest) fits the budget."""
    groups, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and max(longest, n) * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def length_grouped_micro_batches(
    attention_mask: torch.Tensor, rows: torch.Tensor, budget: int
) -> list[tuple[torch.Tensor, int]]:
    """``rows`` sorted by length and packed by token budget, each micro-batch with the width
    of its longest sequence: right padding beyond it is never computed."""
    lengths = attention_mask[rows].sum(1)
    order = lengths.argsort(stable=True)
    sorted_lengths = lengths[order].tolist()
    return [
        (rows[order[idx]], max(sorted_lengths[j] for j in idx))
        for idx in pack_by_tokens(sorted_lengths, budget)
    ]


def sequence_token_advantages(
    batch, ref_logp: torch.Tensor | None, alg, group_size: int, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token advantages ``[B, L]`` of ``batch`` (an ``LLMBatch``): the sequence reward sits
    on its last generated token; with ``kl_coef`` > 0 the KL to ``ref_logp`` is taken from
    every generated token's reward first (``algorithm.kl_in: reward``). ``alg`` supplies
    ``adv_type``, ``gamma``, ``kl_kind`` and ``kl_clamp``."""
    mask = batch.loss_mask
    last = mask.shape[1] - 1 - torch.flip(mask.long(), [1]).argmax(1)
    token_rewards = torch.zeros(mask.shape, device=mask.device)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = batch.rewards
    if kl_coef > 0:
        kl = kl_estimate(batch.logprobs, ref_logp, alg.kl_kind, alg.kl_clamp)
        token_rewards = token_rewards - kl_coef * torch.where(mask, kl, 0.0)
    adv, _ = get_advantage(alg.adv_type)(
        rewards=token_rewards.T,
        mask=mask.T,
        group_size=group_size,
        groups=batch.group_ids,
        gamma=alg.gamma,
    )
    return adv.T.float()
