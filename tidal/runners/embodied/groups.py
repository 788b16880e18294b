"""What every embodied runner does with its worker groups, whatever its algorithm: launch them
(env, rollout, actor, optional reward) with their channels and the weights link, move weights
to the rollout, evaluate through the env and rollout ranks, save and restore the env and rollout
state beside the actor's checkpoint, report the episodes a collection finished, and close.

An algorithm's runner (``runners/embodied/select.py``) holds one ``EmbodiedGroups`` and adds its
own step: which worker classes, how collection and training alternate or overlap
(``runners/embodied/pacer.py``), and its counters."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np

from tidal.checkpoint import load_extra
from tidal.config import EmbodiedConfig
from tidal.envs import episode_metrics, success_metrics
from tidal.envs.video import write_video
from tidal.runners.preflight import check_embodied
from tidal.runtime import Channel, wait_all
from tidal.runtime.weight_sync import open_weight_link
from tidal.workers import Topology

log = logging.getLogger("tidal.train")
WORKERS_FILE = "workers.pt"  # the env and rollout ranks' state, next to the actor's files
EVAL_SEGMENT = 32  # chunk steps per evaluation call: a few wasted steps against a group call each


def plan_groups(cfg: EmbodiedConfig) -> tuple[dict[str, int], Topology]:
    """The ranks of each group (the config checked before anything starts) and the routes
    between them."""
    worlds, env = check_embodied(cfg), cfg.env
    topology = Topology(
        env=worlds["env"],
        rollout=worlds["rollout"],
        actor=worlds["actor"],
        stages=env.pipeline_stage_num,
        total_num_envs=env.total_num_envs,
        eval_num_envs=env.eval_num_envs,
        reward=worlds.get("reward", 0),
    )
    return worlds, topology


class EmbodiedGroups:
    def __init__(self, cfg: EmbodiedConfig, run_dir: Path, cluster):
        self.cfg, self.run_dir, self.cluster = cfg, run_dir, cluster
        self.env = self.rollout = self.actor = self.reward = None
        self.channels: dict[str, Channel] = {}
        self.rollout_version: int | None = None  # of the weights the rollout holds
        self.timeout = cfg.runner.timeout_s

    def launch(self, placement, env, rollout, actor, reward=None) -> None:
        """Start the groups (each a ``Worker.create_group``), in this order, then their channels
        and the weights link."""
        for name, group in (("env", env), ("rollout", rollout), ("actor", actor)):
            setattr(self, name, group.launch(self.cluster, placement, name=name))
        if reward is not None:
            self.reward = reward.launch(self.cluster, placement, name="reward")
        run_id = f"{self.cfg.runner.experiment}-{uuid.uuid4().hex[:6]}"
        self.channels = {
            name: Channel.create(f"{run_id}-{name}", self.cluster, consumer=reader)
            for name, reader in self.channel_readers().items()
        }
        self.weights_link = self.open_weights_link(run_id)
        self.eval_horizon = self.env.execute_on(0).eval_horizon().wait(self.timeout)[0]

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
            self.timeout,
            bucket_mb=r.weight_sync_bucket_mb,
            device=self.cfg.cluster.device,
            folder=str(self.run_dir / "rollout_weights"),
        )

    # -- weights ---------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """The actor's weights to every rollout rank, waited for."""
        link = self.weights_link
        sent, _ = wait_all(
            [self.actor.send_weights(link), self.rollout.sync_weights(link, self.timeout)],
            self.timeout,
        )
        self.rollout_version = sent[0]

    def take_sent_weights(self) -> None:
        """The rollout loads the newest update waiting on the weights channel (one the actor
        sent while collection ran), if any."""
        taken = self.rollout.take_weights(self.channels["weights"])
        self.rollout_version = taken.wait(self.timeout)[0]

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict:
        """The rollout's policy: every eval env through one episode (``eval/*``, greedy by
        default); with ``runner.eval_sampled``, again on the same episodes with sampled actions
        (``eval_sampled/*``, what the training rollouts do)."""
        metrics = self.evaluate_once(step, "eval", self.cfg.rollout.eval_deterministic)
        if self.cfg.runner.eval_sampled:
            metrics.update(self.evaluate_once(step, "eval_sampled", deterministic=False))
        return metrics

    def evaluate_once(self, step: int, prefix: str, deterministic: bool) -> dict:
        """Every eval env through one episode, in segments of at most ``EVAL_SEGMENT`` chunk
        steps (the evaluation ends with the last episode, not at the time limit); the video
        (``runner.eval_video``) is the ``eval`` pass's."""
        c, timeout = self.channels, self.timeout
        done, outcomes = 0, []
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
            outcomes += results
            done += steps
            if all(res["finished"] for res in results):
                break
        videos = [res["video"] for res in outcomes if res.get("video") is not None]
        if videos and prefix == "eval":
            self.write_eval_video(step, np.concatenate(videos))
        returns, successes, tasks = (
            [x for res in outcomes for x in res.get(key, [])]
            for key in ("returns", "successes", "tasks")
        )
        return episode_metrics(returns, successes, tasks, prefix)

    def write_eval_video(self, step: int, frames: np.ndarray) -> None:
        runner = self.cfg.runner
        path = self.run_dir / "videos" / f"eval_step{step:06d}.{runner.eval_video_format}"
        write_video(frames, path, fps=30)
        log.info("evaluation video: %s (%d frames)", path, len(frames))

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, path: Path, meta: dict, stale_weights: bool) -> str:
        """The actor's checkpoint, with the env and rollout ranks' state in ``workers.pt``
        (``stale_weights``: the rollout keeps weights older than the actor's)."""
        handles = [self.env.state_dict(), self.rollout.state_dict(stale_weights)]
        envs, rollouts = wait_all(handles, self.timeout)
        workers = {"env": envs, "rollout": rollouts}
        return self.actor.save(str(path), meta, {WORKERS_FILE: workers}).wait(self.timeout)[0]

    def restore(self, checkpoint: Path) -> dict:
        """The actor's state, then the env and rollout ranks'; the checkpoint's meta."""
        meta = self.actor.load(str(checkpoint)).wait(self.timeout)[0]
        self.restore_workers(checkpoint)
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
        results = wait_all(handles, self.timeout)
        if weights is not None:
            self.rollout_version = workers["rollout"][0]["version"]
        if workers["env"][0].get("prefetched"):
            self.env.prefetch_train_bootstrap(self.channels["rollout"]).wait(self.timeout)
        for rank, missed in enumerate(r[0] for r in results[: self.env.world_size]):
            if missed:
                log.warning(
                    "resume is not exact: env rank %d (%s) has state that is not checkpointed: %s",
                    rank,
                    self.cfg.env.id,
                    ", ".join(missed),
                )

    # -- closing ---------------------------------------------------------------------------

    def cleanup_steps(self, graceful: bool) -> list:
        """Close the envs (graceful only), shut down the groups, the channels, the cluster."""
        steps = []
        if graceful and self.env is not None:
            steps.append(("env close", lambda: self.env.close().wait(self.timeout)))
        for name in ("env", "rollout", "actor", "reward"):
            group = getattr(self, name)
            if group is not None:
                steps.append((f"{name} group", group.shutdown))
        steps += [(f"{name} channel", ch.close) for name, ch in self.channels.items()]
        if self.cluster is not None:
            steps.append(("cluster", self.cluster.shutdown))
        return steps


