"""The SAC actor: holds the replay buffer, fed by the env ranks over the actor channel, and
updates the squashed-Gaussian actor, the Q ensemble, its targets and the temperature.

``ingest`` (async: it only moves transitions from the channel into the buffer) and
``update`` (a plain method: it runs on the rank's compute thread, so on the local backend the
envs and the rollout keep stepping on the event loop meanwhile) are separate calls.

Several actor ranks (ray) train data-parallel: each holds the transitions of its share of the
envs, samples ``replay.batch_size / ranks`` of every minibatch from them, and every optimizer
step averages the gradients over the ranks (one all-reduce per loss, the engine's), so the
ranks' weights stay equal; rank 0 sends them to the rollout. The losses and the order of the
steps are the objective's (``SACObjective.update``, tidal/algorithms/sac.py).
"""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import torch
from torch import nn

from tidal.algorithms.objectives import OBJECTIVES
from tidal.checkpoint import load_extra
from tidal.config import ConfigError
from tidal.data.replay import ReplayBuffer
from tidal.data.routes import TRANSITION_TAG, Topology
from tidal.engine import MultiOptimizerEngine
from tidal.envs.layout import layout_of
from tidal.models.factory import build_from_config
from tidal.models.sac import QEnsemble, SquashedGaussianPolicy
from tidal.models.sac_cnn import shift_observations
from tidal.runtime import Channel, CommMapper, ConfigSections
from tidal.runtime.devices import to_host
from tidal.trainer import Trainer

REPLAY_FILE = "replay.pt"  # the buffer's contents, with replay.save


class SACAgent(nn.Module):
    """Everything SAC learns, as one module (one ``model.safetensors`` in a checkpoint)."""

    def __init__(self, policy: SquashedGaussianPolicy, critics: QEnsemble, log_alpha: float):
        super().__init__()
        self.policy, self.critics = policy, critics
        self.targets = copy.deepcopy(critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(log_alpha)))


class SACActor(Trainer):
    """SAC's actor: a ``Trainer`` whose model is the ``SACAgent``, stepped part by part through
    the ``MultiOptimizerEngine`` (tidal/engine.py), and that sends only the policy's weights."""

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
        self.topo = topology
        self.setup_rank(cfg)
        alg, model = cfg.algorithm, cfg.model
        policy = build_from_config(
            model, observation_space, action_space, cfg.env.num_action_chunks
        )
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
        self.model = self.agent = SACAgent(policy, critics, log_alpha).to(self.compute_device)
        self.policy = policy
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
        # a pixel encoder learns from the critics' loss only (DrQ)
        encoder = policy.encoder_parameters()
        shared = {id(p) for p in encoder}
        head = [p for p in policy.parameters() if id(p) not in shared]
        parts = {
            "actor": (head, cfg.actor.lr),
            "critic": ([*critics.parameters(), *encoder], alg.critic_lr or cfg.actor.lr),
            "alpha": ([self.agent.log_alpha], alg.alpha_lr or cfg.actor.lr),
        }
        self.engine = MultiOptimizerEngine(self.agent, parts, cfg.actor, self.world_size, "sac")
        self.sources = topology.env * topology.stages
        self.received = [0] * self.sources  # segments taken from each (env rank, stage)

    # -- weights out: the policy's, a copy (the update may wait in the channel while training
    # changes the weights in place); the version is the update count --------------------------

    @property
    def weight_receivers(self) -> int:
        return self.topo.rollout

    sends_snapshot = True

    def weight_stream(self):
        return iter(self.policy.state_dict().items() if self.rank == 0 else ())

    def weight_tensors(self):
        return list(self.weight_stream()) if self.rank == 0 else None

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
            self.engine.end_step()
            if weights_ch is not None and self.version % interval == 0:
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
                "train/skipped_updates": float(self.engine.skipped_steps),
                "updates": self.version,
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
        batch = self.buffer.sample(self.rank_batch, self.generator, self.demo_fraction)
        batch["rewards"] = batch["rewards"] * self.cfg.algorithm.reward_scale
        pad = self.cfg.algorithm.image_pad  # DrQ's random shift of the images (0: none)
        for key in ("obs", "next_obs") if pad else ():
            batch[key] = shift_observations(batch[key], self.obs_layout, pad, self.generator)
        step = self.engine.step_loss
        alpha, version = self._alpha(), self.version
        return self.objective.update(self.agent, batch, alpha, step, version, self.generator)

    def agent_state(self) -> dict[str, torch.Tensor]:
        """The agent's weights on the host (data-parallel ranks hold the same)."""
        return to_host({k: v.detach().clone() for k, v in self.agent.state_dict().items()})

    def replay_summary(self) -> dict:
        return self.buffer.summary()

    # -- checkpoints: the engine's (agent, optimizers, RNG, counters, each rank's own state),
    # with this rank's sampling state and its buffer ------------------------------------------

    def save(self, path: str, meta: dict, extra: dict | None = None) -> str | None:
        """With ``replay.save`` the buffer too: rank 0's in ``REPLAY_FILE``, a rank > 0's in
        its own state. The policy's weights are under ``policy.`` (tidal eval reads them)."""
        own = {
            "generator": self.generator.get_state(),
            "counters": {"received": self.received},
            "replay": self.buffer.state_dict(with_data=False),
        }
        extra = dict(extra or {})
        if self.cfg.replay.save:
            held = self.buffer.state_dict(with_data=True)
            (extra if self.rank == 0 else own)[REPLAY_FILE] = held
        meta = {**meta, "replay_saved": self.cfg.replay.save, "policy_prefix": "policy."}
        saved = self.engine.save(path, meta, extra, self.rank, own)
        return None if saved is None else str(saved)

    def load(self, path: str) -> dict:
        """Everything ``save`` wrote; the buffer's contents when the checkpoint holds them
        (``meta['replay_restored']``), else it stays empty and refills."""
        own, meta = self.engine.load(path, self.rank)
        self.generator.set_state(own["generator"])
        self.received = list(own["counters"]["received"])
        saved = own.get(REPLAY_FILE) if self.rank else load_extra(path, REPLAY_FILE)
        restored = saved is not None and self.buffer.load_state_dict(saved)
        return {**meta, "replay_restored": restored}
