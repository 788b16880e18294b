"""The asynchronous training loop for language agents:

prepare batch (episodes keep flowing, bounded by staleness) → proximal / reference logp →
advantages → update → pause → update weights → set version → resume → evaluate / save.
With ``rollout.max_staleness = 0`` it is exactly synchronous RL.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.asynchrony import StalenessManager
from tidal.config.llm import LLMConfig
from tidal.data import LLMBatch
from tidal.inference import InferenceClient
from tidal.models.llm import load_tokenizer
from tidal.rollout.dispatcher import EpisodeError, RolloutDispatcher
from tidal.rollout.evaluation import greedy_config
from tidal.rollout.servers import ROLLOUT_SERVERS
from tidal.rollout.workflows import WORKFLOWS, WorkflowContext, as_workflow, has_reward_spread
from tidal.runners.llm.common import (
    data_cache,
    eval_records,
    evaluator,
    generation_config,
    train_records,
)
from tidal.runners.llm.preflight import check_llm, check_llm_model
from tidal.runners.llm.workflows import workflow_name
from tidal.runners.loop import RunLoop
from tidal.runners.preflight import check_trainer_checkpoint, import_object
from tidal.workers.llm_actor import LLMActor

log = logging.getLogger("tidal.train")


class LLMRunner(RunLoop):
    initial_evaluation = True

    def __init__(self, cfg: LLMConfig, run_dir: Path | None = None):
        check_llm(cfg)
        check_llm_model(cfg)
        self.cluster = self.rollout = self.actor = self.client = self.dispatcher = None
        self.workflow = None
        self.staleness: StalenessManager | None = None
        super().__init__(cfg, run_dir)

    # -- what the run loop asks of a runner ------------------------------------------------

    def check_checkpoint(self, checkpoint: Path) -> None:
        check_trainer_checkpoint(self.cfg, checkpoint)

    def build(self) -> None:
        cfg, r = self.cfg, self.cfg.rollout
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.cluster = self.start_cluster()
        placement = self.place(["rollout", "actor"])
        self.rollout = ROLLOUT_SERVERS.get(r.engine)(cfg, self.cluster, placement, self.run_dir)
        addresses = self.rollout.launch()
        self.actor = LLMActor.create_group(cfg).launch(
            self.cluster, placement.devices("actor"), name="actor"
        )
        self.client = InferenceClient(addresses, protocol=self.rollout.protocol())
        self.gconfig = generation_config(cfg, self.tokenizer)
        self.staleness = StalenessManager(r.max_staleness, r.batch_size, r.max_concurrent_rollouts)
        with data_cache(cfg, self.run_dir) as cache:
            self.train_data, self.eval_data = train_records(cfg, cache), eval_records(cfg, cache)
        self.workflow = self._workflow()
        self.dispatcher = RolloutDispatcher(
            self.workflow,
            self.staleness,
            should_accept=has_reward_spread if cfg.rollout.dynamic_sampling else None,
            sampling_seed=cfg.runner.seed if self.rollout.seeds_requests else None,
        )
        self.evaluator = None  # the reward's evaluation, built when the workflow has none

    def restore(self, checkpoint: Path) -> dict:
        meta = self.actor.load(str(checkpoint)).wait(self.cfg.runner.timeout_s)[0]
        self.staleness.restore(meta["version"])
        if "data" in meta:  # older checkpoints start the data over
            self.train_data.load_state_dict(meta["data"])
        self.dispatcher.stream_offset = self.train_data.read  # the episodes' sampling seeds
        self._update_weights()
        return meta

    def checkpoint_meta(self) -> dict:
        # records read ahead (queued or in flight at the save) are read again after a resume
        data = self.train_data.state_dict(unread=self.dispatcher.inputs_to_reread())
        return {"data": data, "staleness": self.staleness.snapshot()}

    def progress_info(self, m: dict) -> str:
        evals = {k: round(v, 3) for k, v in m.items() if k.startswith("eval/")}
        return (
            f"reward {m['rollout/reward_mean']:.3f} {evals or ''} staleness {m['staleness/mean']:.2f} "
            f"{m['time/step']:.2f}s/step"
        )

    def _workflow(self):
        name = workflow_name(self.cfg)
        ctx = WorkflowContext(
            self.cfg, self.client, self.tokenizer, self.gconfig, self.train_data, self.eval_data
        )
        if ":" in name:  # a user's workflow: module.path:factory(ctx) -> Workflow | async fn
            factory = import_object(name, "rollout.workflow")
            return as_workflow(factory(ctx), f"rollout.workflow {name!r}")
        return WORKFLOWS.get(name)(ctx)

    @property
    def version(self) -> int:
        """The weights' version: what the servers generate with, kept by the staleness manager
        (the run's one owner of it)."""
        return self.staleness.get_version()

    def _run(self, coro, timeout: float | None = None):
        """Run a coroutine on the dispatcher's event loop (where the client lives)."""
        return self.dispatcher.run_coroutine(coro, timeout or self.cfg.runner.timeout_s)

    # -- phases ----------------------------------------------------------------------------

    def _update_weights(self) -> None:
        """New weights to every server (``rollout.pause_mode`` while they arrive); no new
        episodes start meanwhile."""
        self.dispatcher.pause()
        self.staleness.set_version(self.rollout.update_weights(self.actor, self.timer))
        self.dispatcher.resume()

    def evaluate(self, step: int) -> dict:
        """The workflow's own held-out metrics (greedy), e.g. the success rate of multi-turn
        episodes or agents; else greedy completions of the held-out records scored by the
        configured reward (``eval/accuracy``: the fraction with reward > 0;
        tidal.rollout.evaluation)."""
        if not self.eval_data:
            return {}
        own = self._run(self.workflow.evaluate(self.eval_data, greedy_config(self.gconfig)))
        if own is not None:
            return own
        if self.evaluator is None:
            self.evaluator = evaluator(self.cfg, self.client, self.tokenizer, self.eval_data)
        return self._run(self.evaluator.run(self.eval_data)).metrics

    def train_step(self, step: int) -> dict:
        r = self.cfg.runner
        with self.timer("step"):
            with self.actor_offloaded(self.actor), self.timer("prepare_batch"):
                episodes = self._prepare_batch()
                batch = LLMBatch.concat(episodes, self.tokenizer.pad_token_id)
            if self.cfg.actor.offload:  # the servers hand the device back while the actor trains
                self.rollout.release_memory()
            with self.timer("train"):
                metrics = self.actor.train_step(batch).wait(r.timeout_s)[0]
            with self.timer("update_weights"):
                self._update_weights()
        metrics.update(self.timer.pop())
        gen_tokens = float(batch.loss_mask.sum())
        metrics.update(
            {
                "version": self.version,
                "rollout/reward_mean": float(batch.rewards.mean()),
                **{f"rollout/{k}": v for k, v in self.staleness.snapshot().items()},
                "rollout/filtered_groups": self.dispatcher.filtered,
                **self.workflow.metrics(),
                "train/tokens_per_s": float(batch.attention_mask.sum()) / metrics["time/step"],
                "rollout/generated_tokens_per_s": gen_tokens / metrics["time/step"],
            }
        )
        return metrics

    def _prepare_batch(self) -> list:
        """A batch of episodes; when episodes fail, a dead server is named first (its group,
        rank and method: a worker fault that runner.max_restarts can cure)."""
        try:
            return self.dispatcher.prepare_batch(
                self.train_data, self.cfg.rollout.batch_size, self.cfg.runner.timeout_s
            )
        except EpisodeError:
            self.rollout.check_alive()
            raise

    def save(self, path: Path, meta: dict) -> str:
        return self.actor.save(str(path), meta).wait(self.cfg.runner.timeout_s)[0]

    def cleanup_steps(self, graceful: bool) -> list:
        steps = []
        if self.dispatcher is not None:  # first: an episode running on would reopen the proxy
            steps.append(("episodes", self.dispatcher.stop_episodes))
        if self.workflow is not None and self.dispatcher is not None:
            steps.append(("workflow", lambda: self._run(self.workflow.aclose(), 30)))
        if self.client is not None and self.dispatcher is not None:
            steps.append(("client", lambda: self._run(self.client.aclose(), 30)))
        if self.dispatcher is not None:
            steps.append(("dispatcher", self.dispatcher.shutdown))
        if self.rollout is not None:
            steps += self.rollout.cleanup_steps(graceful)
        if self.actor is not None:
            steps.append(("actor group", self.actor.shutdown))
        if self.cluster is not None:
            steps.append(("cluster", self.cluster.shutdown))
        return steps
