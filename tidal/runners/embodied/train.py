"""The on-policy embodied runner (``algorithm.name: ppo``, and the PPO family): sync weights →
generate rollouts (env, rollout, reward and actor groups over channels) → advantages → train →
evaluate / checkpoint / log (the shared run loop; the groups, their evaluation and checkpoint
state: ``EmbodiedGroups``).

With ``rollout.max_staleness`` (eta) > 0 it is asynchronous: the env and rollout groups keep
collecting while the actor trains (``Pacer`` with the ``StalenessBudget`` admission both halves'
``StalenessManager`` backs), the rollout takes the weights sent after every step between chunk
steps, and no sample is trained on more than eta versions after the version that produced it.
``eta = 0`` is the synchronous loop."""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.asynchrony import StalenessManager
from tidal.config import EmbodiedConfig
from tidal.config.embodied import components
from tidal.runners.embodied.base import EmbodiedRunLoop
from tidal.runners.embodied.groups import (
    EmbodiedGroups,
    env_steps_reached,
    env_steps_summary,
    rollout_metrics,
)
from tidal.runners.embodied.pacer import Pacer, StalenessBudget
from tidal.runners.loop import fmt
from tidal.runtime import wait_all
from tidal.workers import EmbodiedActor, EnvWorker, RewardWorker, RolloutWorker

log = logging.getLogger("tidal.train")


