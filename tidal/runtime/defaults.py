"""Defaults shared by every part of the runtime."""

from __future__ import annotations

import os

# Every wait has a bound; this is the one used when the caller gives none (handles, channels,
# groups). ``TIDAL_WAIT_TIMEOUT`` overrides it for a whole process.
DEFAULT_TIMEOUT_S = float(os.environ.get("TIDAL_WAIT_TIMEOUT", "600"))

# How long starting a group's ranks (scheduling and constructing them) may take.
LAUNCH_TIMEOUT_S = 180.0
