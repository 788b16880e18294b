"""The SAC actor: holds the replay buffer, fed by the env ranks over the actor channel, and
updates the squashed-Gaussian actor, the Q ensemble, its targets and the temperature.

``ingest`` (async: it only moves transitions from the channel into the buffer) and
``update`` (a plain method: it runs on the rank's compute thread, so on the local backend the
envs and the rollout keep stepping on the event loop meanwhile) are separate calls.

Several actor ranks (ray) train data-parallel: each holds the transitions of its share of the
envs, samples ``replay.batch_size / ranks`` of every minibatch from them, and every optimizer
step averages the gradients over the ranks (one all-reduce per loss), so the ranks' weights
stay equal; rank 0 sends them to the rollout.
"""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import torch
from torch import nn

from tidal.algorithms.objectives import OBJECTIVES
from tidal.algorithms.sac import polyak_update
from tidal.checkpoint import (
    load_checkpoint,
    load_extra,
    load_strict,
    rng_state,
    save_checkpoint,
    set_rng_state,
    staging_folder,
    staging_path,
)
from tidal.config import ConfigError
from tidal.engine import SkipGuard, global_grad_norm
from tidal.envs.layout import layout_of
from tidal.models.sac import QEnsemble, SquashedGaussianPolicy
from tidal.models.sac_cnn import shift_observations
from tidal.runtime import Channel, CommMapper, ConfigSections, Worker, send_weights
from tidal.runtime.devices import to_host
from tidal.workers.replay import ReplayBuffer
from tidal.workers.rollout_worker import make_policy
from tidal.workers.routes import Topology
from tidal.workers.sac_env import TRANSITION_TAG

REPLAY_FILE = "replay.pt"  # the buffer's contents, with replay.save


def rank_file(rank: int) -> str:
    """What actor rank ``rank`` > 0 keeps in a checkpoint: its sampling state and its buffer."""
    return f"actor_rank{rank}.pt"


class SACAgent(nn.Module):
    """Everything SAC learns, as one module (one ``model.safetensors`` in a checkpoint)."""

    def __init__(self, policy: SquashedGaussianPolicy, critics: QEnsemble, log_alpha: float):
        super().__init__()
        self.policy, self.critics = policy, critics
        self.targets = copy.deepcopy(critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(log_alpha)))