class EmbodiedRunner(EmbodiedRunLoop):
    def __init__(self, cfg: EmbodiedConfig, run_dir: Path | None = None):
        self.reward = None  # the reward group's, once launched
        self.env_steps = 0
        self.staleness: StalenessManager | None = None
        self.budget: StalenessBudget | None = None
        super().__init__(cfg, run_dir)

    @property
    def asynchronous(self) -> bool:
        return self.cfg.rollout.max_staleness > 0

    # -- what the run loop asks of a runner ------------------------------------------------

    def build(self) -> None:
        cfg, topo, spaces = self.cfg, self.topo, self.spaces
        self.cluster = self.start_cluster()  # placement asks it
        self.groups = g = EmbodiedGroups(cfg, self.run_dir, self.cluster)
        g.launch(
            self.place(components(cfg)),
            env=EnvWorker.create_group(cfg, topo),
            rollout=RolloutWorker.create_group(cfg, topo, *spaces),
            actor=EmbodiedActor.create_group(cfg, topo, *spaces, self.max_episode_steps),
            reward=RewardWorker.create_group(cfg, topo) if cfg.reward.enabled else None,
        )
        self.env, self.rollout, self.actor, self.reward = g.env, g.rollout, g.actor, g.reward
        self.channels = g.channels
        if self.asynchronous:
            self.build_pacer()

    def build_pacer(self) -> None:
        """Admission in trajectory segments (one env's chunk steps of one training step): a
        training step consumes ``total_num_envs`` of them, one collection runs at a time."""
        segments, r = self.cfg.env.total_num_envs, self.cfg.rollout
        self.staleness = StalenessManager(r.max_staleness, segments, segments)
        self.budget = StalenessBudget(self.staleness, segments, r.staleness_policy)
        weights = self.channels["weights"]
        self.pacer = Pacer(
            self.budget, lambda: self.collection_handles(weights), self.cfg.runner.timeout_s
        )

    def restore(self, checkpoint: Path) -> dict:
        meta = self.groups.restore(checkpoint)
        self.env_steps = meta["env_steps"]
        if self.budget is not None:  # collected but untrained segments were not saved
            self.budget.restore(meta["step"])
        return meta

    def checkpoint_meta(self) -> dict:
        return {"env_steps": self.env_steps}

    def should_stop(self, metrics: dict) -> bool:
        return env_steps_reached(self.cfg, self.env_steps)

    def summarize(self) -> dict:
        return env_steps_summary(self.cfg, self.evals, self.env_steps)

    def progress_info(self, m: dict) -> str:
        success = (
            f"success {fmt(m['rollout/success_rate'])} " if "rollout/success_rate" in m else ""
        )
        return (
            f"env_steps {m['env_steps']} return {fmt(m.get('rollout/return_mean'))} {success}"
            f"eval {fmt(m.get('eval/return_mean'))} loss {m.get('train/policy_loss', 0):.4f} "
            f"v_loss {m.get('train/value_loss', 0):.4f} kl {m.get('train/approx_kl', 0):.4f} "
            f"{m['env_steps_per_s']:.0f} steps/s"
        )

    # -- phases ----------------------------------------------------------------------------

    @property
    def rollout_version(self) -> int | None:
        return self.groups.rollout_version

    def sync_weights(self) -> None:
        self.groups.sync_weights()

    def collection_handles(self, weights_ch=None) -> list:
        """One epoch of every env: env, rollout (and reward) calls; the env's results first.
        With ``weights_ch`` the rollout takes newer weights between chunk steps."""
        c, timeout = self.channels, self.cfg.runner.timeout_s
        handles = [
            self.env.interact(
                c["rollout"], c["env"], c["actor"], c["reward"] if self.reward else None, timeout
            ),
            self.rollout.generate(
                c["rollout"],
                c["env"],
                "train",
                timeout=timeout,
                weights_ch=weights_ch,
                policy_record=True,
            ),
        ]
        if self.reward is not None:
            handles.append(self.reward.compute_rewards(c["reward"], c["env"], timeout))
        return handles

    def generate_rollouts(self) -> dict:
        timeout = self.cfg.runner.timeout_s
        handles = self.collection_handles()
        handles.insert(2, self.actor.recv_trajectories(self.channels["actor"], timeout))
        return self.rollout_metrics(wait_all(handles, timeout)[0])

    def rollout_metrics(self, env_results: list[dict]) -> dict:
        """What the env ranks report of an epoch; counts its env steps."""
        self.env_steps += sum(res["env_steps"] for res in env_results)
        return rollout_metrics(env_results)

    def evaluate(self, step: int) -> dict:
        self.current_rollout_weights(step)
        return self.groups.evaluate(step)

    def current_rollout_weights(self, step: int) -> None:
        """Give the rollout the weights after ``step`` steps (asynchronous runs: once the running
        collection has finished, the update already sent is taken)."""
        if self.pacer is not None and self.rollout_version is not None:
            self.pacer.drain()
            self.groups.take_sent_weights()
        if self.rollout_version != step:
            self.sync_weights()

    def save(self, path: Path, meta: dict) -> str:
        """The actor's checkpoint with the env and rollout ranks' state (asynchronous runs:
        taken between collections, with the staleness counters)."""
        if self.pacer is not None:
            self.current_rollout_weights(meta["step"])
            meta = {**meta, "staleness": self.staleness.snapshot()}
        return self.groups.save(path, meta, stale_weights=self.rollout_version != meta["step"])

    def train_step(self, step: int) -> dict:
        if self.pacer is not None:
            return self.async_train_step(step)
        timeout = self.cfg.runner.timeout_s
        with self.timer("step"):
            with self.timer("sync_weights"):
                if step % self.cfg.runner.weight_sync_interval == 0 or self.rollout_version is None:
                    self.sync_weights()
            with self.actor_offloaded(self.actor), self.timer("generate_rollouts"):
                metrics = self.generate_rollouts()
            with self.timer("compute_advantages"):
                metrics.update(self.actor.compute_advantages().wait(timeout)[0])
            with self.timer("train"):
                handles = [self.actor.run_training()]
                if self.cfg.runner.overlap_env_bootstrap and step + 1 < self.cfg.runner.max_steps:
                    handles.append(self.env.prefetch_train_bootstrap(self.channels["rollout"]))
                metrics.update(wait_all(handles, timeout)[0][0])
        metrics.update(self.timer.pop())
        metrics.update({"env_steps": self.env_steps, "version": self.rollout_version})
        metrics["env_steps_per_s"] = self.env_steps_this_step(metrics)
        return metrics

    def async_train_step(self, step: int) -> dict:
        """Train on the oldest collected epoch while the next is collected; then send the
        weights (the rollout takes them between chunk steps) and advance the version. The
        ``version`` logged is the one trained from, as in the synchronous loop."""
        timeout, pacer = self.cfg.runner.timeout_s, self.pacer
        version = self.staleness.get_version()
        with self.timer("step"):
            if self.rollout_version is None:  # a fresh or resumed run: the first weights
                self.sync_weights()
            with self.timer("wait_rollouts"):
                metrics = self.next_collected()
            with self.timer("compute_advantages"):
                handles = [self.actor.recv_trajectories(self.channels["actor"], timeout)]
                pacer.wait(handles)
                metrics.update(pacer.wait([self.actor.compute_advantages()])[0][0])
            with self.timer("train"):
                metrics.update(pacer.wait([self.actor.run_training()])[0][0])
            with self.timer("update_weights"):
                sent = self.actor.send_weights(self.channels["weights"])
                self.groups.rollout_version = sent.wait(timeout)[0]  # taken between chunk steps
                self.staleness.set_version(self.rollout_version)
        metrics.update(self.timer.pop())
        metrics.update(
            {
                "env_steps": self.env_steps,
                "version": version,
                **{f"rollout/{k}": v for k, v in self.staleness.snapshot().items()},
            }
        )
        metrics["env_steps_per_s"] = self.env_steps_this_step(metrics)
        return metrics

    def next_collected(self) -> dict:
        """The rollout metrics of the next collection to train on; dropped ones (too stale,
        ``staleness_policy=drop``) are received by the actor and discarded on the way."""
        timeout = self.cfg.runner.timeout_s
        while True:
            item = self.pacer.next()
            metrics = self.rollout_metrics(item.results[0])
            if not item.dropped:
                return metrics
            self.actor.discard_trajectories(self.channels["actor"], timeout).wait(timeout)

    def env_steps_this_step(self, metrics: dict) -> float:
        per_step = (
            self.cfg.env.total_num_envs
            * self.cfg.rollout.num_steps
            * self.cfg.env.num_action_chunks
        )
        return per_step / max(metrics.get("time/step", 1e-9), 1e-9)

    def cleanup_steps(self, graceful: bool) -> list:
        steps = []
        if graceful and self.pacer is not None:
            steps.append(("running collection", self.pacer.drain))
        return steps + (self.groups.cleanup_steps(graceful) if self.groups is not None else [])
