"""What both actors (embodied and language) do for ``actor.offload`` and ``actor.ref_offload``:
the train engine's state and the KL reference copy step off the device together while the
rollout generates, and a host-resident reference comes to the device only for its pass."""

from __future__ import annotations

from tidal.runtime.offload import HostParkedModule


class ActorOffload:
    """Mixed into an actor worker that has ``self.engine``, ``self.ref`` and ``self.cfg``."""

    def init_offload(self) -> None:
        self.reference = HostParkedModule(self.ref, resident_on_host=self.cfg.actor.ref_offload)

    def offload_engine(self) -> int:
        """``actor.offload``: parameters, gradients, optimizer state and the reference copy
        to host memory; returns the bytes freed."""
        return self.engine.offload() + self.reference.park()

    def onload_engine(self) -> int:
        return self.engine.onload() + self.reference.unpark()

    def reference_bytes(self) -> int:
        """Bytes the reference copy's weights hold in their storages now (0 while they wait
        in host memory, or when there is no copy)."""
        return self.reference.resident_bytes()
