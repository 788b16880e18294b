"""Where tidal keeps what it derives once and reuses (converted GGUF models, shrunk LIBERO
textures): ``$TIDAL_CACHE``, default ``~/.cache/tidal``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal")
