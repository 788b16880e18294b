"""Evaluation videos: frames ``[T, H, W, 3]`` (uint8) to a GIF (Pillow, always available) or an
MP4 (imageio with an ffmpeg or PyAV plugin, when installed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.extras import needs_extra


def tile(frames: np.ndarray) -> np.ndarray:
    """Frames of several envs ``[n, H, W, 3]`` side by side, ``[H, n * W, 3]``."""
    return np.concatenate(list(frames), axis=1)


def write_video(frames: list[np.ndarray] | np.ndarray, path: str | Path, fps: int = 20) -> Path:
    path = Path(path)
    frames = [np.asarray(f, dtype=np.uint8) for f in frames]
    if not frames:
        raise ValueError("write_video: no frames")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        images[0].save(
            path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0
        )
    elif path.suffix == ".mp4":
        with needs_extra("embodied", "mp4 videos"):
            import imageio.v3 as iio

        try:
            iio.imwrite(path, np.stack(frames), fps=fps)
        except Exception as exc:  # imageio names the missing plugin in its message
            raise RuntimeError(
                f"cannot write {path.name} ({exc}); pip install imageio-ffmpeg, or use .gif"
            ) from exc
    else:
        raise ValueError(f"write_video: expected a .gif or .mp4 path, got {path.name!r}")
    return path


class FrameRecorder:
    """An adapter that, while recording, keeps a frame of its first ``rows`` copies (side by
    side) after every reset and step: every action of a chunk, not one frame per chunk. The
    wrapped adapter must have ``render(size, rows)``. Everything else passes through."""

    def __init__(self, env, rows: int, size: int):
        if not callable(getattr(env, "render", None)):
            raise ValueError(
                f"runner.eval_video: the {type(env).__name__} env adapter cannot render frames"
            )
        self.env, self.rows, self.size = env, list(range(min(rows, env.num_envs))), size
        self.frames: list[np.ndarray] | None = None
        env.render(size, self.rows)  # an env that cannot render fails now, not at an evaluation

    def __getattr__(self, name):
        return getattr(self.env, name)

    def start(self) -> None:
        self.frames = []

    def take(self) -> np.ndarray | None:
        """The frames since the last ``take`` (``[T, H, rows * W, 3]``), or None."""
        if not self.frames:
            return None
        frames, self.frames = np.stack(self.frames), []
        return frames

    def stop(self) -> None:
        self.frames = None

    def reset(self, *args, **kwargs):
        obs = self.env.reset(*args, **kwargs)
        self._capture()
        return obs

    def step(self, actions):
        out = self.env.step(actions)
        self._capture()
        return out

    def _capture(self) -> None:
        if self.frames is not None:
            self.frames.append(tile(self.env.render(self.size, self.rows)))
