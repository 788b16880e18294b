"""Scripted demonstrations on LIBERO from privileged state: approach, grasp, lift, carry, place.

LIBERO's human demonstrations are not on the package index; these scripts cover the tasks whose
goal is one object ``in`` or ``on`` a target (LIBERO-Object's ten "pick up the X and place it in
the basket", LIBERO-Spatial's "pick up the black bowl ... and place it on the plate", and the
pick-and-place tasks of LIBERO-Goal). The script reads the object's and the target's positions
(objects' bodies, regions' sites) and steers the end effector through waypoints with the
operational-space controller's delta actions; the gripper closes on the object and opens over
the target. As MetaWorld's scripts (tidal.envs.demos), the executed action is the script's plus
Gaussian noise while the recorded label is the script's action in the state reached, and each
episode draws its own waypoint offsets, so the data covers states off one fixed path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from tidal.envs.demos import Demonstrations, register_demos
from tidal.envs.libero import LiberoVectorEnv, libero_suite, resolve_tasks, task_problem

log = logging.getLogger("tidal.sft")

# Heights above an object's body origin, metres.
HOVER = 0.10  # approach from above, and carry at target + this
GRASP = 0.01  # the grip site here closes on the object
LIFT = 0.30  # the hand this high above the floor to carry (clear of baskets' rims)
RELEASE = 0.06  # over the target, open here
GAIN = 12.0  # action per metre of position error (the controller moves <= 5 cm per unit action)


def covered(problem: dict) -> bool:
    """Whether the script can do a task (its parsed BDDL problem): one goal predicate, ``in`` or
    ``on``, whose subject is an object the robot can pick (not a fixture), and not ``in`` a
    fixture's region (a drawer to open first)."""
    if len(problem["goal_state"]) != 1 or len(problem["goal_state"][0]) != 3:
        return False
    relation, obj, target = problem["goal_state"][0]
    movable = {name for instances in problem["objects"].values() for name in instances}
    fixtures = [name for instances in problem["fixtures"].values() for name in instances]
    into_fixture = relation.lower() == "in" and any(target.startswith(f) for f in fixtures)
    return relation.lower() in ("in", "on") and obj in movable and not into_fixture


@dataclass
class PickPlaceScript:
    """One episode's script for copy ``i``: waypoints through the phases, each phase left when
    its waypoint is reached (or after its step budget)."""

    env: LiberoVectorEnv
    i: int
    rng: np.random.Generator
    phase: int = 0
    steps_in_phase: int = 0
    jitter: np.ndarray = field(default_factory=lambda: np.zeros(3))

    PHASES = ("approach", "descend", "grasp", "lift", "carry", "lower", "release", "retreat")
    BUDGET = {
        "approach": 60,
        "descend": 40,
        "grasp": 12,
        "lift": 40,
        "carry": 80,
        "lower": 30,
        "release": 10,
        "retreat": 20,
    }

    def __post_init__(self):
        self.jitter = self.rng.uniform(-0.01, 0.01, 3)  # this episode's own grasp point
        _, self.obj, self.target = self.env.goal(self.i)
        self.place_xy = None
        self.rest_z = self.env.position(self.i, self.obj)[2]
        self.tries = 0

    def action(self) -> np.ndarray:
        env, i = self.env, self.i
        hand = env.gripper_position(i)
        obj = env.position(i, self.obj)
        name = self.PHASES[min(self.phase, len(self.PHASES) - 1)]
        gripper = -1.0  # open
        if name == "approach":
            goal = obj + np.array([0, 0, HOVER]) + self.jitter * [1, 1, 0]
        elif name == "descend":
            goal = obj + np.array([0, 0, GRASP]) + self.jitter * [1, 1, 0.5]
        elif name == "grasp":
            goal, gripper = hand, 1.0
        elif name == "lift":
            goal, gripper = np.array([hand[0], hand[1], LIFT]), 1.0
        elif name in ("carry", "lower"):
            if self.place_xy is None:
                place = env.position(i, self.target)
                self.place_xy = place[:2] + self.rng.uniform(-0.01, 0.01, 2)
                self.place_z = place[2]
            # the object hangs below the hand: bring the object over the target
            offset = hand - obj
            height = LIFT if name == "carry" else self.place_z + RELEASE + offset[2]
            goal, gripper = np.array([*(self.place_xy + offset[:2]), height]), 1.0
        elif name == "release":
            goal = hand
        else:  # retreat
            goal = hand + np.array([0, 0, 0.05])
        if name == "carry" and obj[2] < self.rest_z + 0.03 and self.tries < 2:
            self.phase, self.steps_in_phase, self.tries = 0, 0, self.tries + 1  # dropped: regrasp
            return np.concatenate([np.zeros(6), [-1.0]])
        delta = np.clip((goal - hand) * GAIN, -1.0, 1.0)
        self._advance(name, np.linalg.norm(goal - hand))
        return np.concatenate([delta, np.zeros(3), [gripper]])

    def _advance(self, name: str, error: float) -> None:
        self.steps_in_phase += 1
        reached = error < 0.01 and name not in ("grasp", "release")
        if reached or self.steps_in_phase >= self.BUDGET[name]:
            self.phase += 1
            self.steps_in_phase = 0


