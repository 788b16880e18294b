"""Files tidal writes outside a run's checkpoints: where it keeps what it derives once and
reuses (converted GGUF models, shrunk LIBERO textures: ``$TIDAL_CACHE``, default
``~/.cache/tidal``), and how a file is written so that no reader ever sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal")


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` beside ``path``, flush it to disk, then rename it over ``path``: a crash
    leaves the old file or the new one, and processes writing the same path at once are safe."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
