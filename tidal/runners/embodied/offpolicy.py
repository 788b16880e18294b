"""The off-policy embodied runner (``algorithm.name: sac``): asynchronous by construction.

The env and rollout groups collect segments (``rollout.num_steps`` chunk steps of every env)
one after another, without waiting for the actor; each segment's transitions go to the actor's
replay buffer over the actor channel. The actor updates meanwhile, paced by
``algorithm.utd_ratio``: after the warm-up (``replay.warmup_steps`` env steps of uniform actions)
``U(E) = floor(utd_ratio * (E - warmup))`` updates are owed for ``E`` env steps collected, and
collection waits once it leads the updates by more than ``replay.max_lead`` env steps
(``replay/lead``). The rollout takes the weights the actor sends every
``runner.weight_sync_interval`` updates between chunk steps. A runner step ends when its
segment is collected and the updates it owes are done.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from tidal.config import ConfigError
from tidal.config.embodied import components
from tidal.config.offpolicy import SAC_POLICIES
from tidal.runners.collection import POLL_S
from tidal.runners.embodied.sft import collect_demos
from tidal.runners.embodied.train import EmbodiedRunner
from tidal.runners.embodied.train import _success as success_of
from tidal.runtime import Channel, Handle, wait_all
from tidal.workers import RolloutWorker
from tidal.workers.replay import buffer_layout, fit_demos, read_demos
from tidal.workers.rollout_worker import make_policy
from tidal.workers.sac_actor import SACActorWorker
from tidal.workers.sac_env import TransitionEnvWorker

log = logging.getLogger("tidal.train")


class OffPolicyRunner(EmbodiedRunner):
    asynchronous = False  # the base's on-policy asynchrony (staleness manager) is not used

    # -- building --------------------------------------------------------------------------

    def check_offpolicy(self) -> None:
        """What needs the world: a continuous action space, one actor rank, the demo file."""
        _, action_space = self.spaces
        if not isinstance(action_space, gym.spaces.Box):
            raise ConfigError(
                f"algorithm.name: sac needs a continuous (Box) action space; {self.cfg.env.id} "
                f"has {action_space} (use algorithm.name ppo)"
            )
        self.check_actor_ranks()
        if self.cfg.model.name not in SAC_POLICIES:
            raise ConfigError(
                f"model.name: algorithm.name sac needs one of {', '.join(SAC_POLICIES)}, got "
                f"{self.cfg.model.name!r}"
            )
        with torch.random.fork_rng():  # built to be checked only: the workers' seeds unchanged
            try:
                make_policy(self.cfg, *self.spaces)
            except ValueError as exc:  # e.g. sac_cnn without pixels
                raise ConfigError(str(exc)) from None
        obs_dim, chunks = self.spaces[0].shape[0], self.cfg.env.num_action_chunks
        layout = buffer_layout(obs_dim, (chunks, action_space.shape[0]))
        demo = self.cfg.replay.demo_path
        if demo is not None:  # its shapes, before any worker starts
            read_demos(demo, layout)
        self.sft_demos = None
        if self.cfg.replay.sft_demos:  # collected here, sent to the actor once it runs
            demos = collect_demos(self.cfg)
            log.info("replay: %d scripted demonstration transitions", len(demos.obs))
            self.sft_demos = fit_demos(demos.transitions(), layout, "replay.sft_demos")

    def check_actor_ranks(self) -> None:
        """Several actor ranks train data-parallel, each on the transitions of its own envs."""
        ranks, cfg = self.worlds["actor"], self.cfg
        if ranks == 1:
            return
        if cfg.replay.batch_size % ranks:
            raise ConfigError(
                f"replay.batch_size: {cfg.replay.batch_size} must divide evenly over {ranks} "
                "actor ranks (each samples its share from its own buffer)"
            )
        stage_envs = self.topo.total_num_envs // (self.worlds["env"] * self.topo.stages)
        if stage_envs % ranks:  # each samples the same share: its envs must be as many
            raise ConfigError(
                f"env.total_num_envs: each actor rank's buffer is fed by its own envs, and "
                f"each rank samples an equal share of every minibatch; {stage_envs} env(s) "
                f"per env rank and pipeline stage do not divide evenly over {ranks} actor ranks"
            )

    def build(self) -> None:
        self.check_offpolicy()
        cfg, spaces, timeout = self.cfg, self.spaces, self.cfg.runner.timeout_s
        self.cluster = self.start_cluster()
        placement = self.place(components(cfg))
        self.env = TransitionEnvWorker.create_group(cfg, self.topo).launch(
            self.cluster, placement, name="env"
        )
        self.rollout = RolloutWorker.create_group(cfg, self.topo, *spaces).launch(
            self.cluster, placement, name="rollout"
        )
        self.actor = SACActorWorker.create_group(cfg, self.topo, *spaces).launch(
            self.cluster, placement, name="actor"
        )
        if self.sft_demos is not None:
            self.actor.set_demos(self.sft_demos).wait(timeout)  # every rank samples them
        run_id = f"{cfg.runner.experiment}-{uuid.uuid4().hex[:6]}"
        self.channels = {
            name: Channel.create(f"{run_id}-{name}", self.cluster, consumer=reader)
            for name, reader in self.channel_readers().items()
        }
        self.weights_link = self.channels["weights"]  # the rollout takes them between steps
        self.eval_horizon = self.env.execute_on(0).eval_horizon().wait(timeout)[0]
        self.segments = 0  # segments collected (and finished)
        self.reported = 0  # segments whose step has run (collection may be ahead)
        self.owed_at: dict[int, int] = {}  # segment -> the updates owed once it was collected
        self.updates = 0
        self.pace = (0, float(cfg.replay.warmup_steps))  # U0, start: U(E) = U0 + utd * (E - start)
        self.running: list[Handle] | None = None
        self.actor_call: tuple[str, Handle, int] | None = None
        self.finished: list[dict] = []  # env results of segments not yet reported
        self.update_logs: list[dict] = []
        self.sync_weights()

    def channel_readers(self) -> dict:
        return {
            "env": self.env,
            "rollout": self.rollout,
            "actor": self.actor,
            "weights": self.rollout,
        }

    # -- pacing ----------------------------------------------------------------------------

    def owed_updates(self, env_steps: int) -> int:
        base, start = self.pace
        return base + max(0, math.floor(self.cfg.algorithm.utd_ratio * (env_steps - start)))

    def lead(self) -> float:
        """Env steps collected beyond what the updates done have consumed, in owed updates: 0
        once they caught up (a fractional ``utd_ratio`` leaves a remainder below one update's
        worth of env steps, which must not hold collection back for good)."""
        return (self.owed_updates(self.env_steps) - self.updates) / self.cfg.algorithm.utd_ratio

    def poll_collection(self) -> bool:
        """Take a finished segment, admit the next within the lead; whether anything moved."""
        moved = False
        if self.running is not None and all(h.done() for h in self.running):
            self.take_segment()
            moved = True
        nominal = self.cfg.env.total_num_envs * self.cfg.rollout.num_steps
        nominal *= self.cfg.env.num_action_chunks
        if self.running is None and self.lead() <= self.cfg.replay.max_lead - nominal:
            c, timeout = self.channels, self.cfg.runner.timeout_s
            self.running = [
                self.env.collect(c["rollout"], c["env"], c["actor"], timeout),
                self.rollout.generate(
                    c["rollout"], c["env"], "train", timeout=timeout, weights_ch=c["weights"]
                ),
            ]
            moved = True
        return moved

    def take_segment(self) -> None:
        results = wait_all(self.running, self.cfg.runner.timeout_s)[0]
        self.running = None
        self.segments += 1
        self.env_steps += sum(r["env_steps"] for r in results)
        self.owed_at[self.segments] = self.owed_updates(self.env_steps)
        self.finished += results

    def poll_actor(self, target: int) -> bool:
        """Ingest then update towards ``target`` updates, a call at a time."""
        if self.actor_call is not None:
            kind, handle, count = self.actor_call
            if not handle.done():
                return False
            result = handle.wait(self.cfg.runner.timeout_s)[0]
            self.actor_call = None
            if kind == "update":
                self.updates += count
                self.update_logs.append(result)
                return True
            if count:  # ingested: now update
                update = self.actor.update(count, self.channels["weights"])
                self.actor_call = ("update", update, count)
            return True
        if self.updates >= target:
            return False
        count = min(target - self.updates, self.cfg.algorithm.batch_updates)
        # the data these updates need is collected; the actor takes every finished segment
        timeout = self.cfg.runner.timeout_s
        ingest = self.actor.ingest(self.channels["actor"], self.segments, timeout)
        self.actor_call = ("ingest", ingest, count)
        return True

    def wait_actor(self) -> None:
        """The actor's call in flight (and the update an ingest leads to) finished; a call that
        moves on no further within ``runner.timeout_s`` is named, never waited on for ever."""
        timeout = self.cfg.runner.timeout_s
        last_move = time.monotonic()
        while self.actor_call is not None:
            if self.poll_actor(self.updates):
                last_move = time.monotonic()
            elif time.monotonic() - last_move > timeout:
                kind, _, count = self.actor_call
                raise TimeoutError(
                    f"sac: the actor group's {kind} of {count} update(s) did not finish within "
                    f"runner.timeout_s ({timeout} s)"
                )
            time.sleep(POLL_S)

    def drain(self) -> None:
        """No call in flight: the running segment finished and ingested, the actor idle."""
        self.wait_actor()
        if self.running is not None:
            self.take_segment()
        self.actor.ingest(self.channels["actor"], self.segments, self.cfg.runner.timeout_s).wait(
            self.cfg.runner.timeout_s
        )

    # -- the run loop's step ---------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        start, env_steps, updates = time.perf_counter(), self.env_steps, self.updates
        timeout = self.cfg.runner.timeout_s
        self.reported += 1  # a step is one segment: evaluation cadence stays in env steps
        wanted, last_move = self.reported, start
        # the step's own segment, and the updates owed once it was collected (later segments
        # owe more, and the actor keeps working on them across the step's end)
        while self.segments < wanted or self.updates < self.owed_at[wanted]:
            moved = self.poll_collection()
            moved |= self.poll_actor(self.owed_updates(self.env_steps))
            now = time.perf_counter()
            if moved:
                last_move = now
            elif now - last_move > timeout:
                raise TimeoutError(
                    f"sac step {step}: no progress in runner.timeout_s ({timeout} s): "
                    f"{self.segments} segments, {self.updates} updates"
                )
            else:
                time.sleep(POLL_S)
        self.owed_at = {k: v for k, v in self.owed_at.items() if k > wanted}
        elapsed = max(time.perf_counter() - start, 1e-9)
        metrics = self.rollout_metrics_of(self.finished)
        self.finished = []
        metrics.update(self.update_metrics())
        metrics.update(
            {
                "env_steps": self.env_steps,
                "updates": self.updates,
                "version": self.updates,
                "replay/lead": self.lead(),
                "env_steps_per_s": (self.env_steps - env_steps) / elapsed,
                "updates_per_s": (self.updates - updates) / elapsed,
                "time/step": elapsed,
            }
        )
        return metrics

    def rollout_metrics_of(self, results: list[dict]) -> dict:
        """The episodes the env ranks finished in this step's segments."""
        returns = [r for res in results for r in res["returns"]]
        lengths = [n for res in results for n in res["lengths"]]
        return {
            **success_of(results, "rollout"),
            "rollout/return_mean": float(np.mean(returns)) if returns else None,
            "rollout/episode_length_mean": float(np.mean(lengths)) if lengths else None,
            "rollout/episodes": len(returns),
            "rollout/nonfinite_env_steps": sum(res["nonfinite"] for res in results),
        }

    def update_metrics(self) -> dict:
        logs, self.update_logs = self.update_logs, []
        if not logs:
            return {}
        total = sum(r["count"] for r in logs)
        out = {}
        for key in {k for r in logs for k in r if k.startswith("train/") and k != "train/alpha"}:
            rows = [(r[key], r["count"]) for r in logs if key in r]
            out[key] = sum(v * n for v, n in rows) / max(sum(n for _, n in rows), 1)
        out["train/alpha"] = logs[-1]["train/alpha"]
        out["train/skipped_updates"] = logs[-1]["train/skipped_updates"]
        out["replay/size"] = logs[-1]["replay/size"]
        out["train/updates_this_step"] = total
        return out

    def progress_info(self, m: dict) -> str:
        return (
            f"env_steps {m['env_steps']} updates {m['updates']} return "
            f"{_fmt(m.get('rollout/return_mean'))} eval {_fmt(m.get('eval/return_mean'))} "
            f"q {_fmt(m.get('train/q_mean'))} alpha {_fmt(m.get('train/alpha'))} "
            f"lead {m['replay/lead']:.0f} {m['env_steps_per_s']:.0f} steps/s "
            f"{m['updates_per_s']:.0f} updates/s"
        )

    # -- evaluation and checkpoints ----------------------------------------------------------

    def current_rollout_weights(self, step: int) -> None:
        """The rollout gets the actor's newest weights once nothing is in flight."""
        self.drain()
        timeout = self.cfg.runner.timeout_s
        self.rollout.take_weights(self.channels["weights"]).wait(timeout)
        self.sync_weights()

    def save(self, path: Path, meta: dict) -> str:
        self.drain()
        timeout = self.cfg.runner.timeout_s
        envs, rollouts = wait_all([self.env.state_dict(), self.rollout.state_dict(True)], timeout)
        meta = {
            **meta,
            "segments": self.segments,
            "updates": self.updates,
            "pace": list(self.pace),
        }
        extra = {"workers.pt": {"env": envs, "rollout": rollouts}}
        return self.actor.save(str(path), meta, extra).wait(timeout)[0]

    def restore(self, checkpoint: Path) -> dict:
        meta = self.actor.load(str(checkpoint)).wait(self.cfg.runner.timeout_s)[0]
        self.env_steps, self.segments = meta["env_steps"], meta["segments"]
        self.reported = self.segments  # segments collected ahead of the steps count as done
        self.updates, self.pace = meta["updates"], tuple(meta["pace"])
        self.restore_workers(checkpoint)
        if not meta["replay_restored"]:
            # the buffer refills with the trained policy before updates go on
            fill = max(self.cfg.replay.warmup_steps, self.cfg.replay.batch_size)
            self.pace = (self.updates, float(self.env_steps + fill))
            log.warning(
                "resume is not exact: the checkpoint holds no replay buffer (replay.save false); "
                "it refills for %d env steps before updates continue",
                fill,
            )
        self.sync_weights()
        return meta

    def cleanup_steps(self, graceful: bool) -> list:
        steps = []
        if graceful and (self.running is not None or self.actor_call is not None):
            steps.append(("running collection", self.drain))
        return steps + super().cleanup_steps(graceful)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"
