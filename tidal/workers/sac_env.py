"""The env side of off-policy training: steps its envs continuously, one segment of
``rollout.num_steps`` chunk steps per call, and sends the segment's transitions (obs, action,
reward, termination, truncation, final observation) to the actor's replay buffer over the
actor channel: one message per stage, segment and actor rank, never one call per step. With
several actor ranks each env's transitions go to one of them (contiguous blocks of the stage's
envs), so every rank's buffer holds whole episodes of its own envs.

Each call answers exactly ``num_steps + 1`` observations per stage, as ``RolloutWorker.generate``
expects; the rollout's last answer of a segment is kept (``pending``) and stepped first in the
next one, so no action is wasted and the envs never wait for a reset between segments.
"""

from __future__ import annotations

import torch

from tidal.data import ChunkActions, EnvOutput
from tidal.runtime import Channel, CommMapper, Outbox
from tidal.workers.env_worker import EnvWorker

TRANSITION_TAG = "transitions"


def chunk_transition(
    obs: torch.Tensor, actions: torch.Tensor, out: EnvOutput, gamma: float
) -> dict[str, torch.Tensor]:
    """One chunk step as one transition per env: the chunk's rewards discounted within it, its
    end (termination wins over truncation), the observation it ended on (``final_obs`` where
    an episode ended, else the next one) and the actions it took (``steps``)."""
    dones = out.dones
    chunk = dones.shape[1]
    ended = dones.any(-1)
    steps = torch.where(
        ended, dones.float().argmax(-1) + 1, torch.full_like(ended, chunk, dtype=torch.long)
    )
    discounts = gamma ** torch.arange(chunk, dtype=torch.float32)
    final = out.final_obs if out.final_obs is not None else out.obs
    terminated = out.terminations.any(-1)
    return {
        "obs": obs.float(),
        "actions": actions.float(),
        "rewards": (out.rewards.float() * discounts).sum(-1),
        "terminations": terminated,
        "truncations": out.truncations.any(-1) & ~terminated,
        "next_obs": torch.where(ended[:, None], final, out.obs).float(),
        "steps": steps.long(),
    }


class TransitionEnvWorker(EnvWorker):
    """``EnvWorker`` with continuous collection into a replay buffer (``collect``); evaluation,
    routing and checkpoints are the base's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list[ChunkActions | None] = [None] * self.stages
        # the actor rank each of a stage's envs sends its transitions to
        self.actor_of_env = torch.arange(self.stage_envs) * self.topo.actor // self.stage_envs

    async def collect(
        self, rollout_ch: Channel, env_ch: Channel, actor_ch: Channel, timeout: float = 600.0
    ) -> dict:
        """One segment: ``rollout.num_steps`` chunk steps per env (``+ 1`` after the first
        segment: the action kept from the last one). Transitions with a non-finite observation
        or reward are named by the guard, left out of the buffer, and their env restarted."""
        train, steps = self.train_envs, self.cfg.rollout.num_steps
        outbox = Outbox()
        first = self.pending[0] is None
        if first:
            for s in range(self.stages):
                await self._send_obs(outbox, rollout_ch, EnvOutput(obs=train.obs[s]), "train", s)
        records: list[list[dict]] = [[] for _ in range(self.stages)]
        for t in range(steps if first else steps + 1):
            for s in range(self.stages):
                act = self.pending[s] if t == 0 and not first else None
                if act is None:
                    act = await self._recv_actions(env_ch, "train", s, timeout)
                out = await self._step(train.envs[s], act.env_actions.numpy())
                where = f"collection segment {self.epoch + 1}, chunk step {t}"
                bad = train.guards[s].check(out, ("obs", "final_obs", "rewards"), "env", where)
                record = chunk_transition(train.obs[s], act.actions, out, self.gamma)
                keep = ~torch.from_numpy(bad)
                record["actor_rank"] = self.actor_of_env
                records[s].append({k: v[keep] for k, v in record.items()})
                if bad.any():
                    out.obs = train.envs[s].restart(bad, out.obs)
                train.guards[s].count(bad, where)
                train.obs[s] = out.obs
                await self._send_obs(outbox, rollout_ch, EnvOutput(obs=out.obs), "train", s)
        for s in range(self.stages):
            self.pending[s] = await self._recv_actions(env_ch, "train", s, timeout)
            segment = {k: torch.cat([r[k] for r in records[s]]) for k in records[s][0]}
            owner = segment.pop("actor_rank")
            src = self.rank * self.stages + s
            for dst in range(self.topo.actor):
                mine = owner == dst
                await outbox.put(
                    actor_ch,
                    {k: v[mine] for k, v in segment.items()},
                    CommMapper.build_channel_key(src, dst, TRANSITION_TAG),
                )
        await outbox.flush()
        self.epoch += 1
        transitions = sum(r["rewards"].shape[0] for rec in records for r in rec)
        chunks = len(records[0]) * self.stage_envs * self.stages
        return {
            **train.episodes(),
            "env_steps": chunks * self.cfg.env.num_action_chunks,
            "transitions": transitions,
            "chunk_steps": chunks,
            "nonfinite": train.drain_nonfinite(),
        }

    def state_dict(self) -> dict:
        """The base's, with the kept actions (the next segment steps them first)."""
        pending = None
        if self.pending[0] is not None:
            pending = [{"actions": p.actions, "env_actions": p.env_actions} for p in self.pending]
        return {**super().state_dict(), "pending": pending}

    def load_state_dict(self, state: dict) -> list[str]:
        missed = super().load_state_dict(state)
        if state.get("pending") is not None and not missed:
            self.pending = [ChunkActions(**p) for p in state["pending"]]
        return missed
