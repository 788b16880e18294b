"""The asynchronous training loop for language agents:

prepare batch (episodes keep flowing, bounded by staleness) → proximal / reference logp →
advantages → update → pause → update weights → set version → resume → evaluate / save.
With ``rollout.max_staleness = 0`` it is exactly synchronous RL.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
import uuid
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from tidal.config import to_yaml
from tidal.config.llm import LLMConfig, validate_llm
from tidal.inference import GenerationConfig, InferenceClient, ModelRequest
from tidal.metrics import MetricLogger, Timer, attach_file_log
from tidal.rollout.dispatcher import RolloutDispatcher
from tidal.rollout.staleness import StalenessManager
from tidal.rollout.tasks import TASKS, exact_match_reward
from tidal.rollout.workflows import MultiTurnWorkflow, RLVRWorkflow, merge_episodes
from tidal.runtime import Channel, Cluster, wait_all
from tidal.workers.inference_worker import InferenceServerWorker
from tidal.workers.lm_actor import LMActor

log = logging.getLogger("tidal.train")


class ReasoningRunner:
    def __init__(self, cfg: LLMConfig):
        validate_llm(cfg)
        self.cfg = cfg
        r = cfg.rollout
        self.run_dir = Path(cfg.runner.run_dir) / cfg.runner.experiment
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self._log_handler = attach_file_log(self.run_dir / "train.log")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.cluster = Cluster(cfg.cluster.backend, address=cfg.cluster.address, devices_per_node=cfg.cluster.devices_per_node)
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
        self.version, self.start_step = 0, 0
        self.timer = Timer()
        if cfg.runner.resume_from:
            meta = self.actor.load(cfg.runner.resume_from).wait(cfg.runner.timeout_s)[0]
            self.start_step, self.version = meta["step"], meta["version"]
            self.staleness.restore(self.version)
            self._skip_data(meta.get("data_position", 0))
            self._update_weights()
        self.logger = MetricLogger(self.run_dir)

    def _workflow(self):
        r, d = self.cfg.rollout, self.cfg.data
        if ":" in r.workflow:  # a user's workflow: module.path:factory(runner) -> async callable
            module, name = r.workflow.split(":", 1)
            return getattr(importlib.import_module(module), name)(self)
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

    def evaluate(self) -> dict:
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

    def run(self) -> dict:
        r = self.cfg.runner
        start = time.perf_counter()
        history = []
        summary: dict = {}
        step = self.start_step
        if self.start_step == 0 and r.eval_interval:
            first = self.evaluate()
            history.append((0, first))
            self.logger.log(-1, {**first, "version": 0})
            summary["initial_eval"] = first
        for step in range(self.start_step, r.max_steps):
            with self.timer("step"):
                with self.timer("prepare_batch"):
                    episodes = self.dispatcher.prepare_batch(self.train_data, self.cfg.rollout.batch_size, r.timeout_s)
                    batch = merge_episodes(episodes, self.tokenizer.pad_token_id)
                with self.timer("train"):
                    metrics = self.actor.train_step(batch).wait(r.timeout_s)[0]
                with self.timer("update_weights"):
                    self._update_weights()
            metrics.update(self.timer.pop())
            gen_tokens = float(batch["loss_mask"].sum())
            metrics.update({
                "version": self.version, "rollout/reward_mean": float(batch["rewards"].mean()),
                **{f"rollout/{k}": v for k, v in self.staleness.snapshot().items()},
                **self._reward_failures(),
                "train/tokens_per_s": float(batch["attention_mask"].sum()) / metrics["time/step"],
                "rollout/generated_tokens_per_s": gen_tokens / metrics["time/step"],
                "time/elapsed": time.perf_counter() - start,
            })
            if r.eval_interval and (step + 1) % r.eval_interval == 0:
                metrics.update(self.evaluate())
                history.append((step + 1, {k: v for k, v in metrics.items() if k.startswith("eval/")}))
            self.logger.log(step, metrics)
            log.info("step %d reward %.3f %s", step + 1, metrics["rollout/reward_mean"],
                     {k: round(v, 3) for k, v in metrics.items() if k.startswith("eval/")})
            if self.cfg.runner.progress:
                print(f"step {step + 1}/{r.max_steps} reward {metrics['rollout/reward_mean']:.3f} "
                      f"{ {k: round(v, 3) for k, v in metrics.items() if k.startswith('eval/')} } "
                      f"staleness {metrics['staleness/mean']:.2f} {metrics['time/step']:.2f}s/step", flush=True)
            if r.save_interval and (step + 1) % r.save_interval == 0:
                self.save(step + 1)
            acc = metrics.get("eval/accuracy", metrics.get("eval/success_rate"))
            if acc is not None and r.target_accuracy is not None and acc >= r.target_accuracy:
                break
            if r.max_minutes is not None and time.perf_counter() - start > r.max_minutes * 60:
                break
        summary.update(checkpoint=self.save(step + 1), steps=step + 1, wall_time=time.perf_counter() - start,
                       evals=history, run_dir=str(self.run_dir))
        return summary

    def _reward_failures(self) -> dict:
        counters = getattr(self.workflow, "counters", None)  # user workflows may keep none
        if counters is None:
            return {}
        return {"rollout/reward_errors": counters.errors, "rollout/reward_timeouts": counters.timeouts}

    def save(self, step: int) -> str:
        meta = {"step": step, "data_position": self.dispatcher.submitted, "staleness": self.staleness.snapshot()}
        return self.actor.save(str(self.run_dir / "checkpoints" / f"step_{step:06d}"), meta).wait(self.cfg.runner.timeout_s)[0]

    def close(self) -> None:
        self._run(self.client.aclose(), 30)
        self.dispatcher.shutdown()
        self.logger.close()
        self.servers.shutdown_server().wait(60)
        self.servers.shutdown()
        self.actor.shutdown()
        self.weights_ch.close()
        self.cluster.shutdown()
        logging.getLogger("tidal").removeHandler(self._log_handler)
        self._log_handler.close()
