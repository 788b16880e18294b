"""The env worker: steps its share of vectorised envs in action chunks, talks to the rollout
over channels stage by stage, and assembles the trajectories it sends to the actor."""

from __future__ import annotations

import math

import numpy as np
import torch

from tidal.algorithms import advantage_spec
from tidal.data import ChunkActions, EnvOutput, Trajectory
from tidal.envs import ChunkedEnv, env_make_kwargs, make_env
from tidal.envs.checks import NonFiniteGuard
from tidal.envs.seeds import evaluation_offset, evaluation_seeds
from tidal.envs.video import FrameRecorder
from tidal.runtime import Channel, ConfigSections, Outbox, Worker, async_recv_batch
from tidal.workers.routes import TRAJECTORY_TAG, Topology, action_tag, obs_tag, reward_tags


class _StageRecorder:
    """Collects one stage's chunk steps of an epoch and stacks them batch-first."""

    def __init__(self, first_dones: torch.Tensor):
        self.inputs, self.actions, self.logprobs, self.values, self.versions = [], [], [], [], []
        self.raw_obs, self.rewards = [], []
        self.terms, self.truncs, self.dones = [first_dones], [first_dones], [first_dones]
        self.last_bad = torch.full((first_dones.shape[0],), -1)  # last step with a non-finite value
        self.bootstrap_inputs: dict[str, torch.Tensor] | None = None

    def add_policy(self, act: ChunkActions, raw_obs: torch.Tensor) -> None:
        self.inputs.append(act.forward_inputs)
        self.actions.append(act.actions)
        self.logprobs.append(act.logprobs)
        self.versions.append(act.version)
        self.raw_obs.append(raw_obs)

    def add_env(self, out: EnvOutput) -> None:
        self.rewards.append(out.rewards.clone())
        self.terms.append(out.terminations)
        self.truncs.append(out.truncations)
        self.dones.append(out.dones)

    def add_bootstrap(self, needs: torch.Tensor, final_values: torch.Tensor, gamma: float) -> None:
        """A truncated episode's last reward gains ``gamma * V(final_obs)``; the done then stops
        the recursion, so the value of the reset observation never leaks across episodes."""
        rows = needs.nonzero().flatten()
        if len(rows):
            position = self.dones[-1][rows].float().argmax(-1)
            self.rewards[-1][rows, position] += gamma * final_values[rows]

    def mark_bad(self, bad: torch.Tensor, step: int) -> None:
        """Mask these envs' samples up to ``step``: their advantages depend on the bad value."""
        self.last_bad[bad] = step

    def trajectory(self) -> Trajectory:
        stack = lambda xs: torch.stack(xs, 1)  # noqa: E731  [B, T, ...]
        keys = self.inputs[0].keys()
        valid = torch.arange(len(self.rewards))[None, :] > self.last_bad[:, None]
        return Trajectory(
            forward_inputs={k: stack([i[k] for i in self.inputs]) for k in keys},
            actions=stack(self.actions),
            prev_logprobs=stack(self.logprobs),
            prev_values=stack(self.values) if self.values and self.values[0] is not None else None,
            rewards=stack(self.rewards),
            terminations=stack(self.terms),
            truncations=stack(self.truncs),
            dones=stack(self.dones),
            raw_obs=stack(self.raw_obs),
            versions=stack(self.versions),
            valid=valid,
            bootstrap_inputs=self.bootstrap_inputs,
        )


