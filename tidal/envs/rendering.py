"""Offscreen MuJoCo rendering on the CPU, fast enough to train from pixels.

MuJoCo's defaults (a 4096² shadow map, reflections, 4x multisampling, all in software) render
MetaWorld at about 10 frames/s here; with them off, about 100-120. ``select_gl_backend`` must
run before ``mujoco`` is first imported: the backend is read once, at import.
"""

from __future__ import annotations

import ctypes.util
import os

import numpy as np

from tidal.extras import needs_extra

_BACKEND_LIBRARIES = {"egl": "EGL", "osmesa": "OSMesa"}


def select_gl_backend(required: bool = True) -> str | None:
    """Keep the user's ``MUJOCO_GL``; else EGL when libEGL is installed, else OSMesa.
    ``tidal.envs`` calls it at import (not required), before anything imports ``mujoco``."""
    chosen = os.environ.get("MUJOCO_GL")
    if chosen:
        return chosen
    for backend, library in _BACKEND_LIBRARIES.items():
        if ctypes.util.find_library(library):
            os.environ["MUJOCO_GL"] = backend
            return backend
    if required:
        raise RuntimeError(
            "offscreen rendering needs libEGL or libOSMesa; neither is installed "
            "(`make system-deps`, or apt-get install libegl1 / libosmesa6)"
        )
    return None


select_gl_backend(required=False)


class FastCamera:
    """Renders one named camera of a MuJoCo model at ``size``², RGB uint8, the right way up.

    Shadows, reflections and multisampling are off. Cameras whose image-up axis points below
    the horizon (MetaWorld's ``corner`` cameras are rolled 180°) are rolled back, which keeps
    left and right as the camera sees them (a vertical flip alone would mirror the scene).
    Every frame is checked: a uniform frame (all black, say, from a broken GL context) is an
    error rather than silent training on nothing.
    """

    def __init__(
        self, model, data, camera: str, size: int, height: int | None = None, upright: bool = True
    ):
        """``size`` wide and ``height`` (default ``size``) high; ``upright``: undo a camera's
        roll past the horizon (off for a camera that turns with a hand)."""
        select_gl_backend()
        with needs_extra("embodied", "MuJoCo rendering (pixel observations, eval videos)"):
            import mujoco

        self.data = data
        self.camera_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
        if self.camera_id < 0:
            names = [model.camera(i).name for i in range(model.ncam)]
            raise ValueError(
                f"env camera: the model has no camera {camera!r}; it has {', '.join(names)}"
            )
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, size)
        height = size if height is None else height
        model.vis.global_.offheight = max(model.vis.global_.offheight, height)
        try:
            self.renderer = mujoco.Renderer(model, height, size)
        except mujoco.FatalError as exc:
            raise RuntimeError(
                f"cannot render offscreen with MUJOCO_GL={os.environ.get('MUJOCO_GL')!r} ({exc}); "
                "set MUJOCO_GL=egl (or osmesa) before mujoco is first imported"
            ) from exc
        self._flags = self.renderer.scene.flags
        self._off = (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION)
        self.camera, self.upright = camera, upright
        _release_current_context()

    def render(self) -> np.ndarray:
        self.renderer.update_scene(self.data, camera=self.camera_id)
        for flag in self._off:
            self._flags[flag] = 0
        try:
            image = self.renderer.render()
        finally:
            _release_current_context()
        if (
            self.upright and self.data.cam_xmat[self.camera_id][7] < 0
        ):  # world z of the camera's up axis
            image = image[::-1, ::-1]
        if image.max() == image.min():
            raise RuntimeError(
                f"camera {self.camera!r} rendered a blank frame (every pixel {int(image.max())}): "
                f"the OpenGL backend MUJOCO_GL={os.environ.get('MUJOCO_GL')!r} is not drawing here; "
                "try MUJOCO_GL=egl or MUJOCO_GL=osmesa (apt-get install libosmesa6)"
            )
        return image

    def close(self) -> None:
        self.renderer.close()


def _release_current_context() -> None:
    """An EGL context is current in one thread at a time, and env workers may build an env in
    one thread and step it in another (local backend, pipelined stages): let go of the context
    after each use so whichever thread renders next can take it."""
    if os.environ.get("MUJOCO_GL") != "egl":
        return
    from mujoco import egl

    if egl.EGL_DISPLAY is not None:
        egl.EGL.eglMakeCurrent(
            egl.EGL_DISPLAY, egl.EGL.EGL_NO_SURFACE, egl.EGL.EGL_NO_SURFACE, egl.EGL.EGL_NO_CONTEXT
        )
