"""The env worker: steps its share of vectorised envs in action chunks, talks to the rollout
over channels stage by stage, and sends what it recorded to the actor: an epoch's trajectories
(``interact``, on-policy) or a segment's transitions for the replay buffer (``collect``,
off-policy). Its envs are ``tidal/envs/rank_envs.py``'s, its records ``tidal/envs/recorder.py``'s
and its routes ``tidal/data/routes.py``'s."""

from __future__ import annotations

import math

import torch

from tidal.algorithms import advantage_spec
from tidal.data import ChunkActions, EnvOutput
from tidal.data.routes import EnvRoutes, Topology
from tidal.envs import ChunkedEnv
from tidal.envs.rank_envs import EvaluationEnvs, TrainingEnvs
from tidal.envs.recorder import SegmentRecorder, StageRecorder
from tidal.runtime import Channel, ConfigSections, Outbox, Worker


class EnvWorker(Worker):
    config_sections = ("cluster", "runner", "env", "rollout", "algorithm")

    def __init__(self, cfg: ConfigSections, topology: Topology):
        self.cfg, self.topo = cfg, topology
        torch.set_num_threads(cfg.cluster.torch_threads)
        self.gamma = cfg.algorithm.gamma
        self.bootstrap = advantage_spec(cfg.algorithm.adv_type).needs_bootstrap
        self.bootstrap_on = (
            "truncations" if cfg.algorithm.bootstrap_type == "truncated" else "dones"
        )
        self.train_envs = TrainingEnvs(cfg.env, cfg.runner.seed, self.rank, self.world_size)
        self.stages, self.stage_envs = self.train_envs.num_stages, self.train_envs.stage_envs
        self.max_episode_steps = self.train_envs.max_episode_steps
        self.eval_envs = EvaluationEnvs(cfg.env, cfg.runner, self.rank, self.world_size)
        self.routes = EnvRoutes(self.rank, self.world_size, topology)
        self.epoch = 0
        self._prefetched = False  # the next epoch's first observations were already sent
        # off-policy: each stage's last answer of a segment, stepped first in the next one
        self.pending: list[ChunkActions | None] = [None] * self.stages

    # -- one training epoch -------------------------------------------------------------

    async def interact(
        self,
        rollout_ch: Channel,
        env_ch: Channel,
        actor_ch: Channel,
        reward_ch: Channel | None = None,
        timeout: float = 600.0,
    ) -> dict:
        """Step ``rollout.num_steps`` chunks per env, then send the trajectories to the actor:
        this rank's record of each stage joined with the rollout's half (``PolicyRecord``; the
        rollout's ``generate`` runs with ``policy_record``)."""
        steps = self.cfg.rollout.num_steps
        outbox = Outbox()
        train = self.train_envs
        prefetched, self._prefetched = self._prefetched, False
        if not prefetched:
            await self._start_epoch(outbox, rollout_ch)
        recorders = [StageRecorder(d) for d in train.last_dones]
        nothing_ended = torch.zeros(self.stage_envs, dtype=torch.bool)  # shared, read-only
        needs = [nothing_ended] * self.stages
        for t in range(steps + 1):
            for s in range(self.stages):
                act: ChunkActions = await self.routes.recv_actions(env_ch, "train", s, timeout)
                rec = recorders[s]
                if t > 0 and act.final_values is not None and needs[s] is not nothing_ended:
                    rec.add_bootstrap(needs[s], act.final_values, self.gamma)
                if t == steps:
                    continue
                rec.add_obs(train.obs[s])
                out = await self._step(train.envs[s], act.env_actions.numpy())
                where = f"training step {self.epoch + 1}, chunk step {t}"
                bad = train.guards[s].check(out, ("obs", "final_obs", "rewards"), "env", where)
                if reward_ch is not None:
                    out.rewards = await self.routes.model_rewards(
                        outbox, reward_ch, env_ch, out, s, timeout
                    )
                    bad |= train.guards[s].check(out, ("rewards",), "reward model", where)
                train.restart_bad(s, out, bad, rec, t, where)
                # an episode that ended left a final observation (ChunkedEnv.step)
                ended = out.final_obs is not None
                needs[s] = (
                    getattr(out, self.bootstrap_on).any(-1)
                    if self.bootstrap and ended
                    else nothing_ended
                )
                rec.add_env(out)
                train.obs[s] = out.obs
                # final_obs always travels (a copy of obs where nothing ended): shards merge alike
                final_obs = out.final_obs if out.final_obs is not None else out.obs
                await self.routes.send_obs(
                    outbox,
                    rollout_ch,
                    EnvOutput(obs=out.obs, final_obs=final_obs, needs_bootstrap=needs[s]),
                    "train",
                    s,
                )
        for s, rec in enumerate(recorders):
            train.last_dones[s] = rec.dones[-1]
            policy = await self.routes.recv_policy_record(env_ch, s, timeout)
            await self.routes.send_trajectory(outbox, actor_ch, rec.trajectory(policy), s)
        await outbox.flush()
        self.epoch += 1
        return {
            **train.episodes(),
            "env_steps": steps * self.stage_envs * self.stages * self.cfg.env.num_action_chunks,
            "prefetched": prefetched,
            "nonfinite": train.drain_nonfinite(),
        }

    async def _start_epoch(self, outbox: Outbox, rollout_ch: Channel) -> None:
        """Reset if the epoch starts fresh episodes, then send each stage's first observation
        to the rollout."""
        self.train_envs.start_epoch(self.epoch)
        for s in range(self.stages):
            await self.routes.send_obs(
                outbox, rollout_ch, EnvOutput(obs=self.train_envs.obs[s]), "train", s
            )

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
        ev = self.eval_envs
        if start:
            ev.start(self.epoch)
        outbox = Outbox()
        for _ in range(num_steps):
            await self.routes.send_obs(outbox, rollout_ch, EnvOutput(obs=ev.obs), "eval", 0)
            act = await self.routes.recv_actions(env_ch, "eval", 0, timeout)
            ev.step(act.env_actions.numpy(), f"the evaluation after training step {self.epoch}")
        await outbox.flush()
        return ev.results()

    async def _step(self, env: ChunkedEnv, actions):
        """With several pipeline stages and an event loop shared with the rollout (local), the
        simulator steps off the loop, so the rollout infers one stage while this stage
        simulates. A rank with a process of its own steps on its loop: the rollout infers in
        its own process meanwhile, and a thread would only contend for the GIL."""
        if self.stages > 1 and not self.owns_event_loop:
            return await self.offload(env.step, actions)
        return env.step(actions)

    # -- one off-policy segment ---------------------------------------------------------

    async def collect(
        self, rollout_ch: Channel, env_ch: Channel, actor_ch: Channel, timeout: float = 600.0
    ) -> dict:
        """One segment: ``rollout.num_steps`` chunk steps per env (``+ 1`` after the first
        segment: the answer kept from the last one, so no action is wasted and the envs never
        wait for a reset between segments); each stage's transitions go to the actor ranks as
        one message each. Transitions with a non-finite observation or reward are named by the
        guard, left out, and their env restarted."""
        train, steps, routes = self.train_envs, self.cfg.rollout.num_steps, self.routes
        outbox = Outbox()
        first = self.pending[0] is None
        for s in range(self.stages) if first else ():
            await routes.send_obs(outbox, rollout_ch, EnvOutput(obs=train.obs[s]), "train", s)
        segments = [
            SegmentRecorder(self.stage_envs, self.topo.actor, self.gamma)
            for _ in range(self.stages)
        ]
        for t in range(steps if first else steps + 1):
            for s in range(self.stages):
                act = self.pending[s] if t == 0 and not first else None
                if act is None:
                    act = await routes.recv_actions(env_ch, "train", s, timeout)
                out = await self._step(train.envs[s], act.env_actions.numpy())
                where = f"collection segment {self.epoch + 1}, chunk step {t}"
                bad = train.guards[s].check(out, ("obs", "final_obs", "rewards"), "env", where)
                segments[s].add(train.obs[s], act.actions, out, bad)
                if bad.any():
                    out.obs = train.envs[s].restart(bad, out.obs)
                train.guards[s].count(bad, where)
                train.obs[s] = out.obs
                await routes.send_obs(outbox, rollout_ch, EnvOutput(obs=out.obs), "train", s)
        for s, segment in enumerate(segments):
            self.pending[s] = await routes.recv_actions(env_ch, "train", s, timeout)
            await routes.send_transitions(outbox, actor_ch, segment.per_actor(), s)
        await outbox.flush()
        self.epoch += 1
        chunks = len(segments[0].records) * self.stage_envs * self.stages
        return {
            **train.episodes(),
            "env_steps": chunks * self.cfg.env.num_action_chunks,
            "transitions": sum(segment.transitions() for segment in segments),
            "chunk_steps": chunks,
            "nonfinite": train.drain_nonfinite(),
        }

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the training envs are (``TrainingEnvs.state_dict``) and the epoch (it also
        offsets the reset and evaluation seeds). The eval envs restart at every evaluation, so
        they have nothing to keep. A prefetched epoch start (``prefetched``) is for the runner to
        redo on resume: its resets are seeded, so it sends the same observations. Off-policy:
        the kept answers (``pending``; the next segment steps them first)."""
        pending = None
        if self.pending[0] is not None:
            pending = [{"actions": p.actions, "env_actions": p.env_actions} for p in self.pending]
        state = {"epoch": self.epoch, **self.train_envs.state_dict()}
        return {**state, "prefetched": self._prefetched, "pending": pending}

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore what ``state_dict`` saved; returns what it could not capture or restore."""
        self.epoch = state["epoch"]
        if (mismatch := self.train_envs.layout_mismatch(state)) is not None:
            return [mismatch]  # another layout: keep the fresh envs
        self.train_envs.load_state_dict(state)
        self._prefetched = False
        if state.get("pending") is not None and not state["missed"]:
            self.pending = [ChunkActions(**p) for p in state["pending"]]
        return state["missed"]

    def close(self) -> None:
        self.train_envs.close()
        self.eval_envs.env.close()
