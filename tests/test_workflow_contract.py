"""The workflow contract: a factory receives a ``WorkflowContext`` (never the runner) and returns
a ``Workflow`` (or a plain async episode function); the runner reads a workflow's metrics,
evaluation and closing through the contract, with no probing."""

import asyncio
import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tidal.config.llm import LLMConfig
from tidal.config.loader import load_config
from tidal.data import LLMBatch, TokenSequence
from tidal.rollout.workflows import (
    EpisodeFunction,
    RLVRWorkflow,
    Workflow,
    WorkflowContext,
    as_workflow,
)

BUILT: list = []  # what the factories below were given, per run


class CountingWorkflow(Workflow):
    """Wraps the built-in RLVR workflow; counts episodes and closes, evaluates on its own."""

    def __init__(self, ctx: WorkflowContext):
        from tidal.runners.llm.workflows import rlvr_workflow

        self.inner = rlvr_workflow(ctx)
        self.episodes = self.closed = 0

    async def __call__(self, data):
        self.episodes += 1
        return await self.inner(data)

    def metrics(self):
        return {"rollout/counted_episodes": float(self.episodes)}

    async def evaluate(self, records, gconfig):
        return {"eval/records_seen": float(len(records))}

    async def aclose(self):
        self.closed += 1


def counting_factory(ctx):
    BUILT.append(ctx)
    flow = CountingWorkflow(ctx)
    BUILT.append(flow)
    return flow


def function_factory(ctx):
    """A plain async function is a workflow too: it plays a fixed reply for every record."""
    BUILT.append(ctx)

    async def episode(data):
        seq = TokenSequence()
        seq.add_context(ctx.tokenizer.encode(data["prompt"]))
        seq.add_generated([ctx.tokenizer.eos_token_id], [-1.0], [0])
        return LLMBatch.from_sequences([seq] * 2, [0.0, 1.0], ctx.tokenizer.pad_token_id)

    return episode


def test_a_plain_function_becomes_a_workflow_and_anything_else_is_named():
    async def episode(data):
        return None

    flow = as_workflow(episode, "rollout.workflow 'm:f'")
    assert isinstance(flow, EpisodeFunction) and flow.metrics() == {}
    assert asyncio.run(flow.evaluate([], None)) is None and asyncio.run(flow({})) is None
    with pytest.raises(TypeError, match=r"rollout.workflow 'm:f' returned int, not a workflow"):
        as_workflow(3, "rollout.workflow 'm:f'")


def test_rlvr_reports_its_reward_failures_as_metrics():
    flow = RLVRWorkflow(None, None, lambda completion, **_: 1 / 0, None)
    assert flow.metrics() == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    assert asyncio.run(flow.reward.ascore("x", {}, timeout_s=5)) is None  # counted, not raised
    assert flow.metrics() == {"rollout/reward_errors": 1, "rollout/reward_timeouts": 0}


def train(arith_model, tmp_path, factory: str) -> list[dict]:
    from tidal.runners.llm.train import LLMRunner

    BUILT.clear()
    cfg = load_config(
        LLMConfig,
        None,
        [
            f"model.path={arith_model}",
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            "runner.max_steps=2",
            "runner.eval_interval=2",
            "data.eval_size=4",
            "rollout.batch_size=2",
            "rollout.group_size=2",
            "rollout.max_concurrent_rollouts=4",
            f"rollout.workflow={Path(__file__).stem}:{factory}",
        ],
    )
    runner = LLMRunner(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["step"] >= 1]


def test_a_user_workflow_is_built_from_the_context_and_read_through_the_contract(
    arith_model, tmp_path
):
    rows = train(arith_model, tmp_path, "counting_factory")
    ctx, flow = BUILT
    assert isinstance(ctx, WorkflowContext) and ctx.eval_data and ctx.cfg.runner.max_steps == 2
    assert AutoTokenizer.from_pretrained(arith_model).vocab == ctx.tokenizer.vocab
    # its own metrics and evaluation reach metrics.jsonl; the reward evaluation never ran
    # (episodes of the next step may start before the run ends: admission runs ahead)
    assert 4 <= rows[-1]["rollout/counted_episodes"] <= flow.episodes
    assert rows[-1]["eval/records_seen"] == 4 and "eval/accuracy" not in rows[-1]
    assert flow.closed == 1  # closed once, at the end of the run


def test_a_plain_episode_function_trains_and_the_reward_evaluation_scores_it(arith_model, tmp_path):
    rows = train(arith_model, tmp_path, "function_factory")
    assert isinstance(BUILT[0], WorkflowContext)
    assert [r["rollout/reward_mean"] for r in rows] == [0.5, 0.5]
    assert math.isfinite(rows[-1]["train/policy_loss"]) and "eval/accuracy" in rows[-1]
