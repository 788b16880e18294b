"""The MetaWorld adapter: single tasks (``reach-v3``), MT10 / MT50, or a comma-separated list of
tasks, each with a language instruction, from state and/or pixels.

Env copy ``i`` (``first_env + i`` in the run's global numbering) runs task
``tasks[((first_env + i) // group_size) % len(tasks)]``: tasks spread over every rank and stage,
and with embodied GRPO's groups (``group_size`` consecutive copies sharing a seed) every member
of a group runs the same task. Goals are drawn from each copy's own seeded
generator at every reset (MetaWorld's ``seeded_rand_vec``), with the goal position observable
(as in MetaWorld's MT benchmarks), so copies that share a seed start identically.

``reward`` picks what a step pays (``REWARDS``): ``dense`` is MetaWorld's shaped reward (0-10 a
step), ``success`` pays 1 for every step that ends in a success state and 0 otherwise, so an
episode's return counts its steps in success (with ``terminate_on_success`` it is 1 if the episode
succeeded, else 0): the signal success-rate targets measure, for GRPO-style outcome scoring.

Besides the adapter contract it exposes, per copy: ``successes`` (MetaWorld's ``success`` at the
last step), ``task_names``, ``instructions`` and ``states`` (the raw 39-value state, what the
scripted experts read even when the policy sees only pixels).
"""

from __future__ import annotations

import numpy as np

from tidal.envs.base import register_env
from tidal.envs.layout import LayoutBox, ObsLayout, tokenize
from tidal.envs.rendering import FastCamera, select_gl_backend
from tidal.extras import needs_extra

OBS_MODES = ("state", "pixels", "state+pixels")

INSTRUCTIONS = {
    "reach-v3": "reach the goal position with the gripper",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}


def _dense_reward(env_reward: np.ndarray, successes: np.ndarray) -> np.ndarray:
    return env_reward


def _success_reward(env_reward: np.ndarray, successes: np.ndarray) -> np.ndarray:
    return successes.astype(np.float32)


REWARDS = {"dense": _dense_reward, "success": _success_reward}


def instruction_for(task: str) -> str:
    """MT10's tasks have written instructions; any other task reads its name (``coffee-push``)."""
    return INSTRUCTIONS.get(task) or task.removesuffix("-v3").replace("-", " ")


def resolve_tasks(env_id: str) -> list[str]:
    with needs_extra("embodied", "the metaworld env adapter"):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS, MT10_V3, MT50_V3

    benchmarks = {"MT10": list(MT10_V3), "MT50": list(MT50_V3)}
    tasks = benchmarks.get(env_id) or [t.strip() for t in env_id.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in ALL_V3_ENVIRONMENTS]
    if not tasks or unknown:
        raise ValueError(
            f"env.id: MetaWorld has no task {', '.join(unknown) or repr(env_id)}; "
            f"use MT10, MT50 or task names such as reach-v3"
        )
    return tasks


def _make_task_env(task: str, env_kwargs: dict):
    """One MetaWorld env with observable goals drawn from its own generator (what
    ``set_task`` + the benchmark's fixed goal list would do, without building 50 goals/task)."""
    with needs_extra("embodied", "the metaworld env adapter"):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS, ML1_ARGS_KWARGS

    env = ALL_V3_ENVIRONMENTS[task](**env_kwargs)
    task_kwargs = {k: v for k, v in ML1_ARGS_KWARGS[task]["kwargs"].items() if k != "task_id"}
    env._set_task_inner(**task_kwargs)
    env._partially_observable = False
    del env.sawyer_observation_space  # cached with the goal hidden (clipped to 0)
    env._set_task_called = True
    env._freeze_rand_vec, env.seeded_rand_vec = False, True
    return env


