"""Small shared helpers: shape checks with clear messages and the compute dtype."""

from __future__ import annotations

import torch


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """All given (non-None) tensors must share the first one's shape."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.shape != ref.shape:
            raise ValueError(
                f"{name}: expected the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}"
            )


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32, ints, bools) computes in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def as_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A boolean mask shaped like `like` (all true when None)."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    check_shape("mask", mask, like.shape)
    return mask.bool()


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` divided by the mask's count (at least 1), or by
    ``denominator`` (a count over more than these elements: a whole minibatch)."""
    count = mask.sum().clamp(min=1) if denominator is None else max(denominator, 1e-12)
    return torch.where(mask, x, 0.0).sum() / count
