"""The adapter contract, the registry, and stepping in action chunks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
import torch

from tidal.data import EnvOutput
from tidal.envs.state import from_plain, to_plain
from tidal.registry import Registry


class VectorEnvAdapter(Protocol):
    """``num_envs`` copies of an env stepped together. No auto-reset: the caller resets
    finished copies with ``reset(mask=...)``; a copy stepped after its episode ended restarts
    first, and the caller ignores what it reports until it resets it. Arrays are NumPy,
    batch-first.

    Optional, for exact resume: ``state_dict() -> (state, missed)`` (weights-only-loadable
    values; ``missed`` names what it could not capture) and ``load_state_dict(state)``. An
    adapter without them restarts from its seeds on resume, and the resume says so."""

    num_envs: int
    observation_space: gym.Space  # of one copy
    action_space: gym.Space  # of one copy
    max_episode_steps: int | None

    def reset(
        self, seeds: list[int] | None = None, mask: np.ndarray | None = None
    ) -> np.ndarray: ...

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...

    def close(self) -> None: ...


@runtime_checkable
class MultiTaskAdapter(VectorEnvAdapter, Protocol):
    """An adapter whose copies run different tasks (MetaWorld MT*, LIBERO): success is then
    reported per task, and evaluation checks that its rounds weigh the tasks equally."""

    task_list: list  # the env's tasks in order (MetaWorld: names; LIBERO: the suite's indices)
    task_names: list[str]  # the task each copy runs, one per copy


ENV_ADAPTERS: Registry[Callable[..., VectorEnvAdapter]] = Registry("adapter", "env.adapter")
# register_env("name")(factory): factory(num_envs=..., **kwargs) -> VectorEnvAdapter
register_env = ENV_ADAPTERS.register
get_env_adapter = ENV_ADAPTERS.get
list_env_adapters = ENV_ADAPTERS.names


def make_env(adapter: str, num_envs: int, **kwargs) -> VectorEnvAdapter:
    return get_env_adapter(adapter)(num_envs=num_envs, **kwargs)


def env_make_kwargs(env, first_env: int = 0, group_size: int = 1) -> dict[str, Any]:
    """What ``make_env`` takes for an ``env`` config section (besides adapter and num_envs). The
    observation mode goes to the adapter only when it is not plain state, every adapter's own.
    A multi-task adapter (one that takes ``first_env`` and ``group_size``) learns where its copies
    sit in the global numbering the seeds use, so tasks spread over every rank and stage and the
    members of a GRPO group (``group_size`` consecutive training envs) share a task."""
    kwargs = dict(env.adapter_kwargs)
    if env.obs_mode != "state":
        kwargs.update(obs_mode=env.obs_mode, image_size=env.image_size)
    if {"first_env", "group_size"} <= adapter_arguments(env.adapter):
        kwargs.update(first_env=first_env, group_size=group_size)
    return {
        "env_id": env.id,
        "vectorization_mode": env.vectorization_mode,
        "max_episode_steps": env.max_episode_steps,
        "env_kwargs": dict(env.kwargs),
        **kwargs,
    }


def adapter_arguments(adapter: str) -> set[str]:
    """The keyword arguments a registered adapter's factory takes."""
    return set(inspect.signature(get_env_adapter(adapter)).parameters)


