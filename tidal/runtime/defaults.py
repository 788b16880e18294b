"""Defaults shared by every part of the runtime."""

from __future__ import annotations

# Every wait has a bound; the one used when the caller gives none (handles, channels, groups) is
# the config's default ``runner.timeout_s`` (``TIDAL_WAIT_TIMEOUT`` overrides it for a process).
from tidal.config.common import DEFAULT_TIMEOUT_S

# How long starting a group's ranks (scheduling and constructing them) may take.
LAUNCH_TIMEOUT_S = 180.0

__all__ = ["DEFAULT_TIMEOUT_S", "LAUNCH_TIMEOUT_S"]