def rollout_metrics(env_results: list[dict]) -> dict:
    """What the env ranks report of the episodes their collections finished (``rollout/*``);
    ``bootstrap_prefetched`` where they prefetch (on-policy epochs)."""
    returns = [r for res in env_results for r in res["returns"]]
    lengths = [n for res in env_results for n in res["lengths"]]
    metrics = {
        **_success(env_results, "rollout"),
        "rollout/return_mean": float(np.mean(returns)) if returns else None,
        "rollout/episode_length_mean": float(np.mean(lengths)) if lengths else None,
        "rollout/episodes": len(returns),
    }
    if env_results and "prefetched" in env_results[0]:
        metrics["rollout/bootstrap_prefetched"] = float(
            np.mean([res["prefetched"] for res in env_results])
        )
    metrics["rollout/nonfinite_env_steps"] = sum(res["nonfinite"] for res in env_results)
    return metrics


def _success(results: list[dict], prefix: str) -> dict:
    """Success rates (overall, per task) of the episodes the env ranks report, if they do."""
    successes = [x for res in results for x in res.get("successes", [])]
    tasks = [x for res in results for x in res.get("tasks", [])]
    return success_metrics(successes, tasks if len(tasks) == len(successes) else [], prefix)


def env_steps_reached(cfg: EmbodiedConfig, env_steps: int) -> bool:
    """``runner.max_env_steps``, the embodied runners' own stop rule."""
    return cfg.runner.max_env_steps is not None and env_steps >= cfg.runner.max_env_steps


def env_steps_summary(cfg: EmbodiedConfig, evals: list[tuple[int, dict]], env_steps: int) -> dict:
    """The env steps of the run, and at which it was solved (``runner.target_value``)."""
    metric, target = cfg.runner.target_metric, cfg.runner.target_value
    solved = target is not None and any(
        e.get(metric) is not None and e[metric] >= target for _, e in evals
    )
    return {"env_steps": env_steps, "solved_at_env_steps": env_steps if solved else None}
