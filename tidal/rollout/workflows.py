"""Episodes for language agents: ``async def run_episode(data) -> LMBatch | None``.

An episode returns an ``LMBatch`` (tidal.data: padded ``[n, L]`` token ids, masks, behaviour
log-probs and per-token weight versions, and ``rewards`` ``[n]``), or ``None`` to reject. Reward functions run off the event loop with a timeout; an exception or a
timeout rejects that sample and is counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.data import LMBatch, TokenSequence
from tidal.inference import GenerationConfig, InferenceClient, ModelRequest, ModelResponse

log = logging.getLogger(__name__)
RewardFn = Callable[..., float]


@dataclass
class RewardCounters:
    errors: int = 0
    timeouts: int = 0


def add_response(seq: TokenSequence, resp: ModelResponse) -> None:
    seq.add_generated(resp.output_tokens, resp.output_logprobs, resp.output_versions)


async def score(reward_fn: RewardFn, timeout: float, counters: RewardCounters, **kwargs) -> float | None:
    """Run a (blocking) reward function off the event loop; ``None`` on error or timeout."""
    try:
        return float(await asyncio.wait_for(asyncio.to_thread(reward_fn, **kwargs), timeout))
    except TimeoutError:
        counters.timeouts += 1
    except Exception:  # a broken reward rejects the sample; it is counted, not fatal
        counters.errors += 1
        log.exception("reward function failed")
    return None


class RLVRWorkflow:
    """Single-turn RL from verifiable rewards: ``group_size`` samples per prompt, each scored by
    ``reward_fn(prompt=..., completion=..., **data)``. ``data`` holds ``prompt`` (text)."""

    def __init__(self, client: InferenceClient, tokenizer, reward_fn: RewardFn, gconfig: GenerationConfig,
                 group_size: int = 1, reward_timeout_s: float = 10.0):
        self.client, self.tokenizer, self.reward_fn = client, tokenizer, reward_fn
        self.gconfig, self.group_size, self.reward_timeout_s = gconfig, group_size, reward_timeout_s
        self.counters = RewardCounters()

    async def __call__(self, data: dict[str, Any]) -> LMBatch | None:
        prompt_ids = self.tokenizer.encode(data["prompt"], add_special_tokens=False)
        prompt_ids = [self.tokenizer.bos_token_id] + prompt_ids
        # the whole group in one request: one HTTP round trip instead of group_size
        responses = await self.client.agenerate_n(ModelRequest(prompt_ids, self.gconfig), self.group_size)
        seqs, rewards = [], []
        for resp in responses:
            completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = await score(self.reward_fn, self.reward_timeout_s, self.counters, completion=completion, **data)
            if reward is None:
                return None  # a group with a missing member cannot be normalised: reject it whole
            seq = TokenSequence()
            seq.add_context(prompt_ids)
            add_response(seq, resp)
            seqs.append(seq)
            rewards.append(reward)
        return LMBatch.from_sequences(seqs, rewards, self.tokenizer.pad_token_id)


class MultiTurnWorkflow:
    """Several turns against an environment: ``env = make_env(data)`` answers each completion
    with ``(feedback_text, reward, done)``; the feedback joins the context with loss mask 0.
    The episode's reward is the first positive turn reward discounted by ``turn_discount`` per
    extra turn (0 when no turn succeeds)."""

    def __init__(self, client: InferenceClient, tokenizer, make_env: Callable[[dict], Any], gconfig: GenerationConfig,
                 max_turns: int = 4, turn_discount: float = 0.9, group_size: int = 1):
        self.client, self.tokenizer, self.make_env = client, tokenizer, make_env
        self.gconfig, self.max_turns, self.turn_discount, self.group_size = gconfig, max_turns, turn_discount, group_size

    async def play(self, data: dict[str, Any], gconfig: GenerationConfig | None = None) -> tuple[TokenSequence, float]:
        """One episode (with ``gconfig`` instead of the workflow's, e.g. greedy for evaluation)."""
        gconfig = gconfig or self.gconfig
        env = self.make_env(data)
        seq = TokenSequence()
        seq.add_context([self.tokenizer.bos_token_id] + self.tokenizer.encode(data["prompt"], add_special_tokens=False))
        reward = 0.0
        for turn in range(self.max_turns):
            resp = await self.client.agenerate(ModelRequest(list(seq.tokens), gconfig))
            add_response(seq, resp)
            feedback, turn_reward, done = env.step(self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True))
            if turn_reward > 0:
                reward = turn_reward * self.turn_discount**turn
            if done:
                break
            seq.add_context(self.tokenizer.encode(feedback, add_special_tokens=False))
        return seq, reward

    async def __call__(self, data: dict[str, Any]) -> LMBatch | None:
        results = await asyncio.gather(*(self.play(data) for _ in range(self.group_size)))
        return LMBatch.from_sequences([s for s, _ in results], [r for _, r in results], self.tokenizer.pad_token_id)