@register_demos("libero")
def collect_libero_demos(
    env_id: str,
    demos_per_task: int,
    action_noise: float = 0.1,
    seed: int = 0,
    max_attempts_factor: int = 4,
    only_successful: bool = True,
    **adapter_kwargs,
) -> Demonstrations:
    """Up to ``demos_per_task`` scripted episodes of each task of suite ``env_id`` (``tasks`` in
    ``adapter_kwargs``, default all), from LIBERO's random placements (not the official init
    states, which stay the evaluation's), observed as the adapter emits them (the layout of all
    the tasks); the script's own success per task in ``script_success``. One task at a time, so
    a task done early costs nothing while another still tries."""
    if demos_per_task < 1:
        raise ValueError(f"sft.demos: must be >= 1, got {demos_per_task}")
    adapter_kwargs.pop("max_episode_steps", None)
    adapter_kwargs.update(group_size=1, random_init=True, terminate_on_success=True)
    suite = libero_suite(env_id)
    tasks = resolve_tasks(suite, adapter_kwargs.get("tasks"))
    _check_covered(suite, tasks)
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in ("obs", "actions", "executed", "rewards", "terminations", "next_obs")}
    episode, names, instructions, successes, rates, short = [], [], [], [], {}, []
    for k in range(len(tasks)):
        env = LiberoVectorEnv(1, env_id, **{**adapter_kwargs, "first_env": k})
        try:
            runs, tried = _task_runs(
                env, rng, demos_per_task, action_noise, seed, max_attempts_factor, only_successful
            )
        finally:
            env.close()
        name = env.task_names[0]
        succeeded = sum(r["success"] for r in runs)
        rates[name] = succeeded / tried
        log.info("libero demos: %s: %d of %d scripted episodes succeeded", name, succeeded, tried)
        if not any(r["success"] for r in runs):
            short.append(f"{name} (0 of {tried})")
        elif len(runs) < demos_per_task:  # cloned from fewer; the summary's script rate says so
            log.warning(
                "libero demos: %s: only %d of %d demonstrations", name, len(runs), demos_per_task
            )
        for run in runs:
            for key in rows:
                rows[key] += run[key]
            episode += [len(names)] * len(run["obs"])
            names.append(name)
            instructions.append(env.instructions[0])
            successes.append(run["success"])
    if short:
        raise RuntimeError(
            f"the scripted demonstrations never succeeded (action noise {action_noise}; lower "
            f"sft.action_noise or leave the task out of env.adapter_kwargs.tasks): "
            + ", ".join(short)
        )
    return Demonstrations(
        obs=np.stack(rows["obs"]).astype(np.float32),
        actions=np.stack(rows["actions"]).astype(np.float32),
        episode=np.array(episode),
        tasks=names,
        instructions=instructions,
        successes=np.array(successes),
        executed=np.stack(rows["executed"]).astype(np.float32),
        rewards=np.array(rows["rewards"], dtype=np.float32),
        terminations=np.array(rows["terminations"], dtype=bool),
        next_obs=np.stack(rows["next_obs"]).astype(np.float32),
        script_success=rates,
    )


def _check_covered(suite, tasks: list[int]) -> None:
    names = suite.get_task_names()
    missing = [f"{t} {names[t]}" for t in tasks if not covered(task_problem(suite, t))]
    if missing:
        can = [str(t) for t in range(len(names)) if covered(task_problem(suite, t))]
        raise ValueError(
            f"env.adapter_kwargs.tasks: the scripted demonstrations cover pick-and-place tasks "
            f"(one object in or on a target), not {', '.join(missing)}; {suite.name}'s covered "
            f"tasks: [{', '.join(can)}]"
        )


def _task_runs(env, rng, wanted, action_noise, seed, attempts_factor, only_successful):
    """Up to ``wanted`` episodes of the env's one task (successful ones with
    ``only_successful``), and how many were tried."""
    kept, tried = [], 0
    while len(kept) < wanted and tried < wanted * attempts_factor:
        episode_seed = seed * 100_003 + env.first_env * 1009 + tried
        run = _run_round(env, rng, action_noise, [episode_seed])[0]
        tried += 1
        if run["success"] or not only_successful:
            kept.append(run)
    return kept, tried


def _run_round(env, rng, action_noise, seeds) -> list[dict]:
    """One episode of every copy together; each copy's steps until it ends."""
    obs = env.reset(seeds=seeds)
    scripts = [PickPlaceScript(env, i, rng) for i in range(env.num_envs)]
    runs = [
        {
            "obs": [],
            "actions": [],
            "executed": [],
            "rewards": [],
            "terminations": [],
            "next_obs": [],
            "success": False,
        }
        for _ in scripts
    ]
    alive = np.ones(env.num_envs, dtype=bool)
    while alive.any():
        labels = np.stack([s.action() if alive[i] else np.zeros(7) for i, s in enumerate(scripts)])
        labels = np.clip(labels, -1.0, 1.0)
        sent = labels.copy()
        sent[:, :6] = np.clip(
            sent[:, :6] + rng.normal(0.0, action_noise, (len(sent), 6)), -1.0, 1.0
        )
        next_obs, rewards, terms, truncs = env.step(sent)
        for i in np.flatnonzero(alive):
            run = runs[i]
            for key, value in (
                ("obs", obs[i]),
                ("actions", labels[i]),
                ("executed", sent[i]),
                ("rewards", rewards[i]),
                ("terminations", terms[i]),
                ("next_obs", next_obs[i]),
            ):
                run[key].append(value)
            run["success"] |= bool(env.successes[i])
        alive &= ~(terms | truncs)
        obs = next_obs
    return runs
