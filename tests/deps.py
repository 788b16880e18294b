"""Optional test dependencies: skipped where missing on a developer's machine, a failure in CI."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """CI sets CI=true (.ci/run does, as GitHub Actions and most CI services do)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def require(module: str) -> ModuleType:
    """``module`` imported; missing, the calling test module is skipped, except under CI, where
    the ImportError fails the run (`make setup` installs every dev dependency, so a missing one
    is a broken install, not a reason for a green CI)."""
    if in_ci():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (CI fails on this)")