class SACActorWorker(Worker):
    config_sections = (
        "cluster",
        "runner",
        "env",
        "rollout",
        "model",
        "actor",
        "algorithm",
        "replay",
    )

    def __init__(
        self,
        cfg: ConfigSections,
        topology: Topology,
        observation_space: gym.Space,
        action_space: gym.Space,
    ):
        self.cfg, self.topo = cfg, topology
        alg, act, model = cfg.algorithm, cfg.actor, cfg.model
        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.runner.seed)
        self.compute_device = self.torch_device(cfg.cluster.device)
        policy = make_policy(cfg, observation_space, action_space)
        if not isinstance(policy, SquashedGaussianPolicy):
            raise ConfigError(
                f"model.name: algorithm.name sac needs sac_mlp or sac_cnn, got {model.name!r}"
            )
        critics = QEnsemble(
            policy.obs_dim,
            policy.critic_action_dim,
            alg.num_critics,
            model.hidden_sizes,
            model.activation,
            model.critic_layer_norm,
        )
        log_alpha = math.log(alg.alpha or alg.init_alpha)
        self.agent = SACAgent(policy, critics, log_alpha).to(self.compute_device)
        self.policy = policy
        # a pixel encoder learns from the critics' loss only (DrQ)
        encoder = policy.encoder_parameters()
        shared = {id(p) for p in encoder}
        head = [p for p in policy.parameters() if id(p) not in shared]
        adam = lambda params, lr: torch.optim.Adam(params, lr=lr, eps=act.adam_eps, foreach=True)  # noqa: E731
        self.optimizers = {
            "actor": adam(head, act.lr),
            "critic": adam([*critics.parameters(), *encoder], alg.critic_lr or act.lr),
            "alpha": adam([self.agent.log_alpha], alg.alpha_lr or act.lr),
        }
        self.objective = OBJECTIVES.get("sac")(alg, action_dims=policy.critic_action_dim)
        self.obs_layout = layout_of(observation_space)
        self.buffer = ReplayBuffer(
            cfg.replay.capacity,
            observation_space.shape[0],
            (policy.chunks, policy.action_dim),
            device=self.compute_device,
            image_numel=self.obs_layout.image_numel,
        )
        self.demo_fraction = 0.0
        if cfg.replay.demo_path is not None:
            self.buffer.load_demos(cfg.replay.demo_path)
            self.demo_fraction = cfg.replay.demo_fraction
        self.generator = torch.Generator().manual_seed(cfg.runner.seed + 17 + self.rank)
        self.rank_batch = cfg.replay.batch_size // self.world_size
        if self.world_size > 1:
            self.init_distributed()
            self._broadcast_agent()
        self.sources = topology.env * topology.stages
        self.received = [0] * self.sources  # segments taken from each (env rank, stage)
        self.updates = 0
        self.skipped = 0  # optimizer steps with a non-finite loss or gradient, not applied
        limit = cfg.actor.max_skipped_steps  # per optimizer: one may fail while others step
        self.skips = {name: SkipGuard(f"sac {name}", limit) for name in self.optimizers}

    def _broadcast_agent(self) -> None:
        """Rank 0's initial weights on every rank (the seeds agree; this makes it certain)."""
        import torch.distributed as dist

        for t in self.agent.state_dict().values():
            dist.broadcast(t, 0)

    # -- weights -------------------------------------------------------------------------

    def send_weights(self, weights_ch: Channel) -> int:
        """A copy of the actor's weights to every rollout rank (the update may wait in the
        channel while training changes the weights in place); the version is the update count."""
        if self.rank == 0:
            weights = to_host({k: v.detach().clone() for k, v in self.policy.state_dict().items()})
            send_weights(weights_ch, weights, self.updates, self.topo.rollout)
        return self.updates

    # -- data ----------------------------------------------------------------------------

    def set_demos(self, demos: dict[str, torch.Tensor]) -> int:
        """RLPD's demonstrations collected by the runner (``replay.sft_demos``), sampled beside
        online data from the first update on."""
        self.demo_fraction = self.cfg.replay.demo_fraction
        return self.buffer.set_demos(demos)

    async def ingest(self, actor_ch: Channel, segments: int, timeout: float = 600.0) -> int:
        """Take every source's segments up to ``segments`` into the buffer (waiting for those
        not yet arrived); returns the buffer's size."""
        for src in range(self.sources):
            key = CommMapper.build_channel_key(src, self.rank, TRANSITION_TAG)
            while self.received[src] < segments:
                batch = await actor_ch.get(key=key, async_op=True, timeout=timeout)
                self.buffer.add(batch)
                self.received[src] += 1
        return self.buffer.size

    def demo_count(self) -> int:
        """Demonstration transitions the buffer samples beside online data (0: none)."""
        return 0 if self.buffer.demos is None else int(self.buffer.demos["rewards"].shape[0])

    # -- training ------------------------------------------------------------------------

    def update(self, count: int, weights_ch: Channel | None = None) -> dict[str, float]:
        """``count`` SAC updates on minibatches of the buffer; every
        ``runner.weight_sync_interval`` updates the weights go to the rollout."""
        if self.buffer.size == 0:
            raise RuntimeError("sac actor: asked to update with an empty replay buffer")
        self.policy.uniform.fill_(False)  # the warm-up is over: the rollout samples the policy
        logs: dict[str, list[float]] = {}
        interval = self.cfg.runner.weight_sync_interval
        for _ in range(count):
            for k, v in self._one_update().items():
                logs.setdefault(k, []).append(v)
            self.updates += 1
            if weights_ch is not None and self.updates % interval == 0:
                self.send_weights(weights_ch)
        means = [torch.stack(v).float().mean() for v in logs.values()]  # none: all skipped
        means = torch.stack(means) if means else torch.zeros(0)
        out = {f"train/{k}": m for k, m in zip(logs, to_host(means).tolist(), strict=True)}
        out["replay/size"] = float(self.buffer.size)
        # (the ranks skip alike, so they log the same keys)
        out = self.all_reduce_mean(out)
        out["replay/size"] *= self.world_size  # over all ranks
        out.update(
            {
                "train/alpha": float(self._alpha()),
                "train/skipped_updates": float(self.skipped),
                "updates": self.updates,
                "count": count,
            }
        )
        return out

    def _alpha(self) -> torch.Tensor:
        fixed = self.objective.fixed_alpha
        if fixed is not None:
            return torch.tensor(fixed, device=self.compute_device)
        return self.agent.log_alpha.detach().exp()

    def _one_update(self) -> dict[str, torch.Tensor]:
        cfg, obj, agent = self.cfg, self.objective, self.agent
        batch = self.buffer.sample(self.rank_batch, self.generator, self.demo_fraction)
        batch["rewards"] = batch["rewards"] * cfg.algorithm.reward_scale
        obs, next_obs = self._augmented(batch["obs"]), self._augmented(batch["next_obs"])
        alpha = self._alpha()
        with torch.no_grad():  # the target critics read the online encoder (as DrQ-v2)
            next_features = self.policy.encode(next_obs)
            next_actions, next_logp = self.policy.sample_features(next_features)
            next_q = agent.targets(next_features, next_actions)
            target = obj.target(batch, next_q, next_logp, alpha, self.generator)
        features = self.policy.encode(obs)
        q = agent.critics(features, batch["actions"])
        loss, info = obj.critic(q, target)
        if not self._step("critic", loss):
            return {}
        if self.updates % obj.policy_delay == 0:
            # the critics' features, detached: the actor's loss does not train the encoder
            features = features.detach()
            actions, logp = self.policy.sample_features(features)
            loss, actor_info = obj.actor(logp, self._frozen_critics(features, actions), alpha)
            if self._step("actor", loss):
                info.update(actor_info)
            if obj.tunes_alpha:
                loss, alpha_info = obj.alpha(agent.log_alpha, logp)
                if self._step("alpha", loss):
                    info.update(alpha_info)
        polyak_update(agent.targets, agent.critics, obj.tau)
        return info  # tensors: read once per call, not once per update

    def _augmented(self, obs: torch.Tensor) -> torch.Tensor:
        """``algorithm.image_pad``: DrQ's random shift of a batch's images (0: unchanged)."""
        pad = self.cfg.algorithm.image_pad
        return shift_observations(obs, self.obs_layout, pad, self.generator) if pad else obs

    def _frozen_critics(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The critics at the actor's actions with their weights frozen: the actor's loss
        needs the gradient through the actions only, and the critics' weight gradients would
        cost a third of its backward pass (the next critic step clears them anyway)."""
        critics = self.agent.critics
        critics.requires_grad_(False)
        try:
            return critics(obs, actions)
        finally:
            critics.requires_grad_(True)

    def _step(self, name: str, loss: torch.Tensor) -> bool:
        """One optimizer step of ``name``'s parameters; a non-finite loss or gradient is skipped
        (counted, ``train/skipped_updates``), never applied: on every rank if on any; after
        ``actor.max_skipped_steps`` in a row the run stops (e.g. NaN in the demonstrations)."""
        opt = self.optimizers[name]
        opt.zero_grad(set_to_none=True)
        params = [p for group in opt.param_groups for p in group["params"]]
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        if self.world_size > 1:  # the mean of an overflowed gradient overflows on every rank
            finite = self._average_gradients(params, finite)
        with_grad = [p for p in params if p.grad is not None]
        norm = global_grad_norm(with_grad) if finite else None  # a finite loss may overflow it
        if norm is None or not math.isfinite(float(norm)):
            self.skipped += 1
            self.skips[name].skipped(f"update {self.updates + 1}", self.skipped)
            return False
        self.skips[name].stepped()
        clip = self.cfg.actor.max_grad_norm
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(with_grad, clip, norm)
        opt.step()
        return True

    def _average_gradients(self, params: list[nn.Parameter], finite: bool) -> bool:
        """The mean of the ranks' gradients in place, as one flat all-reduce that also counts
        the ranks whose loss was finite; whether all were."""
        import torch.distributed as dist

        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flag = torch.tensor([float(finite)], device=grads[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), flag])
        dist.all_reduce(flat)
        if flat[-1].item() < self.world_size:
            return False
        flat /= self.world_size
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        return True

    def agent_state(self) -> dict[str, torch.Tensor]:
        """The agent's weights on the host (data-parallel ranks hold the same)."""
        return to_host({k: v.detach().clone() for k, v in self.agent.state_dict().items()})

    def replay_summary(self) -> dict:
        """What the buffer holds: its size and whether every stored value is finite."""
        held = {k: v[: self.buffer.size] for k, v in self.buffer.data.items()}
        finite = all(bool(torch.isfinite(v).all()) for v in held.values() if v.is_floating_point())
        return {"size": self.buffer.size, "added": self.buffer.added, "finite": finite}

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, path: str, meta: dict, extra: dict | None = None) -> str | None:
        """Actor, critics, targets and alpha (``model.safetensors``); optimizers, RNGs, counters
        and the buffer's position (``state.pt``); the buffer itself with ``replay.save``.
        Ranks > 0 write their own sampling state and buffer (``rank_file``) into the staging
        folder rank 0 then renames into place: a crash before leaves older checkpoints whole."""
        own = self._rank_state()
        if self.world_size > 1:
            import torch.distributed as dist

            staged = staging_folder(path, "ranks") if self.rank == 0 else None
            dist.barrier()  # the folder exists
            if self.rank != 0:
                torch.save(own, staging_path(path, "ranks") / rank_file(self.rank))
            dist.barrier()  # every rank's file is written
            if self.rank != 0:
                return None
        else:
            staged = None
        extra = dict(extra or {})
        if self.cfg.replay.save:
            extra[REPLAY_FILE] = self.buffer.state_dict(with_data=True)
        return str(
            save_checkpoint(path, self.agent.state_dict(), own, self._meta(meta), extra, staged)
        )

    def _rank_state(self) -> dict:
        """This rank's state (the optimizers are the same on every rank: rank 0's is kept, with
        its buffer in ``REPLAY_FILE``; a rank > 0 keeps its buffer here)."""
        state = {
            "rng": rng_state(),
            "generator": self.generator.get_state(),
            "counters": {
                "updates": self.updates,
                "skipped": self.skipped,
                "received": self.received,
            },
            "replay": self.buffer.state_dict(with_data=False),
        }
        if self.rank == 0:
            state["optimizers"] = {k: o.state_dict() for k, o in self.optimizers.items()}
        elif self.cfg.replay.save:
            state[REPLAY_FILE] = self.buffer.state_dict(with_data=True)
        return state

    def _meta(self, meta: dict) -> dict:
        # the policy's weights under "policy." (tidal eval and export read them alone)
        return {
            **meta,
            "version": self.updates,
            "replay_saved": self.cfg.replay.save,
            "policy_prefix": "policy.",
            "actor_ranks": self.world_size,
        }

    def load(self, path: str) -> dict:
        """Everything ``save`` wrote; the buffer's contents when the checkpoint holds them
        (``meta['replay_restored']``), else it stays empty and refills."""
        model_state, state, meta = load_checkpoint(path)
        saved_ranks = meta.get("actor_ranks", 1)
        if saved_ranks != self.world_size:
            raise ConfigError(
                f"cluster.placement: the checkpoint {path} was trained on {saved_ranks} actor "
                f"rank(s), each with its own replay buffer; resume it on {saved_ranks}, got "
                f"{self.world_size}"
            )
        load_strict(self.agent, model_state, str(path))
        for k, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][k])
        own = state if self.rank == 0 else load_extra(path, rank_file(self.rank))
        set_rng_state(own["rng"])
        self.generator.set_state(own["generator"])
        counters = own["counters"]
        self.updates, self.skipped = counters["updates"], counters["skipped"]
        self.received = list(counters["received"])
        saved = own.get(REPLAY_FILE) if self.rank else load_extra(path, REPLAY_FILE)
        restored = saved is not None and self.buffer.load_state_dict(saved)
        return {**meta, "replay_restored": restored}
