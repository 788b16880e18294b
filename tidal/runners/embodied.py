"""The embodied training loop: sync weights → generate rollouts (env, rollout, reward and actor
groups over channels) → advantages → train → evaluate / checkpoint / log."""

from __future__ import annotations

import logging
import math
import time
import uuid
from pathlib import Path

import numpy as np

from tidal.config import EmbodiedConfig, to_yaml, validate_embodied
from tidal.envs import make_env
from tidal.metrics import MetricLogger, Timer, attach_file_log
from tidal.runtime import Channel, Cluster, wait_all
from tidal.workers import ActorWorker, EnvWorker, RewardWorker, RolloutWorker, Topology

log = logging.getLogger("tidal.train")
EVAL_SEGMENT = 32  # chunk steps per evaluation call: a few wasted steps against a group call each


class EmbodiedRunner:
    def __init__(self, cfg: EmbodiedConfig):
        self.cfg = cfg
        worlds = validate_embodied(cfg)
        env = cfg.env
        self.topo = Topology(env=worlds["env"], rollout=worlds["rollout"], actor=worlds["actor"],
                             stages=env.pipeline_stage_num, total_num_envs=env.total_num_envs,
                             eval_num_envs=env.eval_num_envs, reward=worlds.get("reward", 0))
        probe = make_env(env.adapter, 1, env_id=env.id, vectorization_mode="sync",
                         max_episode_steps=env.max_episode_steps, env_kwargs=dict(env.kwargs), **dict(env.adapter_kwargs))
        spaces = (probe.observation_space, probe.action_space)
        max_episode_steps = probe.max_episode_steps
        probe.close()

        self.run_dir = _run_folder(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self._log_handler = attach_file_log(self.run_dir / "train.log")
        self.timer = Timer()

        self.cluster = Cluster(cfg.cluster.backend, address=cfg.cluster.address,
                               devices_per_node=cfg.cluster.devices_per_node)
        components = ["env", "rollout", "actor"] + (["reward"] if cfg.reward.enabled else [])
        placement = self.cluster.placement(cfg.cluster.resolved_placement(components))
        self.env = EnvWorker.create_group(cfg, self.topo).launch(self.cluster, placement, name="env")
        self.rollout = RolloutWorker.create_group(cfg, self.topo, *spaces).launch(self.cluster, placement, name="rollout")
        self.actor = ActorWorker.create_group(cfg, self.topo, *spaces, max_episode_steps).launch(
            self.cluster, placement, name="actor")
        self.reward = (RewardWorker.create_group(cfg, self.topo).launch(self.cluster, placement, name="reward")
                       if cfg.reward.enabled else None)
        run_id = f"{cfg.runner.experiment}-{uuid.uuid4().hex[:6]}"
        self.channels = {name: Channel.create(f"{run_id}-{name}", self.cluster)
                         for name in ("env", "rollout", "actor", "weights", "reward")}
        self.eval_horizon = self.env.execute_on(0).eval_horizon().wait(cfg.runner.timeout_s)[0]
        self.start_step, self.env_steps, self.rollout_version = 0, 0, None
        if cfg.runner.resume_from:
            meta = self.actor.load(cfg.runner.resume_from).wait(cfg.runner.timeout_s)[0]
            self.start_step, self.env_steps = meta["step"], meta["env_steps"]
            log.info("resumed from %s at step %d", cfg.runner.resume_from, self.start_step)
        self.logger = MetricLogger(self.run_dir)

    # -- phases ----------------------------------------------------------------------------

    def sync_weights(self) -> None:
        timeout = self.cfg.runner.timeout_s
        ch = self.channels["weights"]
        sent, received = wait_all([self.actor.execute_on(0).send_weights(ch), self.rollout.sync_weights(ch, timeout)], timeout)
        self.rollout_version = sent[0]

    def generate_rollouts(self) -> dict:
        c, timeout = self.channels, self.cfg.runner.timeout_s
        handles = [
            self.env.interact(c["rollout"], c["env"], c["actor"], c["reward"] if self.reward else None, timeout),
            self.rollout.generate(c["rollout"], c["env"], "train", timeout=timeout),
            self.actor.recv_trajectories(c["actor"], timeout),
        ]
        if self.reward is not None:
            handles.append(self.reward.compute_rewards(c["reward"], c["env"], timeout))
        env_results = wait_all(handles, timeout)[0]
        returns = [r for res in env_results for r in res["returns"]]
        lengths = [n for res in env_results for n in res["lengths"]]
        self.env_steps += sum(res["env_steps"] for res in env_results)
        return {
            "rollout/return_mean": float(np.mean(returns)) if returns else None,
            "rollout/episode_length_mean": float(np.mean(lengths)) if lengths else None,
            "rollout/episodes": len(returns),
            "rollout/bootstrap_prefetched": float(np.mean([res["prefetched"] for res in env_results])),
        }

    def evaluate(self) -> dict:
        """Every eval env through one episode, in segments of at most ``EVAL_SEGMENT`` chunk
        steps: the evaluation ends with the last episode, not at the time limit."""
        c, timeout = self.channels, self.cfg.runner.timeout_s
        returns, done = [], 0
        while done < self.eval_horizon:
            steps = min(EVAL_SEGMENT, self.eval_horizon - done)
            results = wait_all([self.env.evaluate(c["rollout"], c["env"], steps, done == 0, timeout),
                                self.rollout.generate(c["rollout"], c["env"], "eval", steps, timeout)], timeout)[0]
            returns += [r for res in results for r in res["returns"]]
            done += steps
            if all(res["finished"] for res in results):
                break
        return {"eval/return_mean": float(np.mean(returns)) if returns else None,
                "eval/return_std": float(np.std(returns)) if returns else None, "eval/episodes": len(returns)}

    def save(self, step: int) -> str:
        path = self.run_dir / "checkpoints" / f"step_{step:06d}"
        meta = {"step": step, "env_steps": self.env_steps}
        return self.actor.save(str(path), meta).wait(self.cfg.runner.timeout_s)[0]

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict:
        r = self.cfg.runner
        progress = _Progress(r.max_steps, self.start_step, enabled=r.progress)
        summary: dict = {"best_eval_return": None, "solved_at_env_steps": None}
        start_time, step = time.perf_counter(), self.start_step
        try:
            for step in range(self.start_step, r.max_steps):
                metrics = self._train_step(step)
                if r.eval_interval and ((step + 1) % r.eval_interval == 0 or step + 1 == r.max_steps):
                    if self.rollout_version != step + 1:
                        self.sync_weights()  # evaluate the policy just trained
                    metrics.update(self.evaluate())
                metrics["time/elapsed"] = time.perf_counter() - start_time
                self.logger.log(step, metrics)
                log.info(_summary_line(step, metrics))
                progress.update(step, metrics)
                if r.save_interval and (step + 1) % r.save_interval == 0:
                    self.save(step + 1)
                ev = metrics.get("eval/return_mean")
                if ev is not None:
                    summary["best_eval_return"] = max(ev, summary["best_eval_return"] or -math.inf)
                    if r.target_eval_return is not None and ev >= r.target_eval_return:
                        summary["solved_at_env_steps"] = self.env_steps
                        break
                if r.max_env_steps is not None and self.env_steps >= r.max_env_steps:
                    break
            summary["checkpoint"] = self.save(step + 1)
        finally:
            progress.close()
        summary.update(steps=step + 1, env_steps=self.env_steps, wall_time=time.perf_counter() - start_time,
                       run_dir=str(self.run_dir))
        return summary

    def _train_step(self, step: int) -> dict:
        timeout = self.cfg.runner.timeout_s
        with self.timer("step"):
            with self.timer("sync_weights"):
                if step % self.cfg.runner.weight_sync_interval == 0 or self.rollout_version is None:
                    self.sync_weights()
            with self.timer("generate_rollouts"):
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

    def env_steps_this_step(self, metrics: dict) -> float:
        per_step = self.cfg.env.total_num_envs * self.cfg.rollout.num_steps * self.cfg.env.num_action_chunks
        return per_step / max(metrics.get("time/step", 1e-9), 1e-9)

    def close(self) -> None:
        self.logger.close()
        self.env.close().wait(self.cfg.runner.timeout_s)
        for group in (self.env, self.rollout, self.actor, self.reward):
            if group is not None:
                group.shutdown()
        for ch in self.channels.values():
            ch.close()
        self.cluster.shutdown()
        logging.getLogger("tidal").removeHandler(self._log_handler)
        self._log_handler.close()


def _run_folder(cfg: EmbodiedConfig) -> Path:
    """A resumed run continues in the folder that holds its checkpoint; a new run gets
    ``run_dir/experiment``, suffixed ``-2``, ``-3``, ... when that exists already."""
    if cfg.runner.resume_from:
        from tidal.checkpoint import resolve_checkpoint

        return resolve_checkpoint(cfg.runner.resume_from).parent.parent
    base = Path(cfg.runner.run_dir) / cfg.runner.experiment
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _summary_line(step: int, m: dict) -> str:
    return (f"step {step + 1} env_steps {m['env_steps']} return {_fmt(m.get('rollout/return_mean'))} "
            f"eval {_fmt(m.get('eval/return_mean'))} loss {m.get('train/policy_loss', 0):.4f} "
            f"v_loss {m.get('train/value_loss', 0):.4f} kl {m.get('train/approx_kl', 0):.4f} "
            f"{m['env_steps_per_s']:.0f} steps/s")


class _Progress:
    """Live progress (step, env steps, return, steps/s, ETA) on a terminal; a line per step otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled, self.total, self.start = enabled, total, start
        self.live = None
        self.t0 = time.perf_counter()
        if enabled and self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.live = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
            self.task = self.live.add_task("train", total=total, completed=start, info="")
            self.live.start()

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        info = (f"env steps {m['env_steps']}  return {_fmt(m.get('rollout/return_mean'))}  "
                f"eval {_fmt(m.get('eval/return_mean'))}  {m['env_steps_per_s']:.0f} steps/s")
        if self.live is not None:
            self.live.update(self.task, completed=step + 1, info=info)
        else:
            done = step + 1 - self.start
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step - 1)
            self.console.print(f"step {step + 1}/{self.total}  {info}  ETA {eta:.0f}s", highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
