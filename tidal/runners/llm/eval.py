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

from tidal.config.llm import LLMConfig
from tidal.inference import GenerationEngine, InferenceClient, InferenceServer
from tidal.models.llm import DTYPES, load_causal_lm, load_tokenizer
from tidal.rollout.evaluation import EvalResult
from tidal.runners.llm.common import data_cache, eval_records, evaluator
from tidal.runners.llm.preflight import check_llm_eval
from tidal.runners.run_folder import RunFolder

log = logging.getLogger("tidal.eval")


def serve_and_evaluate(
    cfg: LLMConfig, records: list[dict], n: int = 0, checkpoint: Path | None = None
) -> EvalResult:
    """Start an in-process server on model.path (with the checkpoint's weights), evaluate, stop."""
    engine = GenerationEngine(
        cfg.model.path, max_batch_size=cfg.rollout.max_batch_size, dtype=DTYPES[cfg.model.dtype]
    )
    if checkpoint is not None:
        weights, meta = trained_llm_weights(cfg, checkpoint)
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


def trained_llm_weights(cfg: LLMConfig, checkpoint: Path) -> tuple[dict, dict]:
    """A checkpoint's weights in the model's own names (merged under LoRA) and its meta."""
    from tidal.checkpoint import checkpoint_weights, read_meta

    model = None
    if cfg.model.lora.rank > 0:  # the base the adapters were trained on
        model, _ = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation)
    return checkpoint_weights(model, checkpoint, cfg.model.lora, repr(cfg.model.path)), read_meta(
        checkpoint
    )


def run_eval(cfg: LLMConfig, checkpoint: str | None = None, n: int = 1) -> dict:
    """Evaluate and write the results; the summary (also printed by the CLI)."""
    folder = check_llm_eval(cfg, checkpoint, n)
    with RunFolder(cfg, "eval") as run:
        return _evaluate_into(cfg, run.path, folder, n)


def _evaluate_into(cfg: LLMConfig, out: Path, folder: Path | None, n: int) -> dict:
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
