"""Offloading a model's state to host memory while another worker uses the device.

Collocated layouts (actor and rollout on one GPU, taking turns) need the actor to step off the
device while the rollout generates. ``HostOffload`` copies each distinct storage of the given
tensors (parameters, gradients, optimizer state) into host memory (pinned on CUDA) and frees it
(``untyped_storage().resize_(0)``); ``onload`` gives each storage its bytes back and copies them
in. The tensor objects never change, so the optimizer's and DDP's references stay valid and
training continues bitwise. On the CPU "device" and host are both the CPU: the originals are
freed all the same, which is what makes the mechanism testable there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


def module_and_optimizer_tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and every tensor of the optimizer's state."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    return tensors


class HostOffload:
    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the tensors' storages to host memory and free them; returns the bytes freed."""
        if self._held:
            raise RuntimeError("offload: the state is offloaded already (onload first)")
        tensors = _owning(list(tensors))
        seen: set[int] = set()
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                host = host.pin_memory()
            host.copy_(storage, non_blocking=storage.device.type == "cuda")
            self._held.append((storage, host))
        if any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()
        for storage, _ in self._held:
            freed += storage.nbytes()
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    @torch.no_grad()
    def onload(self) -> int:
        """Give every freed storage its bytes back from the host copy; returns the bytes."""
        restored = 0
        for storage, host in self._held:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=storage.device.type == "cuda")
            restored += host.nbytes()
        if any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()
        self._held = []
        return restored


def _owning(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, each one whose storage cannot be freed in place (weights a CPU model
    reads memory-mapped from safetensors) first given a copy of its own: the tensor object,
    which optimizers and modules hold, stays the same."""
    copied: set[int] = set()
    for t in tensors:
        if not t.untyped_storage().resizable() and id(t) not in copied:
            t.data = t.data.clone()
            copied.add(id(t))
    return tensors


class HostParkedModule:
    """A frozen module (a KL reference copy, say) whose weights can wait in host memory.

    ``park`` and ``unpark`` move them off and back around a collocated phase (with the
    engine's ``offload``); with ``resident_on_host`` they live on the host and come to the
    device only inside ``in_use()``, one pass at a time. Anything but a module (None, or a
    view of another model's weights such as LoRA's adapters-disabled reference) is held as
    is and never moved.
    """

    def __init__(self, module, resident_on_host: bool = False):
        self.module, self.resident_on_host = module, resident_on_host
        self._host = HostOffload()
        if resident_on_host:
            self.park()

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def park(self) -> int:
        """Its weights to host memory (a no-op when already there); the bytes freed."""
        if not isinstance(self.module, torch.nn.Module) or self._host.offloaded:
            return 0
        return self._host.offload(self._tensors())

    def unpark(self) -> int:
        """Back on the device, unless they live on the host between uses."""
        if self.resident_on_host or not self._host.offloaded:
            return 0
        return self._host.onload()

    def resident_bytes(self) -> int:
        """Bytes its weights' storages hold now (0 while parked; a non-module holds none)."""
        if not isinstance(self.module, torch.nn.Module):
            return 0
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self._tensors()}
        return sum(s.nbytes() for s in storages.values())

    @contextlib.contextmanager
    def in_use(self):
        """The module with its weights on the device for the duration of the block."""
        if not self._host.offloaded:
            yield self.module
            return
        self._host.onload()
        try:
            yield self.module
        finally:
            self._host.offload(self._tensors())
