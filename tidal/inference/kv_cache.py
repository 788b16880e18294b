"""The engine's batch KV cache: one ``DynamicCache`` whose rows are left-padded to a common
length, with the attention mask that says which columns hold real tokens. Requests join by
merging their prefilled cache in, and leave by having their rows dropped."""

from __future__ import annotations

import inspect

import torch

from tidal.extras import needs_extra

with needs_extra("llm", "the generation engine"):
    from transformers import DynamicCache


def cache_key(model) -> str:
    """What the model's forward calls its KV cache, in and out: ``cache`` in newer transformers
    (5.25, where ``past_key_values`` is deprecated until 5.40), ``past_key_values`` in older
    ones (5.17, which has no ``cache``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_logits_only(model) -> dict:
    """The forward's keyword that computes the logits of the last position only
    (``logits_to_keep=1``, as transformers' own generate passes it), where the model takes it."""
    return (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )


def merge_caches(
    cache: DynamicCache | None, mask: torch.Tensor | None, new: DynamicCache, new_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """The batch's cache and mask with ``new``'s rows after its own; whichever is shorter is
    padded on the left so both have one length. ``cache=None``: ``new`` alone."""
    fresh = _layers(new)
    if cache is None:
        return DynamicCache(fresh), new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    merged = [
        (
            torch.cat([_left_pad(k0, width), _left_pad(k1, width)]),
            torch.cat([_left_pad(v0, width), _left_pad(v1, width)]),
        )
        for (k0, v0), (k1, v1) in zip(_layers(cache), fresh)
    ]
    mask = torch.cat([_left_pad(mask, width, dim=1), _left_pad(new_mask, width, dim=1)])
    return DynamicCache(merged), mask


def keep_rows(
    cache: DynamicCache, mask: torch.Tensor, rows: list[int]
) -> tuple[DynamicCache, torch.Tensor]:
    """Only ``rows`` of the batch, without the columns every one of them pads."""
    index = torch.tensor(rows, device=mask.device)
    mask = mask[index]
    first = int((mask.sum(0) > 0).nonzero()[0])
    kept = [(k[index][:, :, first:], v[index][:, :, first:]) for k, v in _layers(cache)]
    return DynamicCache(kept), mask[:, first:]


def cache_nbytes(cache: DynamicCache | None) -> int:
    return sum(k.nbytes + v.nbytes for k, v in _layers(cache)) if cache is not None else 0


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim)
