"""The off-policy embodied runner (``algorithm.name: sac``): asynchronous by construction.

The env and rollout groups collect segments (``rollout.num_steps`` chunk steps of every env)
one after another, without waiting for the actor; each segment's transitions go to the actor's
replay buffer over the actor channel. The actor updates meanwhile, paced by
``algorithm.utd_ratio`` (``Pacer`` with the ``UpdateLead`` admission: after the warm-up,
``replay.warmup_steps`` env steps of uniform actions, ``floor(utd_ratio * (E - warmup))``
updates are owed for ``E`` env steps collected, and collection waits once it leads the updates
by more than ``replay.max_lead`` env steps, ``replay/lead``). The rollout takes the weights the
actor sends every ``runner.weight_sync_interval`` updates between chunk steps. A runner step
ends when its segment is collected and the updates it owes are done. The groups, evaluation and
checkpoint state are ``EmbodiedGroups``, as for the on-policy runner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.config import EmbodiedConfig
from tidal.config.embodied import components
from tidal.data.replay import buffer_layout, fit_demos
from tidal.runners.embodied.base import EmbodiedRunLoop
from tidal.runners.embodied.groups import (
    EmbodiedGroups,
    env_steps_reached,
    env_steps_summary,
    rollout_metrics,
)
from tidal.runners.embodied.pacer import Pacer, UpdateLead
from tidal.runners.embodied.sft import collect_demos
from tidal.runners.preflight import (
    check_policy_builds,
    check_sac,
)
from tidal.runtime import Handle
from tidal.workers import EnvWorker, RolloutWorker
from tidal.workers.sac_actor import SACActor

log = logging.getLogger("tidal.train")


@dataclass
class ActorCall:
    kind: str  # "ingest" (finished segments into the buffer), then "update"
    handle: Handle
    count: int  # the updates it leads to


class OffPolicyRunner(EmbodiedRunLoop):
    def __init__(self, cfg: EmbodiedConfig, run_dir: Path | None = None):
        self.actor_call: ActorCall | None = None
        super().__init__(cfg, run_dir)

    # -- building --------------------------------------------------------------------------

    def check_offpolicy(self) -> None:
        """What needs the world (preflight's SAC checks, as ``tidal config`` runs them), then
        the scripted demonstrations ``replay.sft_demos`` asks for."""
        cfg, (obs_space, action_space) = self.cfg, self.spaces
        check_sac(cfg, self.worlds, self.spaces)
        check_policy_builds(cfg, self.spaces)
        self.sft_demos = None
        if cfg.replay.sft_demos:  # collected here, sent to the actor once it runs
            demos = collect_demos(cfg)
            log.info("replay: %d scripted demonstration transitions", len(demos.obs))
            layout = buffer_layout(
                obs_space.shape[0], (cfg.env.num_action_chunks, action_space.shape[0])
            )
            self.sft_demos = fit_demos(demos.transitions(), layout, "replay.sft_demos")

    def build(self) -> None:
        self.check_offpolicy()
        cfg, topo, spaces = self.cfg, self.topo, self.spaces
        self.cluster = self.start_cluster()  # placement asks it
        self.groups = g = EmbodiedGroups(cfg, self.run_dir, self.cluster)
        g.launch(
            self.place(components(cfg)),
            env=EnvWorker.create_group(cfg, topo),
            rollout=RolloutWorker.create_group(cfg, topo, *spaces),
            actor=SACActor.create_group(cfg, topo, *spaces),
        )
        self.env, self.rollout, self.actor, self.channels = g.env, g.rollout, g.actor, g.channels
        if self.sft_demos is not None:
            self.actor.set_demos(self.sft_demos).wait(
                cfg.runner.timeout_s
            )  # every rank samples them
        segment = cfg.env.total_num_envs * cfg.rollout.num_steps * cfg.env.num_action_chunks
        self.lead = UpdateLead(
            cfg.algorithm.utd_ratio, cfg.replay.max_lead, segment, cfg.replay.warmup_steps
        )
        self.pacer = Pacer(self.lead, self.collection_handles, cfg.runner.timeout_s)
        self.reported = 0  # segments whose step has run (collection may be ahead)
        self.update_logs: list[dict] = []
        g.sync_weights()

    def collection_handles(self) -> list[Handle]:
        """One segment of every env; the rollout takes newer weights between chunk steps."""
        c, timeout = self.channels, self.cfg.runner.timeout_s
        return [
            self.env.collect(c["rollout"], c["env"], c["actor"], timeout),
            self.rollout.generate(
                c["rollout"], c["env"], "train", timeout=timeout, weights_ch=c["weights"]
            ),
        ]

    # -- the actor's calls -----------------------------------------------------------------

    def start_actor_call(self) -> None:
        """With none in flight and updates owed: ingest every finished segment (the data the
        owed updates need), then update towards what is owed, a batch of calls at a time."""
        lead, owed = self.lead, self.lead.owed()
        if self.actor_call is not None or lead.updates >= owed:
            return
        count = min(owed - lead.updates, self.cfg.algorithm.batch_updates)
        timeout = self.cfg.runner.timeout_s
        ingest = self.actor.ingest(self.channels["actor"], lead.segments, timeout)
        self.actor_call = ActorCall("ingest", ingest, count)

    def finish_actor_call(self) -> None:
        """The call in flight, if it finished: an ingest goes on to its update; an update's
        count is done."""
        call = self.actor_call
        if call is None or not call.handle.done():
            return
        result = call.handle.wait(self.cfg.runner.timeout_s)[0]
        self.actor_call = None
        if call.kind == "update":
            self.lead.updates += call.count
            self.update_logs.append(result)
        else:
            update = self.actor.update(call.count, self.channels["weights"])
            self.actor_call = ActorCall("update", update, call.count)

    def drain(self) -> None:
        """No call in flight: the actor's (and the update an ingest leads to) finished, the
        running segment finished and ingested; none started meanwhile."""
        while self.actor_call is not None:
            self.actor_call.handle.wait(self.cfg.runner.timeout_s)
            self.finish_actor_call()
        self.pacer.drain()  # its segment is reported with the next step's
        timeout = self.cfg.runner.timeout_s
        self.actor.ingest(self.channels["actor"], self.lead.segments, timeout).wait(timeout)

    # -- the run loop's step ---------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        lead = self.lead
        start, env_steps, updates = time.perf_counter(), lead.env_steps, lead.updates
        self.reported += 1  # a step is one segment: evaluation cadence stays in env steps
        wanted = self.reported
        # the step's own segment, and the updates owed once it was collected (later segments
        # owe more, and the actor keeps working on them across the step's end)
        while lead.segments < wanted or lead.updates < lead.owed_at[wanted]:
            self.start_actor_call()
            self.pacer.advance([] if self.actor_call is None else [self.actor_call.handle])
            self.finish_actor_call()
        lead.owed_at = {k: v for k, v in lead.owed_at.items() if k > wanted}
        elapsed = max(time.perf_counter() - start, 1e-9)
        finished = [r for item in self.pacer.take_finished() for r in item.results[0]]
        metrics = rollout_metrics(finished)
        metrics.update(self.update_metrics())
        metrics.update(
            {
                "env_steps": lead.env_steps,
                "updates": lead.updates,
                "version": lead.updates,
                "replay/lead": lead.lead(),
                "env_steps_per_s": (lead.env_steps - env_steps) / elapsed,
                "updates_per_s": (lead.updates - updates) / elapsed,
                "time/step": elapsed,
            }
        )
        return metrics

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

    @property
    def env_steps(self) -> int:
        return self.lead.env_steps

    def evaluate(self, step: int) -> dict:
        """The actor's newest weights, once nothing is in flight."""
        self.drain()
        self.groups.take_sent_weights()
        self.groups.sync_weights()
        return self.groups.evaluate(step)

    def checkpoint_meta(self) -> dict:
        return {"env_steps": self.lead.env_steps}

    def should_stop(self, metrics: dict) -> bool:
        return env_steps_reached(self.cfg, self.lead.env_steps)

    def summarize(self) -> dict:
        return env_steps_summary(self.cfg, self.evals, self.lead.env_steps)

    def save(self, path: Path, meta: dict) -> str:
        self.drain()
        lead = self.lead
        meta = {**meta, "segments": lead.segments, "updates": lead.updates, "pace": list(lead.pace)}
        return self.groups.save(path, meta, stale_weights=True)

    def restore(self, checkpoint: Path) -> dict:
        meta, lead = self.groups.restore(checkpoint), self.lead
        lead.env_steps, lead.segments = meta["env_steps"], meta["segments"]
        self.reported = lead.segments  # segments collected ahead of the steps count as done
        lead.updates, lead.pace = meta["updates"], tuple(meta["pace"])
        if not meta["replay_restored"]:
            # the buffer refills with the trained policy before updates go on
            fill = max(self.cfg.replay.warmup_steps, self.cfg.replay.batch_size)
            lead.pace = (lead.updates, float(lead.env_steps + fill))
            log.warning(
                "resume is not exact: the checkpoint holds no replay buffer (replay.save false); "
                "it refills for %d env steps before updates continue",
                fill,
            )
        self.groups.sync_weights()
        return meta

    def cleanup_steps(self, graceful: bool) -> list:
        steps = []
        if graceful and self.pacer is not None and (self.pacer.running or self.actor_call):
            steps.append(("running collection", self.drain))
        return steps + (self.groups.cleanup_steps(graceful) if self.groups is not None else [])


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"
