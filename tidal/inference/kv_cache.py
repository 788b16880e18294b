"""The engine's batch KV cache: one ``DynamicCache`` whose rows are left-padded to a common
length, with the attention mask that says which columns hold real tokens. Requests join by
merging their prefilled cache in, and leave by having their rows dropped. Its layers keep room
to grow (``GrowingLayer``): a decode step writes one column in place."""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch

from tidal.extras import needs_extra

with needs_extra("llm", "the generation engine"):
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

# columns a layer's buffer gains when it is full: a copy of the cache every ROOM tokens at
# least, instead of every token; at most half the cache again (amortised, like a list)
ROOM = 64


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


class GrowingLayer(DynamicLayer):
    """A cache layer whose keys and values are the head of a longer buffer. ``DynamicLayer``
    concatenates each step's keys to the cache, copying the layer's whole cache every token
    (at GRPO's batch of 128 that copy costs about as much as the layer's matmuls); here a
    step writes its columns in place and the buffer grows, by copy, only when it is full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None = None):
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self._adopt(keys, values, extra=0, rows=rows)

    def _adopt(self, keys, values, extra: int, rows: torch.Tensor | None = None) -> None:
        length = keys.shape[-2]
        capacity = length + extra + max(ROOM, length // 2)
        self._buffers = tuple(_with_columns(x, capacity, rows) for x in (keys, values))
        self._expose(length)

    def _expose(self, length: int) -> None:
        self.keys, self.values = (b[:, :, :length] for b in self._buffers)

    def _holds_buffer_head(self) -> bool:
        """Whether the keys are still a head of the buffer (``crop`` keeps them one; a
        DynamicLayer method that selects rows makes new tensors)."""
        buffer = self._buffers[0]
        return self.keys.data_ptr() == buffer.data_ptr() and self.keys.stride() == buffer.stride()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self._holds_buffer_head():
            self._adopt(self.keys, self.values, extra=0)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if length + new > self._buffers[0].shape[-2]:
            self._adopt(self.keys, self.values, extra=new)
        for buffer, states in zip(self._buffers, (key_states, value_states)):
            buffer[:, :, length : length + new] = states
        self._expose(length + new)
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer`` s, from each layer's (keys, values) (their
    ``rows`` only, if given)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], rows=None):
        Cache.__init__(self, layers=[GrowingLayer(k, v, rows) for k, v in layers])


def _with_columns(x: torch.Tensor, capacity: int, rows: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` (its ``rows`` only, if given) copied into the first T columns of
    a buffer of ``capacity`` columns: one copy, the row selection included."""
    buffer = x.new_empty(
        x.shape[0] if rows is None else len(rows), x.shape[1], capacity, x.shape[-1]
    )
    head = buffer[:, :, : x.shape[-2]]
    head.copy_(x) if rows is None else torch.index_select(x, 0, rows, out=head)
    return buffer


def left_padded(prompts: list[tuple[int, ...]], device: torch.device):
    """Prompts as one left-padded batch: token ids, attention mask and positions ``[B, L]``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def merge_caches(
    cache: DynamicCache | None, mask: torch.Tensor | None, new: DynamicCache, new_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """The batch's cache and mask with ``new``'s rows after its own; whichever is shorter is
    padded on the left so both have one length. ``cache=None``: ``new`` alone."""
    if cache is None:
        return new, new_mask
    fresh = _layers(new)
    width = max(mask.shape[1], new_mask.shape[1])
    merged = [
        (
            torch.cat([_left_pad(k0, width), _left_pad(k1, width)]),
            torch.cat([_left_pad(v0, width), _left_pad(v1, width)]),
        )
        for (k0, v0), (k1, v1) in zip(_layers(cache), fresh)
    ]
    mask = torch.cat([_left_pad(mask, width, dim=1), _left_pad(new_mask, width, dim=1)])
    return GrowingCache(merged), mask


def keep_rows(
    cache: DynamicCache, mask: torch.Tensor, rows: list[int]
) -> tuple[DynamicCache, torch.Tensor]:
    """Only ``rows`` of the batch, without the columns every one of them pads."""
    index = torch.tensor(rows, device=mask.device)
    mask = mask[index]
    first = int((mask.sum(0) > 0).nonzero()[0])
    kept = [(k[:, :, first:], v[:, :, first:]) for k, v in _layers(cache)]
    return GrowingCache(kept, rows=index), mask[:, first:]


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
    return GrowingCache(layers), mask
