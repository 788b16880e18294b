"""What a receiver checks before it loads an update: a refused update changes nothing."""

from __future__ import annotations

import torch


class WeightsRejected(ValueError):
    """An update that does not fit the model (keys, shapes, dtypes) or holds non-finite values;
    nothing of it was applied."""


def check_weights(
    current: dict[str, torch.Tensor], update: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair every tensor of ``current`` (a model's state dict) with its new value in ``update``,
    after checking all of them: the same keys (a key tied to another, e.g. a language-model head sharing
    the embedding, may be left out), the same shapes, a compatible dtype (floating point may
    change precision, nothing else may change) and finite values. Raises ``WeightsRejected``."""
    unexpected = sorted(set(update) - set(current))
    if unexpected:
        raise WeightsRejected(
            f"weights: unexpected keys {unexpected[:5]} (the model has no such tensors)"
        )
    supplied_storage = {current[k].data_ptr() for k in update}
    missing = sorted(
        k for k in current if k not in update and current[k].data_ptr() not in supplied_storage
    )
    if missing:
        raise WeightsRejected(
            f"weights: missing keys {missing[:5]} ({len(missing)} of {len(current)} tensors)"
        )
    pairs = []
    for key, source in update.items():
        target = current[key]
        if not isinstance(source, torch.Tensor):
            raise WeightsRejected(f"weights: {key} is a {type(source).__name__}, not a tensor")
        if source.shape != target.shape:
            raise WeightsRejected(
                f"weights: {key} has shape {list(source.shape)}, the model expects "
                f"{list(target.shape)}"
            )
        same_kind = source.dtype.is_floating_point and target.dtype.is_floating_point
        if source.dtype != target.dtype and not same_kind:
            raise WeightsRejected(
                f"weights: {key} has dtype {source.dtype}, the model expects {target.dtype}"
            )
        pairs.append((target, source))
    bad = first_non_finite(update)
    if bad is not None:
        raise WeightsRejected(f"weights: {bad} holds non-finite values (NaN or inf)")
    return pairs


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first key whose floating-point tensor holds NaN or inf, else None. One pass per
    tensor, no temporary: ``aminmax`` propagates NaN, and an inf is the min or the max, so all is
    finite exactly when every bound is (10x faster here than ``isfinite(t).all()``, 5-10x the
    fused ``t * 0`` sums tidal used before); one host sync for all of them. Only a failing
    update is searched key by key."""
    floats = {k: t for k, t in tensors.items() if t.dtype.is_floating_point and t.numel()}
    if not floats:
        return None
    bounds = torch.stack([b.float() for t in floats.values() for b in torch.aminmax(t)])
    if bool(bounds.isfinite().all()):
        return None
    return next(k for k, t in floats.items() if not bool(torch.isfinite(t).all()))


@torch.no_grad()
def load_checked(
    module: torch.nn.Module, update: dict[str, torch.Tensor], adopt: bool = False
) -> None:
    """Every tensor checked, then loaded into ``module`` (``load_state_dict`` copies as it goes
    and raises after: a mis-shaped tensor would leave the others loaded). ``adopt``: tensors of
    the same dtype and device become the module's storage (no copy); see ``WeightsUpdate.owned``."""
    pairs = check_weights(module.state_dict(), update)
    if not adopt:
        for target, source in pairs:
            target.copy_(source)
        return
    live = dict(module.named_parameters(remove_duplicate=False))
    live.update(module.named_buffers(remove_duplicate=False))
    for key, (target, source) in zip(update, pairs):
        owner = live.get(key)
        if owner is not None and owner.dtype == source.dtype and owner.device == source.device:
            owner.data = source
        else:
            target.copy_(source)