@dataclass
class EpisodeStats:
    """Returns and lengths of the episodes that ended, collected between two ``drain`` calls;
    with an adapter that reports ``successes``, whether each episode succeeded (at any step)
    and, when it names them, its task."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[float] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)

    def drain(self) -> dict[str, list]:
        out = {
            "returns": self.returns,
            "lengths": self.lengths,
            "successes": self.successes,
            "tasks": self.tasks,
        }
        self.returns, self.lengths, self.successes, self.tasks = [], [], [], []
        return out


def success_metrics(successes: list[float], tasks: list[str], prefix: str) -> dict[str, float]:
    """``{prefix}/success_rate`` over all episodes, and per task when episodes name one
    (``{prefix}/success_rate/reach-v3``); nothing when no episode reported success."""
    if not successes:
        return {}
    out = {f"{prefix}/success_rate": float(np.mean(successes))}
    if tasks:
        for task in sorted(set(tasks)):
            rows = [s for s, t in zip(successes, tasks) if t == task]
            out[f"{prefix}/success_rate/{task}"] = float(np.mean(rows))
    return out


def episode_metrics(
    returns: list[float], successes: list[float], tasks: list[str], prefix: str
) -> dict[str, float | int | None]:
    """What an evaluation reports of its episodes, under one set of names wherever it runs (in
    process: ``tidal sft`` and ``tidal eval``; through the workers: a training run):
    ``{prefix}/return_mean``, ``{prefix}/return_std``, ``{prefix}/episodes`` and the success
    rates (``success_metrics``; per task only when every episode names its task)."""
    return {
        **success_metrics(successes, tasks if len(tasks) == len(successes) else [], prefix),
        f"{prefix}/return_mean": float(np.mean(returns)) if returns else None,
        f"{prefix}/return_std": float(np.std(returns)) if returns else None,
        f"{prefix}/episodes": len(returns),
    }


class ChunkedEnv:
    """Steps an adapter ``C`` actions at a time and reports an ``EnvOutput`` of ``[B, C]``.

    With ``auto_reset`` an env whose episode ended in a chunk is reset at the end of the
    chunk (its ``final_obs`` is kept). Without it, an env stays in its ended episode until the
    next ``reset``; its later steps are for the actor to mask. Within a chunk, actions after
    an env's done have no effect on what it reports.
    """

    def __init__(self, env: VectorEnvAdapter, auto_reset: bool, seeds: list[int]):
        self.env, self.auto_reset = env, auto_reset
        self.num_envs = env.num_envs
        self.seeds = seeds
        self.stats = EpisodeStats()
        self._returns = np.zeros(self.num_envs)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)
        self._counting = np.ones(self.num_envs, dtype=bool)  # episodes still to be reported
        self._succeeded = np.zeros(self.num_envs, dtype=bool)  # this episode has succeeded
        self.reports_success = hasattr(env, "successes")
        self.multi_task = isinstance(env, MultiTaskAdapter)  # once: a protocol check is ~10 hasattr
        self.last_obs: torch.Tensor | None = None

    def reset(self, seed_offset: int = 0) -> EnvOutput:
        """Reset every copy (copies that share a seed start identically) and forget running
        episodes."""
        obs = self.env.reset(seeds=[s + seed_offset for s in self.seeds])
        self._returns[:] = 0
        self._lengths[:] = 0
        self._counting[:] = True
        self._succeeded[:] = False
        self.last_obs = _as_tensor(obs)
        return EnvOutput(obs=self.last_obs)

    def step(self, actions: np.ndarray) -> EnvOutput:
        """``actions``: ``[B, C, ...]`` in the env's action space."""
        if actions.shape[1] == 1:  # the common case, without the per-action bookkeeping
            obs, reward, term, trunc = self.env.step(actions[:, 0])
            if self.reports_success:
                self._succeeded |= self.env.successes
            rewards = reward.astype(np.float32, copy=False)[:, None]
            terms, truncs, steps_taken = term[:, None], trunc[:, None], 1
            ended = term | trunc
            any_ended = bool(ended.any())
            final_obs = obs.copy() if any_ended else None  # adapters may reuse their buffers
        else:
            obs, rewards, terms, truncs, steps_taken, ended, final_obs = self._step_chunk(actions)
            any_ended = final_obs is not None
        self._account(rewards, steps_taken, ended, any_ended)
        final = None if final_obs is None else _as_tensor(final_obs)
        if self.auto_reset and any_ended:
            obs = obs.copy()
            obs[ended] = self.env.reset(mask=ended)[ended]
        self.last_obs = _as_tensor(obs)
        dones = ended[:, None] if terms.shape[1] == 1 else terms | truncs  # [B, C]
        return EnvOutput(
            obs=self.last_obs,
            final_obs=final,
            rewards=torch.from_numpy(rewards),
            terminations=torch.from_numpy(terms),
            truncations=torch.from_numpy(truncs),
            dones=torch.from_numpy(dones),
        )

    def _step_chunk(self, actions: np.ndarray):
        """Step ``C`` actions; an env that ends stops counting (its later actions do nothing)."""
        batch, chunk = actions.shape[:2]
        rewards = np.zeros((batch, chunk), dtype=np.float32)
        terms = np.zeros((batch, chunk), dtype=bool)
        truncs = np.zeros((batch, chunk), dtype=bool)
        alive = np.ones(batch, dtype=bool)
        steps_taken = np.zeros(batch, dtype=np.int64)
        final_obs = None
        for c in range(chunk):
            steps_taken += alive
            obs, reward, term, trunc = self.env.step(actions[:, c])
            self._note_success(alive)
            rewards[:, c] = np.where(alive, reward, 0.0)
            terms[:, c] = term & alive
            truncs[:, c] = trunc & alive
            ended = (term | trunc) & alive
            if ended.any():
                final_obs = obs.copy() if final_obs is None else final_obs
                final_obs[ended] = obs[ended]
            alive &= ~ended
        ended = ~alive
        if final_obs is not None:  # envs that ended keep their final obs, the others their last
            final_obs = np.where(_expand(ended, obs), final_obs, obs)
        return obs, rewards, terms, truncs, steps_taken, ended, final_obs

    def _note_success(self, alive: np.ndarray) -> None:
        if self.reports_success:
            self._succeeded |= self.env.successes & alive

    def _account(self, rewards: np.ndarray, steps, ended: np.ndarray, any_ended: bool) -> None:
        if self.auto_reset:  # every episode is counted (``_counting`` stays all true)
            self._returns += rewards.sum(1)
            self._lengths += steps
        else:
            self._returns += np.where(self._counting, rewards.sum(1), 0.0)
            self._lengths += np.where(self._counting, steps, 0)
        if not any_ended:
            return
        finished = ended & self._counting
        tasks = self.env.task_names if self.multi_task else None
        # a non-finite return is not reported (the env worker names the value)
        for i in np.flatnonzero(finished & np.isfinite(self._returns)):
            self.stats.returns.append(float(self._returns[i]))
            self.stats.lengths.append(int(self._lengths[i]))
            if self.reports_success:
                self.stats.successes.append(float(self._succeeded[i]))
                if tasks is not None:
                    self.stats.tasks.append(tasks[i])
        if self.auto_reset:
            self._returns[ended] = 0
            self._lengths[ended] = 0
            self._succeeded[ended] = False
        else:
            self._counting &= ~ended

    def restart(self, rows: np.ndarray, obs: torch.Tensor) -> torch.Tensor:
        """Reset the copies in ``rows`` ([B] bool) mid-episode (e.g. after non-finite values):
        their running episodes are dropped, not reported. Returns ``obs`` with their first
        observations."""
        obs = obs.clone()
        obs[torch.from_numpy(rows)] = _as_tensor(self.env.reset(mask=rows)[rows])
        self._returns[rows], self._lengths[rows], self._counting[rows] = 0, 0, True
        self.last_obs = obs
        return obs

    def state_dict(self) -> tuple[dict, list[str]]:
        """Running episodes (returns, lengths, what is still to be reported) and the adapter's
        exact state; with what could not be captured. An adapter without ``state_dict``
        restarts from its own seeds on resume."""
        adapter_state = getattr(self.env, "state_dict", None)
        if adapter_state is None:
            env_state, missed = None, [f"{type(self.env).__name__} has no state_dict"]
        else:
            env_state, missed = adapter_state()
        counters = {
            "returns": self._returns,
            "lengths": self._lengths,
            "counting": self._counting,
            "last_obs": self.last_obs,
            "stats": [self.stats.returns, self.stats.lengths],
        }
        return {"counters": to_plain(counters), "env": env_state}, missed

    def load_state_dict(self, state: dict) -> None:
        counters = from_plain(state["counters"])
        self._returns, self._lengths = counters["returns"], counters["lengths"]
        self._counting, self.last_obs = counters["counting"], counters["last_obs"]
        self.stats.returns, self.stats.lengths = (list(x) for x in counters["stats"])
        if state["env"] is not None:
            self.env.load_state_dict(state["env"])

    def all_reported(self) -> bool:
        """Without auto-reset: every copy has finished (and reported) its episode."""
        return not self._counting.any()

    def close(self) -> None:
        self.env.close()


def _expand(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


def _as_tensor(x: Any) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(x))
    return t.float() if t.dtype == torch.float64 else t