@register_env("metaworld")
class MetaWorldVectorEnv:
    def __init__(
        self,
        num_envs: int,
        env_id: str,
        max_episode_steps: int | None = None,
        obs_mode: str = "state",
        image_size: int = 64,
        camera: str = "corner",  # the workspace fills more of a small frame than in corner2
        instruction_tokens: int = 16,
        vocab_size: int = 1024,
        terminate_on_success: bool = False,
        reward: str = "dense",
        vectorization_mode: str = "sync",
        env_kwargs: dict | None = None,
        first_env: int = 0,
        group_size: int = 1,
    ):
        if obs_mode not in OBS_MODES:
            raise ValueError(
                f"env.obs_mode: expected one of {', '.join(OBS_MODES)}, got {obs_mode!r}"
            )
        if vectorization_mode != "sync":  # 2 cores: sync beats subprocesses (ECOSYSTEM.md)
            raise ValueError(
                f"env.vectorization_mode: the metaworld adapter steps copies in-process "
                f"('sync'), got {vectorization_mode!r}"
            )
        if reward not in REWARDS:
            raise ValueError(
                f"env.adapter_kwargs.reward: expected one of {', '.join(REWARDS)}, got {reward!r}"
            )
        self._reward = REWARDS[reward]
        if not isinstance(terminate_on_success, bool | np.bool_):  # "false" would be true
            raise ValueError(
                f"env.adapter_kwargs.terminate_on_success: expected true or false, "
                f"got {terminate_on_success!r}"
            )
        if "pixels" in obs_mode and image_size < 8:
            raise ValueError(f"env.image_size: must be >= 8, got {image_size}")
        if "pixels" in obs_mode:
            select_gl_backend()  # before metaworld imports mujoco
        self.task_list = resolve_tasks(env_id)
        self.num_envs = num_envs
        if group_size < 1:
            raise ValueError(f"env.group_size: must be >= 1, got {group_size}")
        self.task_names = [
            self.task_list[((first_env + i) // group_size) % len(self.task_list)]
            for i in range(num_envs)
        ]
        self.task_index = np.array([self.task_list.index(t) for t in self.task_names])
        self.instructions = [instruction_for(t) for t in self.task_names]
        self.envs = [_make_task_env(t, dict(env_kwargs or {})) for t in self.task_names]
        self.max_episode_steps = max_episode_steps or self.envs[0].max_path_length
        for env in self.envs:  # MetaWorld raises when stepped past its own limit
            env.max_path_length = max(env.max_path_length, self.max_episode_steps)
        self.terminate_on_success = terminate_on_success

        state_dim = self.envs[0].observation_space.shape[0] if obs_mode != "pixels" else 0
        self.layout = ObsLayout(
            state_dim=state_dim,
            num_tokens=instruction_tokens,
            vocab_size=vocab_size,
            image_size=image_size if "pixels" in obs_mode else 0,
        )
        self.observation_space = LayoutBox(self.layout)
        self.action_space = self.envs[0].action_space
        self.camera_name = camera
        self.cameras = (
            [FastCamera(e.model, e.data, camera, image_size) for e in self.envs]
            if self.layout.image_size
            else []
        )
        self._video_cameras: dict[int, FastCamera] = {}
        self._video_size = 0
        self._tokens = np.stack(
            [tokenize(s, instruction_tokens, vocab_size) for s in self.instructions]
        ).astype(np.float32)
        self.states = np.zeros((num_envs, self.envs[0].observation_space.shape[0]))
        self.successes = np.zeros(num_envs, dtype=bool)
        self._steps = np.zeros(num_envs, dtype=np.int64)
        self._ended = np.zeros(num_envs, dtype=bool)

    def reset(self, seeds: list[int] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
        rows = range(self.num_envs) if mask is None else np.flatnonzero(mask)
        for i in rows:
            if seeds is not None and mask is None:
                self.envs[i].seed(int(seeds[i]))
            self._reset_copy(i)
        return self._observe()

    def _reset_copy(self, i: int) -> None:
        self.states[i] = self.envs[i].reset()[0]
        self._steps[i], self._ended[i], self.successes[i] = 0, False, False

    def step(self, actions: np.ndarray):
        actions = np.clip(np.asarray(actions, dtype=np.float64), -1.0, 1.0)
        rewards = np.zeros(self.num_envs, dtype=np.float32)
        for i, env in enumerate(self.envs):
            if self._ended[i]:  # a copy stepped after its episode ended restarts first
                self._reset_copy(i)
            self.states[i], rewards[i], _, _, info = env.step(actions[i])
            self.successes[i] = info["success"] > 0
        self._steps += 1
        terms = self.successes & self.terminate_on_success
        truncs = (self._steps >= self.max_episode_steps) & ~terms
        self._ended = terms | truncs
        return self._observe(), self._reward(rewards, self.successes), terms, truncs

    def _observe(self) -> np.ndarray:
        parts = [self._tokens]
        if self.layout.state_dim:
            parts.insert(0, self.states.astype(np.float32))
        if self.cameras:
            parts.append(
                np.stack([c.render().reshape(-1) for c in self.cameras]).astype(np.float32)
            )
        return np.concatenate(parts, axis=1)

    def render(self, size: int = 128, rows: list[int] | None = None) -> np.ndarray:
        """Frames ``[n, size, size, 3]`` of the copies ``rows`` (all by default) for videos,
        whatever the observation mode; their cameras are made on first use."""
        rows = list(range(self.num_envs)) if rows is None else rows
        if self._video_size != size:
            for camera in self._video_cameras.values():
                camera.close()
            self._video_cameras, self._video_size = {}, size
        for i in rows:
            if i not in self._video_cameras:
                env = self.envs[i]
                self._video_cameras[i] = FastCamera(env.model, env.data, self.camera_name, size)
        return np.stack([self._video_cameras[i].render() for i in rows])

    def close(self) -> None:
        for camera in [*self.cameras, *self._video_cameras.values()]:
            camera.close()
        self._video_cameras = {}
        for env in self.envs:
            env.close()
        self.cameras = []
