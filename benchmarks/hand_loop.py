"""The collection loop a user writes by hand, CleanRL style, with none of tidal's classes: the
baseline tidal's collection is measured against (``embodied_bench.py``).

gymnasium's vector env (``SyncVectorEnv``, or ``AsyncVectorEnv``: a process per env) with its
own autoreset, an actor and a critic MLP (64x64 tanh), a categorical or diagonal-Gaussian
policy, the samples kept per step and stacked per round.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable

import gymnasium as gym
import torch

VECTOR_ENVS = {"sync": gym.vector.SyncVectorEnv, "async": gym.vector.AsyncVectorEnv}


def mlp(n_in: int, n_out: int, hidden=(64, 64)) -> torch.nn.Sequential:
    sizes, layers = (n_in, *hidden), []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], n_out))


class HandLoop:
    """``num_steps`` vector steps of ``num_envs`` copies of ``env_id`` per call; ``close()``
    ends the vector env (an async one's processes)."""

    def __init__(
        self,
        num_envs: int,
        num_steps: int,
        env_id: str = "CartPole-v1",
        vector: str = "sync",
        hidden=(64, 64),
    ):
        self.num_envs, self.num_steps = num_envs, num_steps
        self.envs = VECTOR_ENVS[vector]([lambda: gym.make(env_id) for _ in range(num_envs)])
        obs_dim = self.envs.single_observation_space.shape[0]
        space = self.envs.single_action_space
        self.discrete = isinstance(space, gym.spaces.Discrete)
        out = int(space.n) if self.discrete else space.shape[0]
        self.actor, self.critic = mlp(obs_dim, out, hidden), mlp(obs_dim, 1, hidden)
        self.log_std = torch.zeros(out)
        self.obs = torch.as_tensor(self.envs.reset(seed=0)[0], dtype=torch.float32)
        self()  # warm up: the first round pays for lazy initialisation

    def _dist(self, obs: torch.Tensor):
        head = self.actor(obs)
        if self.discrete:
            return torch.distributions.Categorical(logits=head)
        return torch.distributions.Normal(head, self.log_std.exp())

    def __call__(self) -> dict:
        store = {k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "dones")}
        for _ in range(self.num_steps):
            with torch.no_grad():
                dist = self._dist(self.obs)
                action = dist.sample()
                logprob = dist.log_prob(action)
                if not self.discrete:
                    logprob = logprob.sum(-1)
                value = self.critic(self.obs).squeeze(-1)
            next_obs, reward, term, trunc, _ = self.envs.step(action.numpy())
            for k, v in zip(store, (self.obs, action, logprob, value, reward, term | trunc)):
                store[k].append(v)
            self.obs = torch.as_tensor(next_obs, dtype=torch.float32)
        return {k: torch.stack([torch.as_tensor(x) for x in v], 1) for k, v in store.items()}

    def close(self) -> None:
        self.envs.close()


class SplitHandLoop:
    """The hand loop split by hand over cores: its envs in ``parts`` processes that never talk,
    process *i* pinned to core *i*, each stepping its share (``SyncVectorEnv``) with its own
    networks; a call runs one round in all of them at once and returns when the slowest is done.
    Its ratio to one process says what the machine's cores give a loop at the moment (the two
    vCPUs of a shared host gave 1.38-1.69x from one run to the next)."""

    def __init__(self, num_envs: int, num_steps: int, env_id: str, parts: int = 2):
        if num_envs % parts:
            raise ValueError(f"{num_envs} envs do not split into {parts} equal parts")
        if len(os.sched_getaffinity(0)) < parts:
            raise ValueError(f"{parts} parts need {parts} cores; this process may use fewer")
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        try:
            for core in range(parts):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_split_part,
                    args=(theirs, core, num_envs // parts, num_steps, env_id),
                    daemon=True,
                )
                proc.start()
                theirs.close()  # a part that dies then reads as end of file here, not a hang
                self.pipes.append(ours)
                self.procs.append(proc)
            self._collect("start")
        except BaseException:
            self.close()
            raise

    def __call__(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send("round")
            except OSError:  # that part is gone: _collect names it
                pass
        self._collect("round")

    def _collect(self, what: str, timeout_s: float = 120.0) -> None:
        for i, (pipe, proc) in enumerate(zip(self.pipes, self.procs)):
            try:
                if pipe.poll(timeout_s):
                    pipe.recv()
                    continue
            except EOFError:
                proc.join(5)  # it is exiting: wait for its code
            raise RuntimeError(
                f"part {i} of the split hand loop failed its {what} (exit code {proc.exitcode})"
            )

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:  # that part is gone already
                pass
        for pipe, proc in zip(self.pipes, self.procs):
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            pipe.close()
        self.pipes, self.procs = [], []


def _split_part(pipe, core: int, num_envs: int, num_steps: int, env_id: str) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[core]})
    torch.set_num_threads(1)
    loop = HandLoop(num_envs, num_steps, env_id, "sync")
    pipe.send("ready")
    while pipe.recv() is not None:
        loop()
        pipe.send("done")
    loop.close()


