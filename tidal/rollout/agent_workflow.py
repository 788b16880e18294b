"""Agent workflows on the OpenAI SDK: ``async def agent(client, data) -> reward``.

The agent receives an ``openai.AsyncOpenAI`` (tidal's ``RecordingOpenAI``) and the record,
calls ``client.chat.completions.create`` any number of times (multi-turn; it runs tool calls
itself, from the text) and returns the episode's reward (or ``None`` after setting rewards on
the client). Every completion was recorded with its token ids, behaviour log-probs and
per-token weight versions; they become training sequences in the format of
``RLVRWorkflow``:

- ``concat``: one sequence per episode, when each call's prompt extends the previous call's
  prompt and answer (a chat template that keeps earlier turns verbatim); the tokens between
  answers (the template, tool results, user turns) are context with loss mask 0.
- ``individual``: one sequence per call; a completion without its own reward gets the
  episode's reward discounted by ``turn_discount`` per later call.
- ``auto``: ``concat`` where the prompts extend each other, else ``individual``.

With ``group_size > 1`` a group-normalised advantage baselines every row of a call's runs together
(``LLMBatch.group_ids``); with ``individual`` a run of more calls gives its group more rows, and
``concat`` (one row per run) weighs the runs alike. Pausing, staleness and versions apply as to any episode (generation goes
through ``InferenceClient.agenerate``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tidal.data import LLMBatch, TokenSequence
from tidal.inference import GenerationConfig, InferenceClient
from tidal.inference.agent_client import Completion, RecordingOpenAI
from tidal.inference.tool_calls import TOOL_PARSERS
from tidal.rollout.workflows import Workflow, add_response

AgentFn = Callable[[RecordingOpenAI, dict[str, Any]], Awaitable[float | None]]
MODES = ("concat", "individual", "auto")


def extends(completions: list[Completion]) -> bool:
    """Whether each call's prompt starts with the previous call's prompt and answer."""
    return all(
        b.prompt_ids[: len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
        for a, b in zip(completions, completions[1:])
    )


def concat_sequence(completions: list[Completion]) -> TokenSequence:
    if not extends(completions):
        raise ValueError(
            "mode concat: a call's prompt does not extend the previous prompt and answer"
        )
    seq = TokenSequence()
    for c in completions:
        seq.add_context(c.prompt_ids[len(seq.tokens) :])
        add_response(seq, c.response)
    return seq


def individual_sequences(
    completions: list[Completion], reward: float, turn_discount: float
) -> tuple[list[TokenSequence], list[float]]:
    seqs, rewards = [], []
    last = len(completions) - 1
    for i, c in enumerate(completions):
        seq = TokenSequence()
        seq.add_context(c.prompt_ids)
        add_response(seq, c.response)
        seqs.append(seq)
        rewards.append(c.reward if c.reward is not None else reward * turn_discount ** (last - i))
    return seqs, rewards


def episode_sequences(
    completions: list[Completion], reward: float, mode: str = "auto", turn_discount: float = 1.0
) -> tuple[list[TokenSequence], list[float]]:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if not completions:
        raise ValueError("the episode made no completion")
    if mode == "concat" or (mode == "auto" and extends(completions)):
        return [concat_sequence(completions)], [reward]
    return individual_sequences(completions, reward, turn_discount)


class AgentWorkflow(Workflow):
    """Runs ``agent(client, data)`` ``group_size`` times and returns the padded episode (or
    ``None`` when an agent returned no reward and set none)."""

    def __init__(
        self,
        agent: AgentFn,
        inference: InferenceClient,
        tokenizer,
        gconfig: GenerationConfig,
        group_size: int = 1,
        mode: str = "concat",
        turn_discount: float = 1.0,
        tool_parser: str = "hermes",
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if not 0 <= turn_discount <= 1:
            raise ValueError(f"turn_discount: must be in [0, 1], got {turn_discount}")
        self.agent, self.inference, self.tokenizer = agent, inference, tokenizer
        self.gconfig, self.group_size, self.mode, self.turn_discount = (
            gconfig,
            group_size,
            mode,
            turn_discount,
        )
        TOOL_PARSERS.get(tool_parser)  # an unknown name fails here, naming rollout.tool_parser
        self.tool_parser = tool_parser  # how the model's text becomes tool_calls
        self.tool_parse_errors = 0  # answers whose tool call did not parse (sent as content)

    def metrics(self) -> dict:
        return {"rollout/tool_parse_errors": self.tool_parse_errors}

    async def run(self, data: dict[str, Any]) -> tuple[list[TokenSequence], list[float]] | None:
        client = RecordingOpenAI(
            self.inference, self.tokenizer, self.gconfig, tool_parser=self.tool_parser
        )
        try:
            reward = await self.agent(client, data)
        finally:
            self.tool_parse_errors += client.tool_parse_errors
            await client.close()
        made = client.completions_made
        if reward is None:
            if not made or made[-1].reward is None:
                return None  # no reward: the episode is rejected
            reward = made[-1].reward
        return episode_sequences(made, float(reward), self.mode, self.turn_discount)

    async def __call__(self, data: dict[str, Any]) -> LLMBatch | None:
        runs = await asyncio.gather(*(self.run(data) for _ in range(self.group_size)))
        if any(r is None for r in runs):
            return None  # a group with a missing member cannot be normalised: reject it whole
        seqs = [s for r in runs for s in r[0]]
        rewards = [x for r in runs for x in r[1]]
        return LLMBatch.from_sequences(seqs, rewards, self.tokenizer.pad_token_id)
