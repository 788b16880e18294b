"""The engine's batch KV cache: one ``DynamicCache`` whose rows are left-padded to a common
length, with the attention mask that says which columns hold real tokens. Requests join by
merging their prefilled cache in, and leave by having their rows dropped."""

from __future__ import annotations

import inspect
from collections import OrderedDict

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


Layers = list[tuple[torch.Tensor, torch.Tensor]]  # a row's (keys, values) per layer, unpadded


class PromptCache:
    """The KV rows and last-position logits of recently prefilled prompts, for the weights that
    computed them (cleared when they change), the least recently used dropped beyond
    ``capacity``. A GRPO group's samples ask with one prompt but reach the engine apart, across
    prefills: the prompt is computed once."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._rows: OrderedDict[tuple[int, ...], tuple[Layers, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, prompt: tuple[int, ...]) -> tuple[Layers, torch.Tensor] | None:
        row = self._rows.get(prompt)
        if row is not None:
            self._rows.move_to_end(prompt)
        return row

    def put(self, prompt: tuple[int, ...], layers: Layers, logits: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._rows[prompt] = (layers, logits)
        self._rows.move_to_end(prompt)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()


def row_layers(cache: DynamicCache, row: int, length: int) -> Layers:
    """Row ``row`` of a left-padded cache without its padding, as tensors of its own (not views
    that would keep the whole batch's cache alive)."""
    return [(k[row : row + 1, :, -length:].clone(), v[row : row + 1, :, -length:].clone())
            for k, v in _layers(cache)]  # fmt: skip


def stack_rows(rows: list[Layers], lengths: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """Unpadded rows as one left-padded cache, and its mask."""
    width = max(lengths)
    layers = [
        (
            torch.cat([_left_pad(row[i][0], width) for row in rows]),
            torch.cat([_left_pad(row[i][1], width) for row in rows]),
        )
        for i in range(len(rows[0]))
    ]
    device = layers[0][0].device
    mask = torch.stack([torch.arange(width, device=device) >= width - n for n in lengths]).long()
    return DynamicCache(layers), mask
