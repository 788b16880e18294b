"""Split and merge batches along their first dimension.

A batch is a tensor, a NumPy array, a dict / list / tuple of batches, or a dataclass whose
fields are batches; ``None`` and plain scalars pass through unchanged (taken from the first
shard when merging).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch


def batch_size(batch: Any) -> int:
    """The size of the first dimension of the first array found in ``batch``."""
    size = _first_size(batch)
    if size is None:
        raise ValueError(
            f"cannot infer a batch size from {type(batch).__name__}: it holds no tensor"
        )
    return size


def _first_size(batch: Any) -> int | None:
    shape = getattr(batch, "shape", None)  # a tensor or an array (cheaper than isinstance)
    if shape is not None and isinstance(shape, tuple):  # torch.Size is a tuple
        return shape[0] if shape else None
    for value in _children(batch):
        size = _first_size(value)
        if size is not None:
            return size
    return None


def _children(batch: Any) -> list:
    if isinstance(batch, dict):
        return list(batch.values())
    if isinstance(batch, (list, tuple)):
        return list(batch)
    if _is_dataclass_type(type(batch)):  # an instance (a dataclass type itself is a ``type``)
        if hasattr(batch, "__dict__"):  # field order; much cheaper than dataclasses.fields()
            return list(batch.__dict__.values())
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return []


@functools.cache
def _is_dataclass_type(cls: type) -> bool:
    """Cached per type: ``batch_size`` runs on every channel hand-off, at both ends."""
    return dataclasses.is_dataclass(cls)


def split_batch(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut ``batch`` into consecutive shards of ``sizes`` along dim 0."""
    total = batch_size(batch)
    if sum(sizes) != total:
        raise ValueError(f"split sizes {sizes} add up to {sum(sizes)}, but the batch has {total}")
    return [
        _map(batch, lambda x, s=start, n=size: x[s : s + n])
        for start, size in zip(_offsets(sizes), sizes)
    ]


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _map(batch: Any, fn) -> Any:
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return fn(batch) if batch.ndim else batch
    if isinstance(batch, dict):
        return type(batch)((k, _map(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch,
            **{
                f.name: _map(getattr(batch, f.name), fn)
                for f in dataclasses.fields(batch)
                if f.init
            },
        )
    return batch


def merge_batches(shards: list[Any]) -> Any:
    """Concatenate shards of one structure along dim 0 (the inverse of ``split_batch``)."""
    if not shards:
        raise ValueError("merge_batches: no shards to merge")
    if len(shards) == 1:
        return shards[0]
    first = shards[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(shards, 0) if first.ndim else first
    if isinstance(first, np.ndarray):
        return np.concatenate(shards, 0) if first.ndim else first
    if isinstance(first, dict):
        return type(first)((k, merge_batches([s[k] for s in shards])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge_batches(list(vals)) for vals in zip(*shards)))
    if isinstance(first, (list, tuple)):
        return type(first)(merge_batches(list(vals)) for vals in zip(*shards))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(
            first, **{n: merge_batches([getattr(s, n) for s in shards]) for n in fields}
        )
    return first
