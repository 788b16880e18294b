"""The embodied runner of each algorithm (``algorithm.name``), registered by name: ``ppo`` the
on-policy ``EmbodiedRunner``, ``sac`` the off-policy one; imported when a run starts."""

from __future__ import annotations

import importlib
from pathlib import Path

from tidal.registry import Registry

EMBODIED_RUNNERS: Registry[str] = Registry("embodied runner", "algorithm.name")
EMBODIED_RUNNERS.register("ppo")("tidal.runners.embodied.train:EmbodiedRunner")
EMBODIED_RUNNERS.register("sac")("tidal.runners.embodied.offpolicy:OffPolicyRunner")


def runner_class(name: str) -> type:
    module, _, cls = EMBODIED_RUNNERS.get(name).partition(":")
    return getattr(importlib.import_module(module), cls)


def make_runner(cfg, run_dir: Path | None = None):
    """The runner ``cfg.algorithm.name`` names, built (``tidal train`` calls this)."""
    return runner_class(cfg.algorithm.name)(cfg, run_dir)
