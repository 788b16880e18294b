"""The actor worker: receives trajectories, computes advantages from the registry, and trains
the policy with PPO (micro-batches, gradient accumulation, data parallel over ranks)."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import numpy as np
import torch

from tidal.algorithms import (
    advantage_spec,
    decoupled_ppo_loss,
    get_advantage,
    kl_estimate,
    loglinear_prox_logp,
    loss_mask_from_dones,
    masked_whiten,
    ppo_policy_loss,
    reduce_chunk_level,
    reshape_logprobs,
    value_loss,
    within_staleness,
)
from tidal.data import Trajectory
from tidal.engine import TrainEngine
from tidal.runtime import Channel, CommMapper, ConfigSections, Worker, merge_batches, send_weights
from tidal.workers.rollout_worker import make_policy
from tidal.workers.routes import TRAJECTORY_TAG, Topology


def _time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


def _flatten_steps(x: torch.Tensor) -> torch.Tensor:
    """``[T, B, ...]`` → ``[T * B, ...]``."""
    return x.reshape(-1, *x.shape[2:])


class ActorWorker(Worker):
    config_sections = ("cluster", "runner", "env", "rollout", "model", "actor", "algorithm")

    def __init__(
        self,
        cfg: ConfigSections,
        topology: Topology,
        observation_space: gym.Space,
        action_space: gym.Space,
        max_episode_steps: int | None = None,
    ):
        self.cfg, self.topo = cfg, topology
        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.runner.seed)
        self.policy = make_policy(cfg, observation_space, action_space)
        if self.world_size > 1:
            self.init_distributed()
        self.engine = TrainEngine(
            self.policy, cfg.actor, cfg.runner.max_steps, distributed=self.world_size > 1
        )
        self.estimator = advantage_spec(cfg.algorithm.adv_type)
        # a KL penalty keeps the policy near the one training started from (model.path, e.g.
        # the behaviour-cloned policy): a frozen copy, as the language half keeps its reference
        self.ref = None
        if cfg.algorithm.kl_coef > 0:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.max_chunk_steps = math.ceil(
            (max_episode_steps or cfg.rollout.num_steps) / cfg.env.num_action_chunks
        )
        self.batch: dict[str, torch.Tensor] | None = None
        self.traj: Trajectory | None = None

    # -- weights -------------------------------------------------------------------------

    def send_weights(self, weights_ch: Channel) -> int:
        """Rank 0 sends its weights to every rollout rank. Asynchronous runs send a copy: the
        update may wait in the channel while the next step changes the weights in place."""
        if self.rank == 0:
            weights = self.policy.state_dict()
            if self.cfg.rollout.max_staleness > 0:
                weights = {k: v.detach().clone() for k, v in weights.items()}
            send_weights(weights_ch, weights, self.engine.step, self.topo.rollout)
        return self.engine.step

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
        self.traj = merge_batches(shards)
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
        if self.policy.obs_norm is not None and traj.raw_obs is not None and cfg.model.path is None:
            self.policy.obs_norm.update(traj.raw_obs)
        rewards = _time_major(traj.rewards).float() * alg.reward_scale  # [T, B, C]
        dones = _time_major(traj.dones)  # [T + 1, B, C]
        steps, batch, chunk = rewards.shape
        r, d = reduce_chunk_level(rewards, dones, alg.reward_type)
        if cfg.env.auto_reset:
            mask = torch.ones_like(r, dtype=torch.bool)
            mask_sum = torch.full(r.shape, float(r.shape[0]))
        else:
            mask, mask_sum = loss_mask_from_dones(d)
        if traj.valid is not None:  # envs that returned non-finite values: their samples are out
            valid = _time_major(traj.valid)
            per_action = alg.reward_type == "action"
            mask = mask & (valid.repeat_interleave(chunk, 0) if per_action else valid)
        values = self._values(traj)
        adv, ret = get_advantage(alg.adv_type)(
            rewards=r,
            values=values,
            dones=d,
            mask=mask,
            gamma=alg.gamma,
            lam=alg.gae_lambda,
            group_size=cfg.env.group_size,
        )
        if alg.normalize_advantages and self.estimator.whiten:
            adv = masked_whiten(adv, mask)
        metrics = {
            "rollout/reward_per_step": float(r[mask].mean()) if mask.any() else 0.0,
            "rollout/advantage_mean": float(adv[mask].mean()) if mask.any() else 0.0,
            "rollout/return_target_mean": float(ret[mask].mean()) if mask.any() else 0.0,
            "rollout/valid_fraction": float(mask.float().mean()),
            "rollout/policy_version_lag": float(self.engine.step - traj.versions.float().mean()),
        }
        if alg.reward_type == "action":  # [T * C, B] → [T, B, C]: one advantage per action
            adv, ret = (x.reshape(steps, chunk, batch).transpose(1, 2) for x in (adv, ret))
            mask, mask_sum = (
                x.reshape(steps, chunk, batch).transpose(1, 2) for x in (mask, mask_sum)
            )
        self.batch = {
            **{f"in.{k}": _flatten_steps(_time_major(v)) for k, v in traj.forward_inputs.items()},
            "actions": _flatten_steps(_time_major(traj.actions)),
            "old_logprobs": _flatten_steps(_time_major(traj.prev_logprobs)),
            "advantages": _flatten_steps(adv),
            "returns": _flatten_steps(ret),
            "mask": _flatten_steps(mask),
            "mask_sum": _flatten_steps(mask_sum),
        }
        if values is not None:
            self.batch["old_values"] = _flatten_steps(values[:-1])
        self.batch["versions"] = _flatten_steps(_time_major(traj.versions))
        if self.ref is not None:
            self.batch["ref_logprobs"] = self._logprobs_under(self.ref)
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
            k: _flatten_steps(_time_major(torch.cat([v, traj.bootstrap_inputs[k][:, None]], 1)))
            for k, v in traj.forward_inputs.items()
        }
        return self._critic(inputs).view(traj.prev_values.shape[1], -1)

    @torch.no_grad()
    def _critic(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The current critic's values of flat inputs, a micro-batch at a time."""
        size, micro = next(iter(inputs.values())).shape[0], self.cfg.actor.micro_batch_size
        parts = [
            self.policy.value({k: v[start : start + micro] for k, v in inputs.items()}).float()
            for start in range(0, size, micro)
        ]
        return torch.cat(parts)

    def _staleness(self) -> dict[str, float]:
        """How many versions behind the weights each sample is (``staleness/*``, the names the
        language half uses). Asynchronous runs leave samples older than ``max_staleness`` out of
        the loss (none with ``staleness_policy=wait``: admission already bounds them)."""
        eta, version = self.cfg.rollout.max_staleness, self.engine.step
        versions, mask = self.batch["versions"], self.batch["mask"]
        metrics = {}
        if eta > 0:
            keep = within_staleness(versions, version, eta)
            self.batch["mask"] = mask & keep.view(-1, *([1] * (mask.dim() - 1)))
            metrics["rollout/stale_dropped"] = float((~keep).sum())
            versions = versions[keep]
        stale = (version - versions).float()
        empty = len(stale) == 0
        metrics["staleness/mean"] = 0.0 if empty else float(stale.mean())
        metrics["staleness/max"] = 0.0 if empty else float(stale.max())
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
        accumulation = per_rank // act.micro_batch_size
        if alg.use_decoupled_loss and alg.prox_logp_method == "recompute":
            self.batch["prox_logprobs"] = self._logprobs_under(self.policy)

        def loss_fn(model, micro):
            loss, info = self._micro_loss(model, micro, critic_only)
            return loss / accumulation, info

        metrics: dict[str, list[float]] = {}
        for _ in range(alg.update_epochs):
            order = torch.randperm(size, generator=generator)
            epoch_kl = []
            for start in range(0, size, per_rank):
                idx = order[start : start + per_rank].split(act.micro_batch_size)
                micro_batches = [{k: v[i] for k, v in self.batch.items()} for i in idx]
                for k, v in self.engine.train_batch(micro_batches, loss_fn).items():
                    metrics.setdefault(k, []).extend(v)
                epoch_kl.extend(metrics["approx_kl"][-len(micro_batches) :])
            if alg.target_kl is not None and np.mean(epoch_kl) > alg.target_kl:
                break
        out = {f"train/{k}": float(np.mean(v)) for k, v in metrics.items()}
        out.update(self.engine.end_step())
        return self.all_reduce_mean(out)

    @torch.no_grad()
    def _logprobs_under(self, model) -> torch.Tensor:
        """The batch's per-dimension log-probs under ``model``: this policy before the step
        (the proximal policy of the decoupled loss, ``prox_logp_method=recompute``) or the
        frozen reference of the KL penalty."""
        size, micro = self.batch["actions"].shape[0], self.cfg.actor.micro_batch_size
        outs = []
        inputs = {k[3:]: v for k, v in self.batch.items() if k.startswith("in.")}
        for start in range(0, size, micro):
            part = {k: v[start : start + micro] for k, v in inputs.items()}
            outs.append(
                model(part, self.batch["actions"][start : start + micro])["logprobs"].float()
            )
        return torch.cat(outs)

    def _policy_loss(self, logp, micro, adv, mask, mask_sum):
        """Standard PPO against the behaviour log-probs, or decoupled PPO (trust region around
        the proximal policy, behaviour weights capped) with the language half's functions."""
        alg = self.cfg.algorithm
        old = reshape_logprobs(micro["old_logprobs"], alg.logprob_type)
        clip = (alg.clip_ratio_low, alg.clip_ratio_high)
        agg = {
            "agg": alg.loss_agg,
            "loss_mask_sum": mask_sum,
            "max_episode_steps": self.max_chunk_steps,
        }
        if not alg.use_decoupled_loss:
            return ppo_policy_loss(logp, old, adv, mask, *clip, alg.dual_clip, **agg)
        if alg.prox_logp_method == "recompute":
            prox = reshape_logprobs(micro["prox_logprobs"], alg.logprob_type)
        else:
            versions = self._broadcast(micro["versions"], logp)
            prox = loglinear_prox_logp(old, logp, versions, self.engine.step)
        return decoupled_ppo_loss(
            logp,
            prox,
            old,
            adv,
            mask,
            *clip,
            behav_weight_cap=alg.behav_weight_cap,
            cap_mode=alg.cap_mode,
            dual_clip=alg.dual_clip,
            **agg,
        )

    def _micro_loss(self, model, micro: dict[str, torch.Tensor], critic_only: bool):
        alg = self.cfg.algorithm
        inputs = {k[3:]: v for k, v in micro.items() if k.startswith("in.")}
        out = model(inputs, micro["actions"])
        level = alg.logprob_type
        logp = reshape_logprobs(out["logprobs"].float(), level)
        adv, mask, mask_sum = (
            self._broadcast(micro[k], logp) for k in ("advantages", "mask", "mask_sum")
        )
        pg_loss, pg = self._policy_loss(logp, micro, adv, mask, mask_sum)
        entropy = reshape_logprobs(out["entropy"].float(), level)
        entropy_mean = torch.where(mask, entropy, 0.0).sum() / mask.sum().clamp(min=1)
        info = {
            "policy_loss": pg_loss.item(),
            "entropy": entropy_mean.item(),
            **{k: v.item() for k, v in pg.items()},
        }
        loss = torch.zeros(())
        if not critic_only:
            loss = pg_loss - alg.entropy_bonus * entropy_mean
        if self.ref is not None:  # k1..k3 per element at the loss's level, masked mean
            ref = reshape_logprobs(micro["ref_logprobs"], level)
            kl = torch.where(mask, kl_estimate(logp, ref, alg.kl_kind), 0.0)
            kl_ref = kl.sum() / mask.sum().clamp(min=1)
            if not critic_only:
                loss = loss + alg.kl_coef * kl_ref
            info["kl_ref"] = kl_ref.item()
        if "values" in out and "old_values" in micro:
            step_mask = micro["mask"] if micro["mask"].dim() == 1 else micro["mask"].any(-1)
            v_loss, v = value_loss(
                out["values"].float(),
                micro["old_values"],
                self._step_returns(micro["returns"]),
                step_mask,
                alg.value_clip,
                alg.huber_delta,
            )
            loss = loss + alg.vf_coef * v_loss
            info.update({"value_loss": v_loss.item(), **{k: x.item() for k, x in v.items()}})
        return loss, info

    @staticmethod
    def _broadcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Per-step (``[N]``) or per-action (``[N, C]``) values spread to the log-prob level."""
        while x.dim() < like.dim():
            x = x.unsqueeze(-1)
        if x.dim() > like.dim():  # per-action values at chunk level cannot happen (validated)
            raise ValueError(
                f"cannot spread {tuple(x.shape)} onto log-probs of {tuple(like.shape)}"
            )
        return x.expand_as(like)

    @staticmethod
    def _step_returns(returns: torch.Tensor) -> torch.Tensor:
        return returns if returns.dim() == 1 else returns[:, 0]

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, path: str, meta: dict, extra: dict | None = None) -> str | None:
        """Rank 0 writes the checkpoint; ``extra``: other groups' state, saved alongside."""
        if self.rank != 0:
            return None
        return str(self.engine.save(path, {**meta, "version": self.engine.step}, extra))

    def load(self, path: str) -> dict:
        return self.engine.load(path)
