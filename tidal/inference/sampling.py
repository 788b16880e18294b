"""How the engine draws a token per row of a batch, and the log-probabilities it reports."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, reqs: list) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One token per row of ``logits`` ``[B, V]``, each row's request (``reqs[i]``) giving its
    ``params`` and ``generator``: greedy rows take the argmax, the others draw by inverse CDF
    from one uniform of their own generator (seeded requests repeat). Returns the tokens, their
    log-probs (temperature-scaled, before top-k / top-p) and each row's top log-probs if asked."""
    temps = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in reqs], device=logits.device
    )
    logp = torch.log_softmax(logits / temps[:, None], -1)
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = logp[rows].exp()
        for j, i in enumerate(sampled):
            p = reqs[i].params
            if (p.top_k and 0 < p.top_k < probs.shape[-1]) or p.top_p < 1.0:
                probs[j] = _filtered_probs(logp[i], p.top_k, p.top_p)
        cdf = probs.cumsum(-1)
        # 1 - U(0, 1) lies in (0, 1]: the first index reaching it has a nonzero probability
        u = torch.cat([1.0 - torch.rand(1, generator=reqs[i].generator) for i in sampled])
        u = u.to(logits.device)  # drawn on the host: each request's generator is a CPU one
        picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
        tokens[rows] = picked.clamp(max=probs.shape[-1] - 1)
    # a token the model gives probability 0 has log-prob -inf, which JSON cannot carry
    floor = torch.finfo(logp.dtype).min
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp(min=floor)
    tops = [None] * len(reqs)
    for i, r in enumerate(reqs):
        if r.params.top_logprobs:
            values, ids = logp[i].topk(min(r.params.top_logprobs, logp.shape[-1]))
            tops[i] = list(zip(ids.tolist(), values.clamp(min=floor).tolist()))
    return tokens, chosen, tops


def _filtered_probs(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    probs = logp.exp()
    if top_k and top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # keep the smallest set reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, 0.0)
    return probs / probs.sum()
