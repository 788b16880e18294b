"""Smaller textures for LIBERO's scenes.

MuJoCo compiles every texture into each env's model at full size: LIBERO-Object's object
textures are 2048 pixels a side and the basket's 4096, 147 MB of the ~270 MB model of one env,
and an env rank holds tens of envs. Cameras of 256 pixels or less show an object in a few dozen,
and MuJoCo's renderer mip-maps a texture down to what the screen shows anyway, so a 2-D texture
shrunk to ``max_texture_size`` a side (area-averaged, cached as a PNG under ``$TIDAL_CACHE``)
looks the same in a picture and costs a fraction of the memory. Cube and skybox textures (grids
of faces) stay as they are.

robosuite compiles the model inside its constructor, before ``set_xml_processor`` can be
called, so ``shrunk_textures(limit)`` wraps the constructions: a hook installed once on
robosuite's ``MujocoEnv._initialize_sim`` gives the envs made inside it the processor (a context
variable: env ranks that build their envs in threads of one process do not see each other's).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

from tidal.files import atomic_write, cache_root

_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar("libero_texture_limit", default=0)
_INSTALL = threading.Lock()


@contextlib.contextmanager
def shrunk_textures(limit: int):
    """robosuite envs constructed inside shrink their 2-D textures to ``limit`` pixels a side
    (0: as they are)."""
    _install_hook()
    token = _LIMIT.set(limit)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def _install_hook() -> None:
    from robosuite.environments.base import MujocoEnv

    with _INSTALL:
        if getattr(MujocoEnv._initialize_sim, "_tidal_textures", False):
            return
        original = MujocoEnv._initialize_sim

        @functools.wraps(original)
        def initialize_sim(self, xml_string=None):
            if (limit := _LIMIT.get()) and self._xml_processor is None:
                self._xml_processor = functools.partial(shrink_textures, limit=limit)
            return original(self, xml_string)

        initialize_sim._tidal_textures = True
        MujocoEnv._initialize_sim = initialize_sim


def shrink_textures(xml: str, limit: int) -> str:
    """``xml`` with each 2-D texture file larger than ``limit`` pixels a side replaced by a copy
    shrunk to fit."""
    root = ET.fromstring(xml)
    changed = False
    for texture in root.iter("texture"):
        file = texture.get("file")
        if file and texture.get("type") == "2d":
            small = _shrunk(file, limit)
            if small != file:
                texture.set("file", small)
                changed = True
    return ET.tostring(root, encoding="unicode") if changed else xml


@functools.cache
def _shrunk(file: str, limit: int) -> str:
    """The path of ``file`` shrunk to ``limit`` pixels a side (``file`` itself when it fits)."""
    import cv2  # robosuite's and LIBERO's own dependency

    stat = os.stat(file)
    key = hashlib.sha1(f"{file}:{stat.st_size}:{stat.st_mtime_ns}:{limit}".encode()).hexdigest()
    target = cache_root() / "libero-textures" / f"{Path(file).stem}-{key[:16]}.png"
    if target.exists():
        return str(target)
    image = cv2.imread(file, cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"LIBERO texture {file!r}: not an image cv2 can read")
    height, width = image.shape[:2]
    if max(height, width) <= limit:
        return file
    scale = limit / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    small = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    target.parent.mkdir(parents=True, exist_ok=True)
    ok, encoded = cv2.imencode(".png", small)
    if not ok:
        raise ValueError(f"LIBERO texture {file!r}: cv2 could not encode its shrunk copy")
    atomic_write(target, encoded.tobytes())  # env ranks shrinking one file at once: safe
    return str(target)
