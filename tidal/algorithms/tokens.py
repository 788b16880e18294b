"""Token-level math of the language trainer: chosen-token log-probs, micro-batches packed by
token budget, and per-token advantages of sequence rewards. The embodied twin is ``chunks.py``.

Batch-major throughout: ``input_ids``, ``attention_mask``, ``loss_mask`` are ``[B, L]``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tidal.algorithms.advantages import get_advantage
from tidal.algorithms.kl import kl_estimate

# positions projected onto the vocabulary at once, over the micro-batch's rows: a chunk's float
# logits are [rows, LOGIT_CHUNK_TOKENS / rows, vocab] (49k vocabulary: 200 MB at 1024 tokens)
LOGIT_CHUNK_TOKENS = 1024


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    wanted: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[:, t]`` = log-prob of ``input_ids[:, t]`` given the tokens before it, under
    ``softmax(logits / temperature)`` (the engine's definition); column 0 is 0. With
    ``wanted`` (bool, like ``input_ids``) only those positions are projected onto the
    vocabulary (the generated tokens: a prompt's positions feed the context but need no
    log-prob, and the head is a fifth of a small model's forward); the others are 0. A 4-D
    ``attention_mask`` (with ``position_ids``) goes to the model as it is: packed rows
    (tidal.algorithms.prefix).

    The whole ``[B, L, vocab]`` logits never exist. The model runs as it is called (so DDP,
    FSDP and adapters, enabled or not, apply), and where its output head receives the final
    hidden states, the chosen tokens' log-probs are taken from them chunk by chunk; the head
    itself then computes the last position only. Under autograd each chunk is checkpointed
    (but under FSDP2): its logits are recomputed in the backward pass instead of kept, so the
    gradients are those of the whole form."""
    scale = temperature if temperature > 0 else 1.0
    head = output_head(model)
    # FSDP2's head weights are shards (DTensors) outside its forward: a recompute in the
    # backward pass would meet them sharded, so there each chunk keeps its logits instead
    recompute = not any(isinstance(p, DTensor) for p in head.parameters())
    picked = []

    def chosen_logprobs(head, args):
        pre_hook.remove()  # once: the chunks below call the head too
        hidden, targets = args[0][:, :-1], input_ids[:, 1:]
        if wanted is None:
            width = max(1, chunk_tokens // max(1, input_ids.shape[0]))
            picked.append(_chunked(head, hidden, targets, scale, width, recompute))
        elif not wanted[:, 1:].any():  # zeros still on the graph: a loss of 0 backpropagates
            picked.append(hidden.sum(-1).float() * 0)
        else:  # the wanted positions as one row, then back in place
            keep = wanted[:, 1:]
            row = _chunked(
                head, hidden[keep][None], targets[keep][None], scale, chunk_tokens, recompute
            )
            picked.append(torch.zeros(keep.shape, device=row.device).masked_scatter(keep, row[0]))
        return (hidden[:, :1], *args[1:])  # what the head itself then projects: one position

    def as_output(_head, _args, _logits):
        # the log-probs leave as the model's logits: wrappers that act on its outputs (FSDP2
        # gathers the head's weights for the backward pass there) see them as such
        if not picked:
            return None  # a chunk's own call of the head
        post_hook.remove()
        return picked[0][..., None]

    pre_hook = head.register_forward_pre_hook(chosen_logprobs)
    post_hook = head.register_forward_hook(as_output)
    try:
        mask = attention_mask if attention_mask.dim() == 4 else attention_mask.long()
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            logits_to_keep=0,
        )
    finally:
        pre_hook.remove()
        post_hook.remove()
    chosen = out.logits[..., 0]
    return torch.cat([torch.zeros_like(chosen[:, :1]), chosen], 1)


def _chunked(head, hidden, targets, scale: float, width: int, recompute: bool) -> torch.Tensor:
    pieces = []
    for start in range(0, hidden.shape[1], width):
        h, t = hidden[:, start : start + width], targets[:, start : start + width]
        if recompute and torch.is_grad_enabled() and h.requires_grad:
            pieces.append(checkpoint(_chosen, head, h, t, scale, use_reentrant=False))
        else:
            pieces.append(_chosen(head, h, t, scale))
    return torch.cat(pieces, 1) if pieces else hidden.new_zeros(targets.shape)


def _chosen(head, hidden: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    logits = head(hidden).float() / scale
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)


def output_head(model):
    """The causal LM's output head, through the wrappers the trainer calls it in (DDP's
    ``module``, the reference's ``model`` with adapters disabled)."""
    inner = model
    while not hasattr(inner, "get_output_embeddings"):
        inner = getattr(inner, "module", None) or inner.model
    return inner.get_output_embeddings()


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
