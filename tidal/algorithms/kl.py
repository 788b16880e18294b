"""Per-element KL estimators between the sampling policy and a reference policy."""

from __future__ import annotations

import torch

from tidal.algorithms._tensors import check_same_shape, compute_dtype

KL_KINDS = ("k1", "k2", "k3", "abs")
_LOG_RATIO_LIMIT = 20.0


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", clamp: float | None = None
) -> torch.Tensor:
    """Estimate ``KL(pi || ref)`` per element from samples of ``pi``, with ``d = logp - ref_logp``:

    - ``k1``: ``d`` (unbiased, high variance, can be negative);
    - ``k2``: ``d^2 / 2`` (biased, low variance);
    - ``k3``: ``exp(-d) - 1 + d`` (unbiased, non-negative; d clamped to ±20 first);
    - ``abs``: ``|d|``.

    ``clamp``: each estimate bounded to ``[-clamp, clamp]`` (AReaL and RLinf do the same), so
    one very unlikely token cannot dominate a loss or a shaped reward.
    """
    kl = _estimate(logp, ref_logp, kind)
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def _estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    check_same_shape(logp=logp, ref_logp=ref_logp)
    dtype = compute_dtype(logp)
    d = logp.to(dtype) - ref_logp.to(dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        d = d.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return torch.expm1(-d) + d
    if kind == "abs":
        return d.abs()
    raise ValueError(f"kl kind: expected one of {', '.join(KL_KINDS)}, got {kind!r}")
