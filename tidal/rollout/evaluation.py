"""Evaluation of single-turn language tasks through an inference server, shared by the runner's
periodic evaluation and ``tidal eval``: a greedy completion per record and, optionally, ``n``
sampled ones, each scored by the configured reward.

``eval/accuracy`` is the fraction of records whose greedy completion earns a reward > 0 (for
0/1 rewards: the fraction solved); ``eval/reward_mean`` is the mean greedy reward; with samples,
``eval/pass@k`` is the unbiased estimate ``1 - C(n-c, k) / C(n, k)`` (c: samples with reward > 0)
averaged over records.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from typing import Any

from tidal.inference import GenerationConfig, InferenceClient, ModelRequest, ModelResponse
from tidal.rollout.rewards import Reward
from tidal.rollout.workflows import PromptRenderer


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per completion


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that at least one of ``k`` of the ``n`` samples is correct (Chen et al. 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """Powers of two below ``n``, and ``n``."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


@dataclass
class Evaluator:
    client: InferenceClient
    tokenizer: Any
    render: PromptRenderer
    reward: Reward
    greedy: GenerationConfig  # temperature 0
    samples: GenerationConfig | None = None  # with n > 0: how the samples are drawn
    n: int = 0
    reward_timeout_s: float = 10.0
    max_concurrent: int = 64  # records in flight at once

    async def run(self, records: list[dict]) -> EvalResult:
        gate = asyncio.Semaphore(self.max_concurrent)

        async def bounded(record):
            async with gate:
                return await self._record(record)

        per_record = await asyncio.gather(*(bounded(r) for r in records))
        rows = [row for record_rows in per_record for row in record_rows]
        return EvalResult(self._metrics(per_record), rows)

    async def _record(self, record: dict) -> list[dict]:
        ids = self.render(record["prompt"])
        responses = [await self.client.agenerate(ModelRequest(ids, self.greedy))]
        if self.n:
            responses += await self.client.agenerate_n(ModelRequest(ids, self.samples), self.n)
        prompt = self.tokenizer.decode(ids)
        return await asyncio.gather(
            *(self._row(record, prompt, r, i) for i, r in enumerate(responses))
        )

    async def _row(self, record: dict, prompt: str, resp: ModelResponse, i: int) -> dict:
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await self.reward.ascore(completion, record, self.reward_timeout_s)
        return {
            "id": record.get("id"),
            "sample": "greedy" if i == 0 else i - 1,
            "prompt": prompt,
            "completion": completion,
            "reward": 0.0 if reward is None else reward,
            "failed": reward is None,
        }

    def _metrics(self, per_record: list[list[dict]]) -> dict[str, float]:
        greedy = [rows[0]["reward"] for rows in per_record]
        out = {
            "eval/accuracy": _mean([r > 0 for r in greedy]),
            "eval/reward_mean": _mean(greedy),
            "eval/reward_failures": float(
                sum(row["failed"] for rows in per_record for row in rows)
            ),
        }
        if self.n:
            solved = [sum(row["reward"] > 0 for row in rows[1:]) for rows in per_record]
            out["eval/sampled_reward_mean"] = _mean(
                [row["reward"] for rows in per_record for row in rows[1:]]
            )
            for k in pass_ks(self.n):
                out[f"eval/pass@{k}"] = _mean([pass_at_k(self.n, c, k) for c in solved])
        return out


def greedy_config(gconfig: GenerationConfig) -> GenerationConfig:
    return replace(gconfig, temperature=0.0, seed=None)


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
