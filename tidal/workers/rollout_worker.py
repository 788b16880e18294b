"""The rollout worker: merges env shards, runs the policy (no grad, eval mode) and sends an
action chunk back to each env rank, stamped with its policy version."""

from __future__ import annotations

import gymnasium as gym
import torch

from tidal.checkpoint import rng_state, set_rng_state
from tidal.config import EmbodiedConfig
from tidal.data import ChunkActions, EnvOutput
from tidal.data.routes import Topology, action_tag, obs_tag, policy_tag
from tidal.envs.recorder import PolicyRecorder
from tidal.models.factory import build_from_config
from tidal.runtime import (
    Channel,
    CommMapper,
    ConfigSections,
    Outbox,
    Worker,
    async_recv_batch,
)
from tidal.runtime.devices import to_host
from tidal.runtime.weight_sync import WeightLinks, load_checked


def make_policy(
    cfg: EmbodiedConfig | ConfigSections, observation_space: gym.Space, action_space: gym.Space
):
    return build_from_config(cfg.model, observation_space, action_space, cfg.env.num_action_chunks)


class RolloutWorker(Worker, WeightLinks):
    config_sections = ("cluster", "runner", "env", "rollout", "model")

    def __init__(
        self,
        cfg: ConfigSections,
        topology: Topology,
        observation_space: gym.Space,
        action_space: gym.Space,
    ):
        self.cfg, self.topo = cfg, topology
        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.runner.seed + 7 * self.rank + 1)
        self.compute_device = self.torch_device(cfg.cluster.device)
        self.policy = (
            make_policy(cfg, observation_space, action_space).to(self.compute_device).eval()
        )
        self.version = -1  # no weights received yet
        self._stamp, self._stamp_version = None, None

    async def sync_weights(self, link, timeout: float = 600.0) -> int:
        """The next update over the run's weight link (or a bare channel), checked, then loaded:
        a refused one changes nothing and names the tensor."""
        end = self.weight_end(link, "recv", timeout_s=timeout)
        self._load(end, await end.arecv(self.offload))  # the receive leaves the event loop free
        return self.version

    async def take_weights(self, weights_ch: Channel) -> int:
        """Load the newest update already waiting, without blocking (asynchronous runs: the
        actor sends after every step or every few SAC updates, the rollout takes them between
        chunk steps); older ones waiting are received and dropped, never loaded."""
        key = CommMapper.build_channel_key(0, self.rank, "weights")
        end, newest = self.weight_end(weights_ch, "recv"), None
        while weights_ch.qsize(key) > 0:
            newest = await end.arecv(self.offload)
        if newest is not None:
            self._load(end, newest)
        return self.version

    def _load(self, end, update) -> None:
        load_checked(self.policy, update.state_dict, adopt=update.owned)
        if update.owned:
            end.adopted()
        self.version = update.version

    async def generate(
        self,
        rollout_ch: Channel,
        env_ch: Channel,
        mode: str = "train",
        num_steps: int | None = None,
        timeout: float = 600.0,
        weights_ch: Channel | None = None,
        deterministic: bool | None = None,
        policy_record: bool = False,
    ) -> int:
        """Answer ``num_steps`` chunk steps of every pipeline stage (train: ``rollout.num_steps``
        plus one whose values bootstrap the last step). With ``weights_ch`` (asynchronous runs)
        newer weights are taken between chunk steps; every answer carries its version. Eval
        acts by the mode of the policy unless ``deterministic`` (default
        ``rollout.eval_deterministic``) is false. With ``policy_record`` (a training epoch
        the env records as a ``Trajectory``) the answers carry only what the env steps with,
        and each stage's ``PolicyRecord`` follows the last answer (one message per epoch
        instead of seven tensors a chunk step)."""
        stages = self.topo.stages if mode == "train" else 1
        steps = self.cfg.rollout.num_steps + 1 if mode == "train" else num_steps
        if deterministic is None:
            deterministic = self.cfg.rollout.eval_deterministic
        deterministic = mode == "eval" and deterministic
        batch = self.topo.stage_batch(mode)
        outbox = Outbox()
        recorders = [PolicyRecorder() for _ in range(stages)] if policy_record else None
        for _ in range(steps):
            if weights_ch is not None:
                await self.take_weights(weights_ch)
            for s in range(stages):
                out: EnvOutput = await async_recv_batch(
                    rollout_ch,
                    self.rank,
                    self.topo.env,
                    self.world_size,
                    batch,
                    tag=obs_tag(mode, s),
                    timeout=timeout,
                )
                answer = self._act(out, deterministic, with_values=mode == "train")
                if recorders is not None:
                    answer = recorders[s].add(answer)
                await outbox.send(
                    env_ch,
                    answer,
                    self.rank,
                    self.world_size,
                    self.topo.env,
                    tag=action_tag(mode, s),
                )
        for s, rec in enumerate(recorders or []):
            await outbox.send(
                env_ch, rec.record(), self.rank, self.world_size, self.topo.env, tag=policy_tag(s)
            )
        await outbox.flush()
        return steps

    def state_dict(self, with_weights: bool = False) -> dict:
        """The sampling RNG of this process (on ``local`` every rank shares the process's) and
        the policy version; ``with_weights``: also the weights (rank 0), when they are older than
        the actor's (``runner.weight_sync_interval`` > 1)."""
        weights = None
        if with_weights and self.rank == 0:  # every rank holds the same weights
            weights = {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}
        return {"rng": rng_state(), "version": self.version, "weights": weights}

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state["rng"])
        if state["weights"] is not None:
            self.policy.load_state_dict(state["weights"])
            self.version = state["version"]

    # inference mode: cheaper per op than no_grad. What it makes is only read later (stacked
    # into trajectories, or pickled on ray), which inference tensors allow.
    @torch.inference_mode()
    def _act(self, out: EnvOutput, deterministic: bool, with_values: bool) -> ChunkActions:
        device = self.compute_device
        inputs = self.policy.prepare(out.obs.to(device))
        step = self.policy.act(inputs, deterministic=deterministic)
        final_values = None
        if with_values and out.needs_bootstrap is not None and step.values is not None:
            final_values = torch.zeros_like(step.values)
            # needs_bootstrap came over the wire: asking it on the host costs no device sync
            if out.final_obs is not None and bool(out.needs_bootstrap.any()):
                rows = out.needs_bootstrap
                final_obs = out.final_obs[rows].to(device)
                final_values[rows.to(device)] = self.policy.value(self.policy.prepare(final_obs))
        answer = ChunkActions(
            actions=step.actions,
            env_actions=torch.as_tensor(self.policy.env_actions(step.actions)),
            logprobs=step.logprobs,
            values=step.values if with_values else None,
            final_values=final_values,
            forward_inputs=step.inputs,
            version=self._version_stamp(step.actions.shape[0]),
        )
        # the answer crosses the channel: one copy to the host (none on a CPU rank)
        return answer if device.type == "cpu" else to_host(answer)

    def _version_stamp(self, rows: int) -> torch.Tensor:
        """``[rows]`` of the current version; one tensor per (version, rows), shared by the chunk
        steps that carry it (read-only: trajectories stack it)."""
        if (
            self._stamp is None
            or self._stamp.shape[0] != rows
            or self._stamp_version != self.version
        ):
            self._stamp = torch.full((rows,), self.version, dtype=torch.int64)
            self._stamp_version = self.version
        return self._stamp
