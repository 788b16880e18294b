"""One env rank's envs, apart from the channels the env worker talks over: its training envs in
pipeline stages (what it steps each epoch and keeps in its checkpoint) and its eval envs."""

from __future__ import annotations

import numpy as np
import torch

from tidal.data import EnvOutput
from tidal.envs.base import ChunkedEnv, VectorEnvAdapter, env_make_kwargs, make_env
from tidal.envs.checks import NonFiniteGuard
from tidal.envs.recorder import StageRecorder
from tidal.envs.seeds import evaluation_offset, evaluation_seeds, training_seeds
from tidal.envs.video import FrameRecorder


def env_from_config(env, num_envs: int, first_env: int, group_size: int = 1) -> VectorEnvAdapter:
    """The adapter an ``env`` config section describes, for envs ``first_env ..`` of the global
    numbering."""
    return make_env(env.adapter, num_envs, **env_make_kwargs(env, first_env, group_size))


class TrainingEnvs:
    """Env rank ``rank``'s ``env.pipeline_stage_num`` stages of ``stage_envs`` copies each (stage
    ``s`` holds global envs from ``(rank * stages + s) * stage_envs``), each with its non-finite
    guard, its current observations (``obs``) and the dones of its last chunk step."""

    def __init__(self, env, seed: int, rank: int, world_size: int):
        self.cfg, self.seed = env, seed
        self.num_stages = env.pipeline_stage_num
        self.stage_envs = env.total_num_envs // (world_size * self.num_stages)
        first_env = [(rank * self.num_stages + s) * self.stage_envs for s in range(self.num_stages)]
        self.envs = [
            ChunkedEnv(
                env_from_config(env, self.stage_envs, first, env.group_size),
                env.auto_reset,
                training_seeds(self.seed, first, self.stage_envs, env.group_size),
            )
            for first in first_env
        ]
        self.guards = [
            NonFiniteGuard(rank, first, self.stage_envs, env.max_nonfinite_steps)
            for first in first_env
        ]
        self.obs = [e.reset().obs for e in self.envs]
        self.last_dones = [
            torch.zeros(self.stage_envs, env.num_action_chunks, dtype=torch.bool)
            for _ in range(self.num_stages)
        ]
        self.max_episode_steps = self.envs[0].env.max_episode_steps

    def start_epoch(self, epoch: int) -> None:
        """Without ``env.auto_reset`` every epoch starts fresh episodes (same seed per group)."""
        if not self.cfg.auto_reset:
            self.obs = [e.reset(seed_offset=epoch * self.cfg.total_num_envs).obs for e in self.envs]
            self.last_dones = [torch.zeros_like(d) for d in self.last_dones]

    def restart_bad(
        self,
        stage: int,
        out: EnvOutput,
        bad: np.ndarray,
        rec: StageRecorder,
        step: int,
        where: str,
    ) -> None:
        """Copies that returned a non-finite value restart; their samples up to here are masked."""
        if bad.any():
            out.obs = self.envs[stage].restart(bad, out.obs)
            rec.mark_bad(torch.from_numpy(bad), step)
        self.guards[stage].count(bad, where)

    def episodes(self) -> dict[str, list]:
        """The episodes finished since the last call, over every stage (``successes`` and
        ``tasks`` from adapters that report them: ``tidal.envs.success_metrics``)."""
        episodes = [e.stats.drain() for e in self.envs]
        return {
            key: [x for ep in episodes for x in ep[key]]
            for key in ("returns", "lengths", "successes", "tasks")
        }

    def drain_nonfinite(self) -> int:
        return sum(g.drain() for g in self.guards)

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Each stage's observations, dones and env state, and what the envs could not save."""
        envs, missed = zip(*(e.state_dict() for e in self.envs))
        return {
            "obs": list(self.obs),
            "last_dones": list(self.last_dones),
            "envs": list(envs),
            "missed": sorted({m for ms in missed for m in ms}),
        }

    def layout_mismatch(self, state: dict) -> str | None:
        """Why ``state`` cannot be restored here (another layout of stages and envs), or None."""
        saved = (len(state["envs"]), state["obs"][0].shape[0])
        if saved == (self.num_stages, self.stage_envs):
            return None
        return (
            f"the checkpoint has {saved[0]} stages of {saved[1]} envs, this run "
            f"{self.num_stages} of {self.stage_envs}; the envs restart from their seeds"
        )

    def load_state_dict(self, state: dict) -> None:
        for env, env_state in zip(self.envs, state["envs"]):
            env.load_state_dict(env_state)
        self.obs, self.last_dones = list(state["obs"]), list(state["last_dones"])

    def close(self) -> None:
        for e in self.envs:
            e.close()


class EvaluationEnvs:
    """Env rank ``rank``'s share of ``env.eval_num_envs`` (seeded by ``evaluation_seeds``), where
    the running evaluation has got to (``obs``), and, on rank 0 with ``runner.eval_video`` on,
    the recorder filming its first envs. Evaluation only names and zeroes non-finite values
    (no restarts, never aborts)."""

    def __init__(self, env, runner, rank: int, world_size: int):
        count = env.eval_num_envs // world_size
        self.guard = NonFiniteGuard(rank, rank * count, count, limit=2**62)
        self.obs: torch.Tensor | None = None
        adapter = env_from_config(env, count, rank * count)
        self.video = None
        if runner.eval_video and rank == 0:
            self.video = FrameRecorder(adapter, runner.eval_video_envs, runner.eval_video_size)
        self.env = ChunkedEnv(
            adapter if self.video is None else self.video,
            False,
            evaluation_seeds(runner.seed, count, first=rank * count),
        )

    def start(self, epoch: int) -> None:
        """A new evaluation after training epoch ``epoch`` (its seeds' offset): every env
        resets, the recorder starts filming."""
        if self.video is not None:
            self.video.start()
        self.obs = self.env.reset(seed_offset=evaluation_offset(epoch)).obs
        self.env.stats.drain()

    def step(self, actions: np.ndarray, where: str) -> None:
        out = self.env.step(actions)
        self.guard.check(out, ("obs", "rewards"), "eval env", where)
        self.obs = out.obs

    def results(self) -> dict:
        """Whether every env has finished its episode, the frames filmed since the last call,
        and the episodes' statistics."""
        finished = self.env.all_reported()
        video = None if self.video is None else self.video.take()
        if finished and self.video is not None:
            self.video.stop()
        return {"finished": finished, "video": video, **self.env.stats.drain()}
