"""The asynchronous training loop for language agents:

prepare batch (episodes keep flowing, bounded by staleness) → proximal / reference logp →
advantages → update → pause → update weights → set version → resume → evaluate / save.
With ``rollout.max_staleness = 0`` it is exactly synchronous RL.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from tidal.config.llm import LLMConfig, import_object, validate_llm, validate_model_path
from tidal.data import LMBatch
from tidal.inference import GenerationConfig, InferenceClient, ModelRequest
from tidal.rollout.dispatcher import RolloutDispatcher
from tidal.rollout.staleness import StalenessManager
from tidal.rollout.tasks import TASKS, exact_match_reward
from tidal.rollout.workflows import MultiTurnWorkflow, RLVRWorkflow
from tidal.runners.loop import RunLoop
from tidal.runtime import Channel, wait_all
from tidal.workers.inference_worker import InferenceServerWorker
from tidal.workers.lm_actor import LMActor

log = logging.getLogger("tidal.train")


class ReasoningRunner(RunLoop):
    initial_evaluation = True

    def __init__(self, cfg: LLMConfig):
        validate_llm(cfg)
        validate_model_path(cfg)
        self.cluster = self.servers = self.actor = self.weights_ch = self.client = self.dispatcher = None
        self.version = 0
        super().__init__(cfg)

    # -- what the run loop asks of a runner ------------------------------------------------

    def build(self) -> None:
        cfg, r = self.cfg, self.cfg.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.cluster = self.start_cluster()
        placement = self.cluster.placement(cfg.cluster.resolved_placement(["rollout", "actor"]))
        devices = placement.devices("rollout")[: r.num_servers] if r.num_servers <= len(placement.devices("rollout")) else r.num_servers
        self.servers = InferenceServerWorker.create_group(cfg.model.path, max_batch_size=r.max_batch_size,
                                                         torch_threads=cfg.cluster.torch_threads).launch(
            self.cluster, devices, name="rollout")
        self.actor = LMActor.create_group(cfg).launch(self.cluster, placement.devices("actor"), name="actor")
        self.weights_ch = Channel.create(f"{cfg.runner.experiment}-{uuid.uuid4().hex[:6]}-weights", self.cluster)
        addresses = self.servers.address().wait(cfg.runner.timeout_s)
        self.client = InferenceClient(addresses)
        self.gconfig = GenerationConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                        top_k=r.top_k, stop_token_ids=[self.tokenizer.eos_token_id])
        self.staleness = StalenessManager(r.max_staleness, r.batch_size, r.max_concurrent_rollouts)
        self.workflow = self._workflow()
        self.dispatcher = RolloutDispatcher(self.workflow, self.staleness)
        self.train_data, self.eval_data = self._data()

    def restore(self, checkpoint: Path) -> dict:
        meta = self.actor.load(str(checkpoint)).wait(self.cfg.runner.timeout_s)[0]
        self.version = meta["version"]
        self.staleness.restore(self.version)
        self._skip_data(meta.get("data_position", 0))
        self._update_weights()
        return meta

    def checkpoint_meta(self) -> dict:
        return {"data_position": self.dispatcher.submitted, "staleness": self.staleness.snapshot()}

    def progress_info(self, m: dict) -> str:
        evals = {k: round(v, 3) for k, v in m.items() if k.startswith("eval/")}
        return (f"reward {m['rollout/reward_mean']:.3f} {evals or ''} staleness {m['staleness/mean']:.2f} "
                f"{m['time/step']:.2f}s/step")

    def _workflow(self):
        r, d = self.cfg.rollout, self.cfg.data
        if ":" in r.workflow:  # a user's workflow: module.path:factory(runner) -> async callable
            return import_object(r.workflow, "rollout.workflow")(self)
        task = TASKS.get(d.task)
        if task.multi_turn:
            return MultiTurnWorkflow(self.client, self.tokenizer, task.env, self.gconfig,
                                     max_turns=r.max_turns, turn_discount=r.turn_discount, group_size=r.group_size)
        return RLVRWorkflow(self.client, self.tokenizer, task.reward, self.gconfig, r.group_size, r.reward_timeout_s)

    def _data(self):
        d = self.cfg.data
        problems = TASKS.get(d.task).problems
        return problems(d.train_size, d.seed, d), problems(d.eval_size, d.seed + 10_000, d)

    def _skip_data(self, position: int) -> None:
        self.train_data = self.train_data[position % len(self.train_data):] + self.train_data[: position % len(self.train_data)]

    def _run(self, coro, timeout: float | None = None):
        """Run a coroutine on the dispatcher's event loop (where the client lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.dispatcher._loop).result(timeout or self.cfg.runner.timeout_s)

    # -- phases ----------------------------------------------------------------------------

    def _update_weights(self) -> None:
        """pause → update weights → set version → resume."""
        timeout = self.cfg.runner.timeout_s
        self.dispatcher.pause()
        with self.timer("update_weights/pause"):
            self.servers.pause_generation(self.cfg.rollout.pause_mode).wait(timeout)
        with self.timer("update_weights/transfer"):
            sent, loaded = wait_all([self.actor.send_weights(self.weights_ch, self.servers.world_size),
                                     self.servers.load_weights(self.weights_ch, timeout)], timeout)
        self.version = sent[0]
        self.staleness.set_version(self.version)
        with self.timer("update_weights/resume"):
            self.servers.continue_generation().wait(timeout)
        self.dispatcher.resume()

    def evaluate(self, step: int) -> dict:
        """Greedy exact-match accuracy (single-turn) or greedy success rate (multi-turn) on
        held-out data."""
        greedy = GenerationConfig(max_new_tokens=self.gconfig.max_new_tokens, temperature=0.0,
                                  stop_token_ids=self.gconfig.stop_token_ids)
        if TASKS.get(self.cfg.data.task).multi_turn:
            async def success():
                eps = await asyncio.gather(*(self.workflow.play(d, greedy) for d in self.eval_data))
                return float(np.mean([r > 0 for _, r in eps]))

            return {"eval/success_rate": self._run(success())}

        async def accuracy():
            async def one(p):
                ids = [self.tokenizer.bos_token_id] + self.tokenizer.encode(p["prompt"], add_special_tokens=False)
                resp = await self.client.agenerate(ModelRequest(ids, greedy))
                return exact_match_reward(self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True), p["answer"])

            return float(np.mean(await asyncio.gather(*(one(p) for p in self.eval_data))))

        return {"eval/accuracy": self._run(accuracy())}

    def train_step(self, step: int) -> dict:
        r = self.cfg.runner
        with self.timer("step"):
            with self.timer("prepare_batch"):
                episodes = self.dispatcher.prepare_batch(self.train_data, self.cfg.rollout.batch_size, r.timeout_s)
                batch = LMBatch.concat(episodes, self.tokenizer.pad_token_id)
            with self.timer("train"):
                metrics = self.actor.train_step(batch).wait(r.timeout_s)[0]
            with self.timer("update_weights"):
                self._update_weights()
        metrics.update(self.timer.pop())
        gen_tokens = float(batch.loss_mask.sum())
        metrics.update({
            "version": self.version, "rollout/reward_mean": float(batch.rewards.mean()),
            **{f"rollout/{k}": v for k, v in self.staleness.snapshot().items()},
            **self._reward_failures(),
            "train/tokens_per_s": float(batch.attention_mask.sum()) / metrics["time/step"],
            "rollout/generated_tokens_per_s": gen_tokens / metrics["time/step"],
        })
        return metrics

    def _reward_failures(self) -> dict:
        counters = getattr(self.workflow, "counters", None)  # user workflows may keep none
        if counters is None:
            return {}
        return {"rollout/reward_errors": counters.errors, "rollout/reward_timeouts": counters.timeouts}

    def save(self, path: Path, meta: dict) -> str:
        return self.actor.save(str(path), meta).wait(self.cfg.runner.timeout_s)[0]

    def cleanup_steps(self, graceful: bool) -> list:
        steps = []
        if self.client is not None and self.dispatcher is not None:
            steps.append(("client", lambda: self._run(self.client.aclose(), 30)))
        if self.dispatcher is not None:
            steps.append(("dispatcher", self.dispatcher.shutdown))
        if self.servers is not None:
            if graceful:
                steps.append(("inference servers", lambda: self.servers.shutdown_server().wait(60)))
            steps.append(("rollout group", self.servers.shutdown))
        if self.actor is not None:
            steps.append(("actor group", self.actor.shutdown))
        if self.weights_ch is not None:
            steps.append(("weights channel", self.weights_ch.close))
        if self.cluster is not None:
            steps.append(("cluster", self.cluster.shutdown))
        return steps
