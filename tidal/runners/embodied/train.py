"""The embodied training loop: sync weights → generate rollouts (env, rollout, reward and actor
groups over channels) → advantages → train → evaluate / checkpoint / log (the shared run loop).

With ``rollout.max_staleness`` (eta) > 0 it is asynchronous: the env and rollout groups keep
collecting while the actor trains (tidal.runners.collection, admitted by the
``StalenessManager`` both halves use), the rollout takes the weights sent after every step between chunk steps,
and no sample is trained on more than eta versions after the version that produced it.
``eta = 0`` is the synchronous loop."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np

from tidal.asynchrony import StalenessManager
from tidal.checkpoint import load_extra
from tidal.config import EmbodiedConfig
from tidal.config.embodied import components, same_process
from tidal.envs import episode_metrics, success_metrics
from tidal.envs.video import write_video
from tidal.runners.collection import Collection
from tidal.runners.loop import RunLoop, fmt
from tidal.runners.preflight import check_embodied, check_trainer_checkpoint, probe_env
from tidal.runtime import Channel, wait_all
from tidal.runtime.weight_sync import open_weight_link
from tidal.workers import ActorWorker, EnvWorker, RewardWorker, RolloutWorker, Topology

log = logging.getLogger("tidal.train")
WORKERS_FILE = "workers.pt"  # the env and rollout ranks' state, next to the actor's files
EVAL_SEGMENT = 32  # chunk steps per evaluation call: a few wasted steps against a group call each


class EmbodiedRunner(RunLoop):
    def __init__(self, cfg: EmbodiedConfig, run_dir: Path | None = None):
        self.worlds = check_embodied(cfg)
        env = cfg.env
        self.topo = Topology(
            env=self.worlds["env"],
            rollout=self.worlds["rollout"],
            actor=self.worlds["actor"],
            stages=env.pipeline_stage_num,
            total_num_envs=env.total_num_envs,
            eval_num_envs=env.eval_num_envs,
            reward=self.worlds.get("reward", 0),
        )
        self.spaces, self.max_episode_steps = probe_env(cfg)
        self.cluster = self.env = self.rollout = self.actor = self.reward = None
        self.channels: dict[str, Channel] = {}
        self.env_steps, self.rollout_version = 0, None
        self.staleness: StalenessManager | None = None
        self.collection: Collection | None = None
        super().__init__(cfg, run_dir)

    @property
    def asynchronous(self) -> bool:
        return self.cfg.rollout.max_staleness > 0

    @property
    def initial_evaluation(self) -> bool:
        """A run that starts from a saved policy evaluates it first (the same episodes as
        ``tidal sft``'s evaluation): the start RL improves on."""
        return self.cfg.model.path is not None

    # -- what the run loop asks of a runner ------------------------------------------------

    def check_checkpoint(self, checkpoint: Path) -> None:
        check_trainer_checkpoint(self.cfg, checkpoint)

    def shared_processes(self) -> list[str]:
        return same_process(self.cfg)

    def build(self) -> None:
        cfg, spaces = self.cfg, self.spaces
        self.cluster = self.start_cluster()
        placement = self.place(components(cfg))
        self.env = EnvWorker.create_group(cfg, self.topo).launch(
            self.cluster, placement, name="env"
        )
        self.rollout = RolloutWorker.create_group(cfg, self.topo, *spaces).launch(
            self.cluster, placement, name="rollout"
        )
        self.actor = ActorWorker.create_group(
            cfg, self.topo, *spaces, self.max_episode_steps
        ).launch(self.cluster, placement, name="actor")
        self.reward = (
            RewardWorker.create_group(cfg, self.topo).launch(self.cluster, placement, name="reward")
            if cfg.reward.enabled
            else None
        )
        run_id = f"{cfg.runner.experiment}-{uuid.uuid4().hex[:6]}"
        self.channels = {
            name: Channel.create(f"{run_id}-{name}", self.cluster, consumer=reader)
            for name, reader in self.channel_readers().items()
        }
        self.weights_link = self.open_weights_link(run_id)
        self.eval_horizon = self.env.execute_on(0).eval_horizon().wait(cfg.runner.timeout_s)[0]
        if self.asynchronous:
            self.build_collection()

    def channel_readers(self) -> dict:
        """Each channel and the group that reads its routed keys: bound to it, they travel
        point to point (on ray, by ZeroMQ straight into the reading rank's process). No reward
        channel without a reward group: unbound, it would be a channel actor on ray, a process
        that starts (measured: ~3.4 s of CPU beside the first steps) and idles for nothing."""
        readers = {
            "env": self.env,
            "rollout": self.rollout,
            "actor": self.actor,
            "weights": self.rollout,
        }
        if self.reward is not None:
            readers["reward"] = self.reward
        return readers

    def open_weights_link(self, run_id: str):
        """``rollout.weight_sync``: the weights channel (bound to the rollout), or a link of its
        own from actor rank 0 to every rollout rank (a restart builds a new one)."""
        r = self.cfg.rollout
        if r.weight_sync == "channel":
            return self.channels["weights"]
        return open_weight_link(
            r.weight_sync,
            self.cluster,
            self.actor.execute_on(0),
            self.rollout,
            f"{run_id}-weights",
            self.cfg.runner.timeout_s,
            bucket_mb=r.weight_sync_bucket_mb,
            device=self.cfg.cluster.device,
            folder=str(self.run_dir / "rollout_weights"),
        )

    def build_collection(self) -> None:
        """Admission in trajectory segments (one env's chunk steps of one training step): a
        training step consumes ``total_num_envs`` of them, one collection runs at a time."""
        segments, r = self.cfg.env.total_num_envs, self.cfg.rollout
        self.staleness = StalenessManager(r.max_staleness, segments, segments)
        c = self.channels
        self.collection = Collection(
            self.staleness,
            segments,
            r.staleness_policy,
            lambda: self.collection_handles(c["weights"]),
            self.cfg.runner.timeout_s,
        )

    def restore(self, checkpoint: Path) -> dict:
        meta = self.actor.load(str(checkpoint)).wait(self.cfg.runner.timeout_s)[0]
        self.env_steps = meta["env_steps"]
        self.restore_workers(checkpoint)
        if self.collection is not None:  # collected but untrained segments were not saved
            self.staleness.restore(meta["step"])
            self.collection.consumed = meta["step"]
        return meta

    def restore_workers(self, checkpoint: Path) -> None:
        """The env and rollout state a checkpoint holds (synchronous runs then continue exactly
        as the interrupted run would have); a warning says when the resume cannot be exact."""
        workers = load_extra(checkpoint, WORKERS_FILE)
        if workers is None:
            log.warning(
                "resume is not exact: %s holds no env or rollout state (saved by an older "
                "tidal); the envs restart from their seeds",
                checkpoint,
            )
            return
        saved = {name: len(workers[name]) for name in ("env", "rollout")}
        if saved != {"env": self.env.world_size, "rollout": self.rollout.world_size}:
            log.warning(
                "resume is not exact: the checkpoint's env and rollout ranks %s differ "
                "from this run's (%d, %d); the envs restart from their seeds",
                saved,
                self.env.world_size,
                self.rollout.world_size,
            )
            return
        weights = workers["rollout"][0]["weights"]  # rank 0 keeps the stale weights for all ranks
        handles = [self.env.execute_on(r).load_state_dict(s) for r, s in enumerate(workers["env"])]
        handles += [
            self.rollout.execute_on(r).load_state_dict({**s, "weights": weights})
            for r, s in enumerate(workers["rollout"])
        ]
        timeout = self.cfg.runner.timeout_s
        results = wait_all(handles, timeout)
        if weights is not None:
            self.rollout_version = workers["rollout"][0]["version"]
        if workers["env"][0]["prefetched"]:
            self.env.prefetch_train_bootstrap(self.channels["rollout"]).wait(timeout)
        for rank, missed in enumerate(r[0] for r in results[: self.env.world_size]):
            if missed:
                log.warning(
                    "resume is not exact: env rank %d (%s) has state that is not checkpointed: %s",
                    rank,
                    self.cfg.env.id,
                    ", ".join(missed),
                )

    def checkpoint_meta(self) -> dict:
        return {"env_steps": self.env_steps}

    def should_stop(self, metrics: dict) -> bool:
        return (
            self.cfg.runner.max_env_steps is not None
            and self.env_steps >= self.cfg.runner.max_env_steps
        )

    def summarize(self) -> dict:
        solved = self.cfg.runner.target_value is not None and any(
            e.get(self.cfg.runner.target_metric) is not None
            and e[self.cfg.runner.target_metric] >= self.cfg.runner.target_value
            for _, e in self.evals
        )
        return {
            "env_steps": self.env_steps,
            "solved_at_env_steps": self.env_steps if solved else None,
        }

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

    def sync_weights(self) -> None:
        timeout = self.cfg.runner.timeout_s
        link = self.weights_link
        sent, received = wait_all(
            [self.actor.send_weights(link), self.rollout.sync_weights(link, timeout)],
            timeout,
        )
        self.rollout_version = sent[0]

    def collection_handles(self, weights_ch: Channel | None = None) -> list:
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
        returns = [r for res in env_results for r in res["returns"]]
        lengths = [n for res in env_results for n in res["lengths"]]
        self.env_steps += sum(res["env_steps"] for res in env_results)
        return {
            **_success(env_results, "rollout"),
            "rollout/return_mean": float(np.mean(returns)) if returns else None,
            "rollout/episode_length_mean": float(np.mean(lengths)) if lengths else None,
            "rollout/episodes": len(returns),
            "rollout/bootstrap_prefetched": float(
                np.mean([res["prefetched"] for res in env_results])
            ),
            "rollout/nonfinite_env_steps": sum(res["nonfinite"] for res in env_results),
        }

    def evaluate(self, step: int) -> dict:
        """The policy just trained: every eval env through one episode (``eval/*``, greedy by
        default); with ``runner.eval_sampled``, again on the same episodes with sampled actions
        (``eval_sampled/*``, what the training rollouts do)."""
        self.current_rollout_weights(step)
        metrics = self.evaluate_once(step, "eval", self.cfg.rollout.eval_deterministic)
        if self.cfg.runner.eval_sampled:
            metrics.update(self.evaluate_once(step, "eval_sampled", deterministic=False))
        return metrics

    def evaluate_once(self, step: int, prefix: str, deterministic: bool) -> dict:
        """Every eval env through one episode, in segments of at most ``EVAL_SEGMENT`` chunk
        steps (the evaluation ends with the last episode, not at the time limit); the video
        (``runner.eval_video``) is the ``eval`` pass's."""
        c, timeout = self.channels, self.cfg.runner.timeout_s
        returns, done, outcomes, videos = [], 0, [], []
        while done < self.eval_horizon:
            steps = min(EVAL_SEGMENT, self.eval_horizon - done)
            results = wait_all(
                [
                    self.env.evaluate(c["rollout"], c["env"], steps, done == 0, timeout),
                    self.rollout.generate(
                        c["rollout"], c["env"], "eval", steps, timeout, deterministic=deterministic
                    ),
                ],
                timeout,
            )[0]
            returns += [r for res in results for r in res["returns"]]
            videos += [res["video"] for res in results if res.get("video") is not None]
            outcomes += results
            done += steps
            if all(res["finished"] for res in results):
                break
        if videos and prefix == "eval":
            self.write_eval_video(step, np.concatenate(videos))
        successes = [x for res in outcomes for x in res.get("successes", [])]
        tasks = [x for res in outcomes for x in res.get("tasks", [])]
        return episode_metrics(returns, successes, tasks, prefix)

    def write_eval_video(self, step: int, frames: np.ndarray) -> None:
        runner = self.cfg.runner
        path = self.run_dir / "videos" / f"eval_step{step:06d}.{runner.eval_video_format}"
        write_video(frames, path, fps=30)
        log.info("evaluation video: %s (%d frames)", path, len(frames))

    def current_rollout_weights(self, step: int) -> None:
        """Give the rollout the weights after ``step`` steps (asynchronous runs: once the running
        collection has finished, the update already sent is taken)."""
        if self.collection is not None and self.rollout_version is not None:
            self.collection.drain()
            taken = self.rollout.take_weights(self.channels["weights"])
            self.rollout_version = taken.wait(self.cfg.runner.timeout_s)[0]
        if self.rollout_version != step:
            self.sync_weights()

    def save(self, path: Path, meta: dict) -> str:
        """The actor's checkpoint, with the env and rollout ranks' state in ``workers.pt``
        (asynchronous runs: taken between collections, with the staleness counters)."""
        timeout = self.cfg.runner.timeout_s
        if self.collection is not None:
            self.current_rollout_weights(meta["step"])
            meta = {**meta, "staleness": self.staleness.snapshot()}
        stale_weights = self.rollout_version != meta["step"]
        handles = [self.env.state_dict(), self.rollout.state_dict(stale_weights)]
        envs, rollouts = wait_all(handles, timeout)
        workers = {"env": envs, "rollout": rollouts}
        return self.actor.save(str(path), meta, {WORKERS_FILE: workers}).wait(timeout)[0]

    def train_step(self, step: int) -> dict:
        if self.collection is not None:
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
        timeout, collection = self.cfg.runner.timeout_s, self.collection
        version = self.staleness.get_version()
        with self.timer("step"):
            if self.rollout_version is None:  # a fresh or resumed run: the first weights
                self.sync_weights()
            with self.timer("wait_rollouts"):
                metrics = self.next_collected()
            with self.timer("compute_advantages"):
                handles = [self.actor.recv_trajectories(self.channels["actor"], timeout)]
                collection.wait_polling(handles)
                metrics.update(collection.wait_polling([self.actor.compute_advantages()])[0][0])
            with self.timer("train"):
                metrics.update(collection.wait_polling([self.actor.run_training()])[0][0])
            with self.timer("update_weights"):
                sent = self.actor.send_weights(self.channels["weights"])
                self.rollout_version = sent.wait(timeout)[0]
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
            item = self.collection.next()
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
        if graceful and self.collection is not None:
            steps.append(("running collection", self.collection.drain))
        if graceful and self.env is not None:
            steps.append(("env close", lambda: self.env.close().wait(self.cfg.runner.timeout_s)))
        for name, group in (
            ("env", self.env),
            ("rollout", self.rollout),
            ("actor", self.actor),
            ("reward", self.reward),
        ):
            if group is not None:
                steps.append((f"{name} group", group.shutdown))
        steps += [(f"{name} channel", ch.close) for name, ch in self.channels.items()]
        if self.cluster is not None:
            steps.append(("cluster", self.cluster.shutdown))
        return steps


def _success(results: list[dict], prefix: str) -> dict:
    """Success rates (overall, per task) of the episodes the env ranks report, if they report success."""
    successes = [x for res in results for x in res.get("successes", [])]
    tasks = [x for res in results for x in res.get("tasks", [])]
    return success_metrics(successes, tasks if len(tasks) == len(successes) else [], prefix)