def make_hand_loop(num_envs: int, num_steps: int, hidden=(64, 64)) -> Callable[[], dict]:
    """One CartPole round of the hand loop (what the isolated collection mode pairs with)."""
    return HandLoop(num_envs, num_steps, hidden=hidden)


class LiberoHandLoop:
    """The LIBERO loop a user writes by hand: ``num_envs`` of LIBERO's own envs (copy ``i`` runs
    task ``i % tasks`` of ``suite``, state only, from its official init states in turn), the
    state vector (proprioception and object states) and the task's one-hot concatenated by hand,
    an actor and a critic MLP, 7-D Gaussian actions held for ``chunk`` steps. No tidal class."""

    def __init__(
        self, num_envs: int, num_steps: int, suite: str, chunk: int = 4, hidden=(256, 256)
    ):
        import contextlib
        import io

        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs.env_wrapper import ControlEnv

        with contextlib.redirect_stdout(io.StringIO()):
            bench = benchmark.get_benchmark_dict()[suite]()
        self.num_envs, self.num_steps, self.chunk, self.limit = num_envs, num_steps, chunk, 280
        self.tasks = [i % bench.n_tasks for i in range(num_envs)]
        self.inits = [bench.get_task_init_states(t) for t in self.tasks]
        self.envs = []
        for t in self.tasks:
            task = bench.get_task(t)
            path = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
            self.envs.append(
                ControlEnv(
                    bddl_file_name=path,
                    has_renderer=False,
                    has_offscreen_renderer=False,
                    use_camera_obs=False,
                    hard_reset=False,
                    ignore_done=True,
                )
            )
        self.onehot = torch.eye(bench.n_tasks)[self.tasks]
        self.episode = [0] * num_envs
        self.steps = [0] * num_envs
        self.env_steps = 0
        self.obs = torch.stack([self._reset(i) for i in range(num_envs)])
        dim = self.obs.shape[1]
        self.actor, self.critic = mlp(dim, 7, hidden), mlp(dim, 1, hidden)
        self.log_std = torch.full((7,), -1.0)
        self()  # warm up

    def _features(self, i: int, raw: dict) -> torch.Tensor:
        state = torch.as_tensor(
            [*raw["robot0_proprio-state"], *raw["object-state"]], dtype=torch.float32
        )
        return torch.cat([state, self.onehot[i]])

    def _reset(self, i: int) -> torch.Tensor:
        self.envs[i].reset()
        init = self.inits[i][self.episode[i] % len(self.inits[i])]
        self.episode[i] += 1
        self.steps[i] = 0
        return self._features(i, self.envs[i].set_init_state(init))

    def __call__(self) -> dict:
        store = {k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "dones")}
        for _ in range(self.num_steps):
            with torch.no_grad():
                dist = torch.distributions.Normal(self.actor(self.obs), self.log_std.exp())
                action = dist.sample()
                logprob = dist.log_prob(action).sum(-1)
                value = self.critic(self.obs).squeeze(-1)
            rewards, dones, next_obs = torch.zeros(self.num_envs), [], []
            for i, env in enumerate(self.envs):
                for _ in range(self.chunk):
                    raw, _, success, _ = env.step(action[i].clamp(-1, 1).numpy())
                    self.steps[i] += 1
                    self.env_steps += 1
                    if success or self.steps[i] >= self.limit:
                        break
                rewards[i] = float(success)
                dones.append(bool(success or self.steps[i] >= self.limit))
                next_obs.append(self._reset(i) if dones[-1] else self._features(i, raw))
            values = (self.obs, action, logprob, value, rewards, torch.tensor(dones))
            for k, v in zip(store, values):
                store[k].append(v)
            self.obs = torch.stack(next_obs)
        return {k: torch.stack(v, 1) for k, v in store.items()}

    def close(self) -> None:
        for env in self.envs:
            env.close()
