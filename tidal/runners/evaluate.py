"""``tidal eval``: a model folder (or a training checkpoint of it) on the held-out records,
through an inference server, scored by the configured reward; greedy and ``n`` samples
(pass@k). Writes ``samples.jsonl`` (one row per completion) and ``summary.json`` into a new run
folder ``run_dir/<experiment>-eval``. ``tidal sft`` scores its result with the same code."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

from tidal.checkpoint import checkpoint_argument
from tidal.config import ConfigError, to_yaml
from tidal.config.llm import LLMConfig, validate_llm, validate_model_path
from tidal.inference import GenerationEngine, InferenceClient, InferenceServer
from tidal.models.lm import DTYPES, load_tokenizer
from tidal.rollout.evaluation import EvalResult
from tidal.runners.lm_common import data_cache, eval_records, evaluator
from tidal.runners.loop import run_folder

log = logging.getLogger("tidal.eval")


def validate_eval(cfg: LLMConfig, checkpoint: str | None, n: int) -> Path | None:
    """The config and model as for training, something to evaluate on, and the checkpoint (its
    folder) when one is given; all before the run folder exists."""
    validate_llm(cfg)
    validate_model_path(cfg)
    from tidal.rollout.tasks import TASKS

    if cfg.data.path is None and TASKS.get(cfg.data.task).multi_turn:
        raise ConfigError(
            f"data.task: tidal eval scores single-turn records; {cfg.data.task!r} is multi-turn "
            "(the training run evaluates it)"
        )
    if cfg.data.path is not None and cfg.data.eval_path is None:
        raise ConfigError("data.eval_path: tidal eval needs held-out records (a dataset file)")
    if n < 0:
        raise ConfigError(f"--n: must be >= 0, got {n}")
    return checkpoint_argument(checkpoint)


def serve_and_evaluate(
    cfg: LLMConfig, records: list[dict], n: int = 0, checkpoint: Path | None = None
) -> EvalResult:
    """Start an in-process server on model.path (with the checkpoint's weights), evaluate, stop."""
    engine = GenerationEngine(
        cfg.model.path, max_batch_size=cfg.rollout.max_batch_size, dtype=DTYPES[cfg.model.dtype]
    )
    if checkpoint is not None:
        from tidal.checkpoint import load_checkpoint

        weights, _, meta = load_checkpoint(checkpoint)
        engine.pause()
        engine.update_weights(weights, meta.get("version", meta["step"]))
        engine.resume()
    server = InferenceServer(engine).start()
    tokenizer = load_tokenizer(cfg.model.path)

    async def run() -> EvalResult:
        client = InferenceClient([server.address])
        try:
            judge = evaluator(cfg, client, tokenizer, records, n)
            if judge.samples is not None:  # reproducible samples: the run seed
                judge.samples = dataclasses.replace(judge.samples, seed=cfg.runner.seed)
            return await judge.run(records)
        finally:
            await client.aclose()

    try:
        return asyncio.run(asyncio.wait_for(run(), cfg.runner.timeout_s))
    finally:
        server.stop()


def run_eval(cfg: LLMConfig, checkpoint: str | None = None, n: int = 1) -> dict:
    """Evaluate and write the results; the summary (also printed by the CLI)."""
    folder = validate_eval(cfg, checkpoint, n)
    out = run_folder(
        dataclasses.replace(cfg.runner, experiment=f"{cfg.runner.experiment}-eval"), None
    )
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    start = time.perf_counter()
    with data_cache(cfg, out) as cache:
        records = eval_records(cfg, cache)
    result = serve_and_evaluate(cfg, records, n, folder)
    with (out / "samples.jsonl").open("w") as f:
        for row in result.rows:
            f.write(json.dumps(row, default=str) + "\n")
    summary = {
        **result.metrics,
        "records": len(records),
        "samples_per_record": n,
        "model_path": cfg.model.path,
        "checkpoint": None if folder is None else str(folder),
        "reward": cfg.reward.name,
        "run_dir": str(out),
        "wall_time": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("eval: accuracy %.3f on %d records (%s)", summary["eval/accuracy"], len(records), out)
    return summary
