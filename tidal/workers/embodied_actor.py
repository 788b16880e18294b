"""The embodied on-policy actor: receives trajectories, computes advantages from the registry,
and trains the policy with the PPO family's objective (micro-batches, gradient accumulation,
data parallel over ranks). The model, its reference, the engine, the weights out and the
checkpoints are the ``Trainer``'s (tidal/trainer.py)."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from tidal.algorithms.chunks import chunk_advantages, chunk_loss_inputs, chunk_masks, spread_to
from tidal.algorithms.objectives import drop_stale, minibatch_denominators
from tidal.data import Trajectory
from tidal.data.records import flat_time_major, flatten_steps
from tidal.data.routes import TRAJECTORY_TAG, Topology
from tidal.models.factory import build_from_config
from tidal.models.lora import apply_lora
from tidal.runtime import Channel, CommMapper, ConfigSections, merge_batches
from tidal.runtime.devices import to_device
from tidal.trainer import Trainer


def _time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


class EmbodiedActor(Trainer):
    """The on-policy embodied actor (the PPO family): trajectories in, advantages, epochs."""

    config_sections = ("cluster", "runner", "env", "rollout", "model", "actor", "algorithm")

    def __init__(
        self,
        cfg: ConfigSections,
        topology: Topology,
        observation_space: gym.Space,
        action_space: gym.Space,
        max_episode_steps: int | None = None,
    ):
        self.topo = topology
        self.setup_rank(cfg)

        def build(weights: bool = True):
            spaces = (observation_space, action_space, cfg.env.num_action_chunks)
            policy = build_from_config(cfg.model, *spaces, weights=weights)
            return apply_lora(policy, cfg.model.lora, f"policy {cfg.model.name!r}")

        # the KL reference is the policy training started from (model.path, e.g. the
        # behaviour-cloned policy), kept as the language half keeps its own
        self.build_trainer(build)
        self.max_chunk_steps = math.ceil(
            (max_episode_steps or cfg.rollout.num_steps) / cfg.env.num_action_chunks
        )
        self.batch: dict[str, torch.Tensor] | None = None
        self.traj: Trajectory | None = None

    @property
    def weight_receivers(self) -> int:
        return self.topo.rollout

    @property
    def sends_snapshot(self) -> bool:
        # asynchronous runs: the update may wait in the channel while the next step trains
        return self.cfg.rollout.max_staleness > 0

    # -- data ----------------------------------------------------------------------------

    async def recv_trajectories(self, actor_ch: Channel, timeout: float = 600.0) -> int:
        sources = self.topo.env * self.topo.stages
        shards = []
        for src, size in CommMapper.get_src_ranks(
            self.topo.total_num_envs, sources, self.world_size, self.rank
        ):
            key = CommMapper.build_channel_key(src, self.rank, TRAJECTORY_TAG)
            shard: Trajectory = await actor_ch.get(key=key, async_op=True, timeout=timeout)
            if shard.rewards.shape[0] != size:
                raise ValueError(
                    f"trajectory from source {src}: expected {size} envs, got {shard.rewards.shape[0]}"
                )
            shards.append(shard)
        self.traj = to_device(merge_batches(shards), self.compute_device)  # once per step
        return self.traj.rewards.shape[0]

    async def discard_trajectories(self, actor_ch: Channel, timeout: float = 600.0) -> int:
        """Receive the next trajectories and drop them (a collection too stale to train on)."""
        count = await self.recv_trajectories(actor_ch, timeout)
        self.traj = None
        return count

    def compute_advantages(self) -> dict[str, float]:
        """Advantages and returns from the registry, then the flat, time-major sample batch."""
        cfg, alg, traj = self.cfg, self.cfg.algorithm, self.traj
        # a policy started from model.path (e.g. cloned by ``tidal sft``) keeps the statistics
        # its weights were fitted with: moving them would change what it does without a step
        if self.model.obs_norm is not None and traj.raw_obs is not None and cfg.model.path is None:
            self.model.obs_norm.update(traj.raw_obs)
        values = self._values(traj)
        out = chunk_advantages(
            _time_major(traj.rewards).float() * alg.reward_scale,
            _time_major(traj.dones),
            values,
            None if traj.valid is None else _time_major(traj.valid),
            adv_type=alg.adv_type,
            reward_type=alg.reward_type,
            gamma=alg.gamma,
            lam=alg.gae_lambda,
            group_size=cfg.env.group_size,
            auto_reset=cfg.env.auto_reset,
            normalize=alg.normalize_advantages,
        )
        lag = self.engine.step - traj.versions.float().mean()
        metrics = {**out.metrics, "rollout/policy_version_lag": float(lag)}
        self.batch = traj.samples()
        for key in ("advantages", "returns", "mask", "mask_sum"):
            self.batch[key] = flatten_steps(getattr(out, key))
        if values is not None:
            self.batch["old_values"] = flatten_steps(values[:-1])
        if self.ref is not None:
            with self.reference.in_use() as ref:
                self.batch["ref_logprobs"] = self._logprobs_under(ref)
        metrics.update(self._staleness())
        return metrics

    def _values(self, traj: Trajectory) -> torch.Tensor | None:
        """``[T + 1, B]`` values for GAE, the returns and value clipping: the rollout's, or (an
        asynchronous run with ``recompute_values``) this actor's critic's on the same inputs,
        as the rollout's are up to eta versions old (a stale baseline, and clipping around it
        stops the value loss where the critic has since moved towards the returns)."""
        if traj.prev_values is None:
            return None
        stale = self.cfg.rollout.max_staleness > 0
        if not (stale and self.cfg.algorithm.recompute_values and traj.bootstrap_inputs):
            return _time_major(traj.prev_values).float()
        inputs = {  # [B, T + 1, ...] → [(T + 1) * B, ...], time-major
            k: flat_time_major(torch.cat([v, traj.bootstrap_inputs[k][:, None]], 1))
            for k, v in traj.forward_inputs.items()
        }
        return self._critic(inputs).view(traj.prev_values.shape[1], -1)

    def _critic(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The current critic's values of flat inputs."""
        return self._no_grad_passes(lambda part: self.model.value(part), inputs)

    def _staleness(self) -> dict[str, float]:
        """How many versions behind the weights the samples are; asynchronous runs leave those
        older than ``max_staleness`` out of the loss (none with ``staleness_policy=wait``:
        admission already bounds them)."""
        self.batch["mask"], metrics = drop_stale(
            self.batch["versions"],
            self.batch["mask"],
            self.engine.step,
            self.cfg.rollout.max_staleness,
        )
        return metrics

    # -- training ------------------------------------------------------------------------

    def run_training(self) -> dict[str, float]:
        """PPO epochs over the batch: shuffled (seeded) global batches split over the ranks,
        each an optimizer step accumulated over micro-batches."""
        alg, act = self.cfg.algorithm, self.cfg.actor
        per_rank = act.global_batch_size // self.world_size
        size = self.batch["advantages"].shape[0]
        if size % per_rank:
            raise ValueError(
                f"actor rank {self.rank}: {size} samples do not divide into per-rank batches of {per_rank}"
            )
        step = self.engine.step
        generator = torch.Generator().manual_seed(self.cfg.runner.seed + 1000 * self.rank + step)
        critic_only = step < alg.critic_warmup_steps
        if self.objective.needs_prox:
            self.batch["prox_logprobs"] = self._logprobs_under(self.model)

        def loss_for(micro_batches):  # every term divided by its count over the minibatch
            masks = [chunk_masks(m, alg.logprob_type) for m in micro_batches]
            critic = "old_values" in self.batch
            norm = minibatch_denominators(
                [p for p, _ in masks], [v for _, v in masks] if critic else None, alg.loss_agg
            )
            return lambda model, micro: self._micro_loss(model, micro, critic_only, norm)

        target_kl = alg.target_kl
        metrics = self.engine.train_epochs(
            self.batch,
            loss_for,
            epochs=alg.update_epochs,
            minibatch=per_rank,
            micro_batch=act.micro_batch_size,
            generator=generator,
            stop=None if target_kl is None else lambda e: np.mean(e["approx_kl"]) > target_kl,
        )
        out = {f"train/{k}": float(np.mean(v)) for k, v in metrics.items()}
        out.update(self.engine.end_step())
        return self.all_reduce_mean(out)

    def _logprobs_under(self, model) -> torch.Tensor:
        """The batch's per-dimension log-probs under ``model``: this policy before the step
        (the proximal policy of the decoupled loss) or the frozen reference of the KL penalty."""
        inputs = {k[3:]: v for k, v in self.batch.items() if k.startswith("in.")}
        inputs["actions"] = self.batch["actions"]
        return self._no_grad_passes(
            lambda part: model(part, part.pop("actions"))["logprobs"], inputs
        )

    @torch.no_grad()
    def _no_grad_passes(self, fn, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``fn`` over flat inputs a micro-batch at a time, concatenated (float32)."""
        size, micro = next(iter(inputs.values())).shape[0], self.cfg.actor.micro_batch_size
        return torch.cat(
            [
                fn({k: v[start : start + micro] for k, v in inputs.items()}).float()
                for start in range(0, size, micro)
            ]
        )

    def _micro_loss(self, model, micro: dict[str, torch.Tensor], critic_only: bool, norm):
        inputs = {k[3:]: v for k, v in micro.items() if k.startswith("in.")}
        out = model(inputs, micro["actions"])
        level = self.cfg.algorithm.logprob_type
        policy, value = chunk_loss_inputs(micro, out, level, self.engine.step)
        loss, info = self.objective.loss(
            policy,
            value,
            critic_only,
            norm,
            agg=self.cfg.algorithm.loss_agg,
            loss_mask_sum=spread_to(micro["mask_sum"], policy.logp),
            max_episode_steps=self.max_chunk_steps,
        )
        return loss, {k: v.detach() for k, v in info.items()}  # read once per optimizer step
