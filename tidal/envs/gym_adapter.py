"""The gymnasium adapter: any env id ``gymnasium.make_vec`` can build (classic control, MuJoCo,
user-registered ids; ``module.path:EnvId`` imports the module that registers ``EnvId`` first,
gymnasium's convention)."""

from __future__ import annotations

import importlib

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from tidal.envs.base import register_env
from tidal.envs.state import (
    StateAccess,
    capture_vector_env,
    from_plain,
    restore_vector_env,
    to_plain,
)
from tidal.extras import needs_extra


@register_env("gymnasium")
class GymnasiumVectorEnv:
    def __init__(
        self,
        num_envs: int,
        env_id: str,
        vectorization_mode: str = "sync",
        max_episode_steps: int | None = None,
        env_kwargs: dict | None = None,
    ):
        env_id = import_env_module(env_id)
        try:
            spec = gym.spec(env_id)
        except gym.error.Error as exc:
            raise ValueError(f"env.id: gymnasium has no env {env_id!r} ({exc})") from None
        if str(spec.entry_point).startswith("gymnasium.envs.mujoco"):
            with needs_extra("embodied", f"gymnasium's MuJoCo env {env_id}"):
                import mujoco  # noqa: F401  (gymnasium's own error names its extra, not tidal's)
        kwargs = dict(env_kwargs or {})
        if max_episode_steps is not None:
            kwargs["max_episode_steps"] = max_episode_steps
        self.env = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode=vectorization_mode,
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED},
            wrappers=[StateAccess],
            **kwargs,
        )
        self.num_envs = num_envs
        self.observation_space = self.env.single_observation_space
        self.action_space = self.env.single_action_space
        self.max_episode_steps = max_episode_steps or spec.max_episode_steps
        self._ended = np.zeros(num_envs, dtype=bool)
        self._cameras: dict[int, object] = {}
        # A sync vector env's copies are stepped here rather than by ``SyncVectorEnv``, whose
        # masked reset passes over every copy and re-stacks (and deep-copies) every observation.
        # ``StateAccess`` only forwards step and reset: the loop calls the layer beneath it.
        self._copies = [c.env for c in self.env.envs] if vectorization_mode == "sync" else None
        self._copy_obs: list = [None] * num_envs  # each copy's last observation (sync)
        self._stack = _stacker(self.observation_space, num_envs)

    def reset(self, seeds: list[int] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
        if self._copies is not None:
            return self._reset_copies(seeds, mask)
        if mask is not None:
            obs, _ = self.env.reset(options={"reset_mask": mask})
            self._ended &= ~mask
        else:
            obs, _ = self.env.reset(seed=seeds)
            self._ended[:] = False
        return obs

    def step(self, actions: np.ndarray):
        if self._copies is not None:
            return self._step_copies(actions)
        if self._ended.any():  # gymnasium refuses to step an ended copy: restart it quietly
            self.env.reset(options={"reset_mask": self._ended})
        obs, reward, term, trunc, _ = self.env.step(actions)
        self._ended = term | trunc
        return obs, reward, term, trunc

    # -- sync copies, stepped one by one (what ``SyncVectorEnv`` does, without its extra passes)

    def _reset_copies(self, seeds: list[int] | None, mask: np.ndarray | None) -> np.ndarray:
        if mask is None:  # every copy, with its seed (``SyncVectorEnv.reset(seed=seeds)``)
            seeds = seeds or [None] * self.num_envs
            for i, (env, seed) in enumerate(zip(self._copies, seeds, strict=True)):
                self._copy_obs[i], _ = env.reset(seed=seed, options=None)
            self._ended[:] = False
        else:  # the masked copies, as ``SyncVectorEnv.reset(options={"reset_mask": mask})``
            for i in np.flatnonzero(mask):
                self._copy_obs[i], _ = self._copies[i].reset(seed=None, options={})
            self._ended &= ~mask
        return self._stack(self._copy_obs)

    def _step_copies(self, actions: np.ndarray):
        n, copies, ended = self.num_envs, self._copies, self._ended
        rewards, terms, truncs = [0.0] * n, [False] * n, [False] * n
        for i, action in enumerate(actions):
            env = copies[i]
            if ended[i]:  # gymnasium refuses to step an ended copy: restart it quietly
                env.reset(seed=None, options={})
            self._copy_obs[i], rewards[i], terms[i], truncs[i], _ = env.step(action)
        term, trunc = np.array(terms, dtype=bool), np.array(truncs, dtype=bool)
        self._ended = term | trunc
        return self._stack(self._copy_obs), np.array(rewards, dtype=np.float64), term, trunc

    def state_dict(self) -> tuple[dict, list[str]]:
        """The exact state of every copy (see ``tidal.envs.state``) and what it misses."""
        state, missed = capture_vector_env(self.env)
        out = {"ended": to_plain(self._ended), "vector_env": state}
        if self._copies is not None and self._copy_obs[0] is not None:
            out["copy_obs"] = to_plain(self._copy_obs)
        return out, missed

    def load_state_dict(self, state: dict) -> None:
        restore_vector_env(self.env, state["vector_env"])
        self._ended = from_plain(state["ended"])
        if "copy_obs" in state:
            self._copy_obs = from_plain(state["copy_obs"])

    def render(self, size: int = 128, rows: list[int] | None = None) -> np.ndarray:
        """Frames ``[n, size, size, 3]`` of the copies ``rows`` (MuJoCo envs of a sync vector
        env), from the model's ``track`` camera when it has one, else its first camera."""
        rows = list(range(self.num_envs)) if rows is None else rows
        for i in rows:
            if (i, size) not in self._cameras:
                self._cameras[(i, size)] = _mujoco_camera(self.env, i, size)
        return np.stack([self._cameras[(i, size)].render() for i in rows])

    def close(self) -> None:
        for camera in self._cameras.values():
            camera.close()
        self._cameras = {}
        self.env.close()


def _stacker(space: gym.Space, n: int):
    """Stacks ``n`` observations of ``space`` into a new batch array. A Box's rows are joined
    with one ``np.concatenate`` (several times cheaper than ``np.stack`` for small rows) and
    cast to the space's dtype, as gymnasium's ``concatenate`` does; other spaces use it."""
    if isinstance(space, gym.spaces.Box) and space.shape:
        shape, dtype = (n, *space.shape), space.dtype
        return lambda rows: np.concatenate(rows).reshape(shape).astype(dtype, copy=False)
    return lambda rows: concatenate(space, rows, create_empty_array(space, n))


def _mujoco_camera(vector_env, index: int, size: int):
    from tidal.envs.rendering import FastCamera

    env = getattr(vector_env, "envs", [None] * (index + 1))[index]
    model = getattr(getattr(env, "unwrapped", None), "model", None)
    if model is None or model.ncam == 0:
        raise ValueError(
            "runner.eval_video: only MuJoCo envs with a camera render here "
            "(with env.vectorization_mode: sync)"
        )
    names = [model.camera(c).name for c in range(model.ncam)]
    camera = "track" if "track" in names else names[0]
    return FastCamera(model, env.unwrapped.data, camera, size)


def import_env_module(env_id: str) -> str:
    """``module.path:EnvId`` -> import ``module.path`` (it registers the env), return ``EnvId``."""
    if ":" not in env_id:
        return env_id
    module, _, name = env_id.partition(":")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"env.id: cannot import module {module!r} of {env_id!r} ({exc})") from exc
    return name