class EnvWorker(Worker):
    config_sections = ("cluster", "runner", "env", "rollout", "algorithm")

    def __init__(self, cfg: ConfigSections, topology: Topology):
        self.cfg, self.topo = cfg, topology
        torch.set_num_threads(cfg.cluster.torch_threads)
        env = cfg.env
        self.stages = env.pipeline_stage_num
        self.stage_envs = env.total_num_envs // (self.world_size * self.stages)
        self.gamma = cfg.algorithm.gamma
        self.bootstrap = advantage_spec(cfg.algorithm.adv_type).needs_bootstrap
        self.bootstrap_on = (
            "truncations" if cfg.algorithm.bootstrap_type == "truncated" else "dones"
        )
        first_env = [(self.rank * self.stages + s) * self.stage_envs for s in range(self.stages)]
        self.envs = [
            ChunkedEnv(
                self._make(self.stage_envs, first_env[s], env.group_size),
                env.auto_reset,
                self._seeds(s, self.stage_envs, env.group_size),
            )
            for s in range(self.stages)
        ]
        self._guards = [
            NonFiniteGuard(self.rank, first, self.stage_envs, env.max_nonfinite_steps)
            for first in first_env
        ]
        eval_envs = env.eval_num_envs // self.world_size
        # evaluation only names and zeroes non-finite values (no restarts, never aborts)
        self._eval_guard = NonFiniteGuard(self.rank, self.rank * eval_envs, eval_envs, limit=2**62)
        self._eval_obs = None  # where the running evaluation has got to
        eval_adapter = self._make(eval_envs, self.rank * eval_envs)
        self.video = self._video_recorder(eval_adapter)
        self.eval_env = ChunkedEnv(
            eval_adapter if self.video is None else self.video,
            False,
            evaluation_seeds(cfg.runner.seed, eval_envs, first=self.rank * eval_envs),
        )
        self.epoch = 0
        self._prefetched = False  # the next epoch's first observations were already sent
        self._obs = [e.reset().obs for e in self.envs]
        chunk = env.num_action_chunks
        self._last_dones = [
            torch.zeros(self.stage_envs, chunk, dtype=torch.bool) for _ in range(self.stages)
        ]
        self.max_episode_steps = self.envs[0].env.max_episode_steps

    def _make(self, num_envs: int, first_env: int, group_size: int = 1):
        env = self.cfg.env
        return make_env(env.adapter, num_envs, **env_make_kwargs(env, first_env, group_size))

    def _video_recorder(self, eval_adapter) -> FrameRecorder | None:
        """Rank 0 films its first eval envs when ``runner.eval_video`` is on."""
        runner = self.cfg.runner
        if not runner.eval_video or self.rank != 0:
            return None
        return FrameRecorder(eval_adapter, runner.eval_video_envs, runner.eval_video_size)

    def _seeds(self, stage: int, count: int, group_size: int) -> list[int]:
        """Envs ``g * group_size .. (g + 1) * group_size - 1`` (global numbering) share a seed."""
        first = (self.rank * self.stages + stage) * count
        return [self.cfg.runner.seed + (first + i) // group_size for i in range(count)]

    # -- one training epoch -------------------------------------------------------------

    async def interact(
        self,
        rollout_ch: Channel,
        env_ch: Channel,
        actor_ch: Channel,
        reward_ch: Channel | None = None,
        timeout: float = 600.0,
    ) -> dict:
        """Step ``rollout.num_steps`` chunks per env, then send the trajectories to the actor."""
        steps = self.cfg.rollout.num_steps
        outbox = Outbox()
        prefetched, self._prefetched = self._prefetched, False
        if not prefetched:
            await self._start_epoch(outbox, rollout_ch)
        recorders = [_StageRecorder(d) for d in self._last_dones]
        needs = [torch.zeros(self.stage_envs, dtype=torch.bool) for _ in range(self.stages)]
        for t in range(steps + 1):
            for s in range(self.stages):
                act: ChunkActions = await self._recv_actions(env_ch, "train", s, timeout)
                rec = recorders[s]
                if t > 0 and act.final_values is not None:
                    rec.add_bootstrap(needs[s], act.final_values, self.gamma)
                rec.values.append(act.values)
                if t == steps:
                    rec.bootstrap_inputs = act.forward_inputs
                    continue
                rec.add_policy(act, self._obs[s])
                out = await self._step(self.envs[s], act.env_actions.numpy())
                where = f"training step {self.epoch + 1}, chunk step {t}"
                bad = self._guards[s].check(out, ("obs", "final_obs", "rewards"), "env", where)
                if reward_ch is not None:
                    out.rewards = await self._model_rewards(
                        outbox, reward_ch, env_ch, out, s, timeout
                    )
                    bad |= self._guards[s].check(out, ("rewards",), "reward model", where)
                self._restart_bad(s, out, bad, rec, t, where)
                needs[s] = (
                    getattr(out, self.bootstrap_on).any(-1)
                    if self.bootstrap
                    else torch.zeros_like(needs[s])
                )
                rec.add_env(out)
                self._obs[s] = out.obs
                # final_obs always travels (a copy of obs where nothing ended): shards merge alike
                final_obs = out.final_obs if out.final_obs is not None else out.obs
                await self._send_obs(
                    outbox,
                    rollout_ch,
                    EnvOutput(obs=out.obs, final_obs=final_obs, needs_bootstrap=needs[s]),
                    "train",
                    s,
                )
        for s, rec in enumerate(recorders):
            self._last_dones[s] = rec.dones[-1]
            await outbox.send(
                actor_ch,
                rec.trajectory(),
                self.rank * self.stages + s,
                self.world_size * self.stages,
                self.topo.actor,
                tag=TRAJECTORY_TAG,
            )
        await outbox.flush()
        self.epoch += 1
        episodes = [e.stats.drain() for e in self.envs]
        return {
            "returns": [r for ep in episodes for r in ep["returns"]],
            "lengths": [n for ep in episodes for n in ep["lengths"]],
            # per finished episode, from adapters that report success (tidal.envs.success_metrics)
            "successes": [x for ep in episodes for x in ep["successes"]],
            "tasks": [x for ep in episodes for x in ep["tasks"]],
            "env_steps": steps * self.stage_envs * self.stages * self.cfg.env.num_action_chunks,
            "prefetched": prefetched,
            "nonfinite": sum(g.drain() for g in self._guards),
        }

    def _restart_bad(
        self,
        stage: int,
        out: EnvOutput,
        bad: np.ndarray,
        rec: _StageRecorder,
        step: int,
        where: str,
    ) -> None:
        """Copies that returned a non-finite value restart; their samples up to here are masked."""
        if bad.any():
            out.obs = self.envs[stage].restart(bad, out.obs)
            rec.mark_bad(torch.from_numpy(bad), step)
        self._guards[stage].count(bad, where)

    async def _start_epoch(self, outbox: Outbox, rollout_ch: Channel) -> None:
        """Reset when every epoch starts fresh episodes (same seed per group), then send each
        stage's first observation to the rollout."""
        if not self.cfg.env.auto_reset:
            self._obs = [
                e.reset(seed_offset=self.epoch * self.cfg.env.total_num_envs).obs for e in self.envs
            ]
            self._last_dones = [torch.zeros_like(d) for d in self._last_dones]
        for s in range(self.stages):
            await self._send_obs(outbox, rollout_ch, EnvOutput(obs=self._obs[s]), "train", s)

    async def prefetch_train_bootstrap(self, rollout_ch: Channel) -> None:
        """Start the next epoch early — its resets and first observations — while the actor
        trains; the next ``interact`` then begins with the rollout's answer."""
        outbox = Outbox()
        await self._start_epoch(outbox, rollout_ch)
        await outbox.flush()
        self._prefetched = True

    def eval_horizon(self) -> int:
        """Chunk steps that take every eval env through one whole episode."""
        return math.ceil((self.max_episode_steps or 1000) / self.cfg.env.num_action_chunks)

    async def evaluate(
        self,
        rollout_ch: Channel,
        env_ch: Channel,
        num_steps: int,
        start: bool,
        timeout: float = 600.0,
    ) -> dict:
        """Step the eval envs ``num_steps`` chunks with the rollout's deterministic policy
        (``start``: reset them first). The runner calls it in segments until every eval env
        has finished its episode, so short episodes end an evaluation early."""
        if start:
            if self.video is not None:
                self.video.start()
            self._eval_obs = self.eval_env.reset(seed_offset=evaluation_offset(self.epoch)).obs
            self.eval_env.stats.drain()
        outbox = Outbox()
        for _ in range(num_steps):
            await self._send_obs(outbox, rollout_ch, EnvOutput(obs=self._eval_obs), "eval", 0)
            act = await self._recv_actions(env_ch, "eval", 0, timeout)
            out = self.eval_env.step(act.env_actions.numpy())
            where = f"the evaluation after training step {self.epoch}"
            self._eval_guard.check(out, ("obs", "rewards"), "eval env", where)
            self._eval_obs = out.obs
        await outbox.flush()
        finished = self.eval_env.all_reported()
        video = None if self.video is None else self.video.take()
        if finished and self.video is not None:
            self.video.stop()
        return {"finished": finished, "video": video, **self.eval_env.stats.drain()}

    async def _step(self, env: ChunkedEnv, actions):
        """With several pipeline stages and an event loop shared with the rollout (local), the
        simulator steps off the loop, so the rollout infers one stage while this stage
        simulates. A rank with a process of its own steps on its loop: the rollout infers in
        its own process meanwhile, and a thread would only contend for the GIL."""
        if self.stages > 1 and not self.owns_event_loop:
            return await self.offload(env.step, actions)
        return env.step(actions)

    # -- routing ------------------------------------------------------------------------

    async def _send_obs(
        self, outbox: Outbox, rollout_ch: Channel, out: EnvOutput, mode: str, stage: int
    ) -> None:
        await outbox.send(
            rollout_ch, out, self.rank, self.world_size, self.topo.rollout, tag=obs_tag(mode, stage)
        )

    async def _recv_actions(
        self, env_ch: Channel, mode: str, stage: int, timeout: float
    ) -> ChunkActions:
        return await async_recv_batch(
            env_ch,
            self.rank,
            self.topo.rollout,
            self.world_size,
            self.topo.stage_batch(mode),
            tag=action_tag(mode, stage),
            timeout=timeout,
        )

    async def _model_rewards(
        self,
        outbox: Outbox,
        reward_ch: Channel,
        env_ch: Channel,
        out: EnvOutput,
        stage: int,
        timeout: float,
    ) -> torch.Tensor:
        tag_in, tag_out = reward_tags(stage)
        await outbox.send(reward_ch, out, self.rank, self.world_size, self.topo.reward, tag=tag_in)
        rewards = await async_recv_batch(
            env_ch,
            self.rank,
            self.topo.reward,
            self.world_size,
            self.topo.stage_batch("train"),
            tag=tag_out,
            timeout=timeout,
        )
        return rewards["rewards"]

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the training envs are: each stage's observations, dones and env state, and
        the epoch (it also offsets the reset and evaluation seeds). The eval envs restart at
        every evaluation, so they have nothing to keep. A prefetched epoch start (``prefetched``)
        is for the runner to redo on resume: its resets are seeded, so it sends the same
        observations."""
        envs, missed = zip(*(e.state_dict() for e in self.envs))
        return {
            "epoch": self.epoch,
            "obs": list(self._obs),
            "last_dones": list(self._last_dones),
            "envs": list(envs),
            "missed": sorted({m for ms in missed for m in ms}),
            "prefetched": self._prefetched,
        }

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore what ``state_dict`` saved; returns what it could not capture or restore."""
        self.epoch = state["epoch"]
        saved = (len(state["envs"]), state["obs"][0].shape[0])
        if saved != (self.stages, self.stage_envs):  # another layout: keep the fresh envs
            return [
                f"the checkpoint has {saved[0]} stages of {saved[1]} envs, this run "
                f"{self.stages} of {self.stage_envs}; the envs restart from their seeds"
            ]
        for env, env_state in zip(self.envs, state["envs"]):
            env.load_state_dict(env_state)
        self._prefetched = False
        self._obs, self._last_dones = list(state["obs"]), list(state["last_dones"])
        return state["missed"]

    def close(self) -> None:
        for e in [*self.envs, self.eval_env]:
            e.close()
