"""The torch device a rank computes on (``cluster.device``), and moving records onto it.

A rank placed on a GPU sees exactly one (its ``CUDA_VISIBLE_DEVICES`` is set by placement), so
``cuda`` means ``cuda:0`` of the rank's own view. ``auto`` takes CUDA where the rank sees a GPU
and the CPU elsewhere; ``cuda`` where none is visible is an error naming the rank. Models live on
the device; a batch moves to it once, and only what crosses a channel leaves it (``to_host``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

DEVICE_SETTINGS = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """``cluster.device`` asks for a device this rank (or node) does not have."""


def cuda_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_device(
    setting: str = "auto", who: str = "this process", placed_on_gpu: bool = False
) -> torch.device:
    """``cluster.device`` as this rank's ``torch.device``. A rank placed on a GPU whose torch
    sees none (a CPU build of torch on a GPU node) is an error unless ``cpu`` is asked for:
    ``auto`` would otherwise train on the CPU without a word."""
    if setting not in DEVICE_SETTINGS:
        raise DeviceError(
            f"cluster.device: expected one of {', '.join(DEVICE_SETTINGS)}, got {setting!r}"
        )
    if setting == "cpu":
        return torch.device("cpu")
    if cuda_visible():
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "cuda" or placed_on_gpu:
        raise DeviceError(
            f"cluster.device: {setting}, but {who} "
            f"{'is placed on a GPU and ' if placed_on_gpu else ''}sees no CUDA device (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={_visible_env()!r}); set cluster.device=auto or cpu, or "
            "install a CUDA build of torch (make TORCH_SPEC=...)"
        )
    return torch.device("cpu")


def check_device_setting(setting: str, gpu_nodes: int | None = None) -> None:
    """Before any worker starts: ``cuda`` needs CUDA here (``gpu_nodes`` None: the driver is
    the node) or at least one GPU node in the cluster."""
    if setting not in DEVICE_SETTINGS:
        raise DeviceError(
            f"cluster.device: expected one of {', '.join(DEVICE_SETTINGS)}, got {setting!r}"
        )
    if setting != "cuda":
        return
    if gpu_nodes is None and not cuda_visible():
        resolve_device("cuda", "this node")
    if gpu_nodes == 0:
        raise DeviceError(
            "cluster.device: cuda, but no node of the cluster has a GPU; set cluster.device=auto or cpu"
        )


def _visible_env() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of a record (dataclass, dict, list, tuple) on ``device``; the rest as is.
    A tensor already there is not copied."""
    return _map_all(batch, lambda t: t.to(device, non_blocking=non_blocking))


def to_host(batch: Any) -> Any:
    """What crosses a channel: every tensor of a record on the CPU (a no-op on CPU ranks)."""
    return _map_all(batch, lambda t: t.cpu() if t.device.type != "cpu" else t)


def _map_all(batch: Any, fn) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map_all(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_all(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_all(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _map_all(getattr(batch, f.name), fn)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on the device (fp32 master weights stay fp32); a no-op when disabled."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
