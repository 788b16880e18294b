"""``disk``: the sender writes a safetensors file into a shared folder, every receiver reads it.
For engines that only reload from disk, and for ranks that share a file system. Update ``n`` is
``<folder>/<link>-<n>.safetensors``, written to a temporary name and renamed into place; a
receiver waits for the next number (bounded by the link's timeout)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from safetensors.torch import load_file, safe_open, save_file

from tidal.runtime.weight_sync.base import WEIGHT_TRANSPORTS, WeightTransport
from tidal.runtime.weights import WeightsUpdate

POLL_S = 0.005
KEEP = 2  # updates kept: a slow receiver still finds the one before the newest


@WEIGHT_TRANSPORTS.register("disk")
class DiskTransport(WeightTransport):
    name = "disk"

    def __init__(self, spec, role, rank):
        super().__init__(spec, role, rank)
        self.folder = Path(spec.options["folder"])
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sequence = 0

    def path(self, n: int) -> Path:
        return self.folder / f"{self.spec.name}-{n}.safetensors"

    def send(self, tensors, version: int, snapshot: bool = False) -> None:
        state = {k: v.detach().contiguous().cpu() for k, v in tensors}
        tmp = self.path(self.sequence).with_suffix(".tmp")
        try:
            save_file(state, str(tmp), metadata={"version": str(version)})
            os.replace(tmp, self.path(self.sequence))
        except OSError as exc:
            raise self.error(f"write of {tmp}", exc) from exc
        self.path(self.sequence - KEEP).unlink(missing_ok=True)
        self.sequence += 1

    def recv(self) -> WeightsUpdate:
        path, deadline = self.path(self.sequence), time.monotonic() + self.spec.timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise self.error(f"wait for {path}", f"timed out after {self.spec.timeout_s:g} s")
            time.sleep(POLL_S)
        with safe_open(str(path), "pt") as f:
            version = int(f.metadata()["version"])
        self.sequence += 1
        return WeightsUpdate(version, load_file(str(path)))
