"""Agents written with the openai SDK, recorded into training sequences."""

import asyncio
import dataclasses

import pytest
import torch
from deps import require
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.inference import GenerationConfig, GenerationEngine, InferenceClient, InferenceServer
from tidal.inference.tiny import save_tiny_model

openai = require("openai")
from tidal.inference.agent_client import RecordingOpenAI  # noqa: E402
from tidal.rollout.agent_workflow import AgentWorkflow  # noqa: E402
from tidal.rollout.workflows import RLVRWorkflow, has_reward_spread  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("models") / "agent", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    srv = InferenceServer(GenerationEngine(model_dir)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


async def calculator_agent(client: openai.AsyncOpenAI, data: dict) -> float:
    """Ask, 'run' the calculator on the model's call, reply with its result, ask again."""
    messages = [{"role": "user", "content": data["question"]}]
    first = await client.chat.completions.create(model="tidal", messages=messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "tool", "content": str(eval(data["question"]))},
    ]
    second = await client.chat.completions.create(model="tidal", messages=messages, max_tokens=5)
    return 1.0 if second.choices[0].message.content.strip() == data["answer"] else 0.25


def run(coro):
    return asyncio.run(coro)


def test_a_multi_turn_agent_becomes_one_sequence_per_run(server, model_dir, tok):
    gconfig = GenerationConfig(max_new_tokens=8, stop_token_ids=[tok.eos_token_id], seed=3)

    async def main():
        inference = InferenceClient([server.address])
        try:
            flow = AgentWorkflow(
                calculator_agent, inference, tok, gconfig, group_size=3, mode="concat"
            )
            rlvr = RLVRWorkflow(inference, tok, lambda **_: 1.0, gconfig, group_size=2)
            return await flow({"question": "3+4", "answer": "7"}), await rlvr({"prompt": "3+4"})
        finally:
            await inference.aclose()

    episode, reference = run(main())
    assert type(episode) is type(reference)  # the record RLVRWorkflow produces
    fields = [f.name for f in dataclasses.fields(episode)]
    assert all(getattr(episode, k).dtype == getattr(reference, k).dtype for k in fields)
    assert episode.input_ids.shape[0] == 3 and episode.rewards.tolist() == [0.25] * 3
    assert not has_reward_spread(episode)  # dynamic sampling drops a group of equal runs
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for row in range(3):
        n = int(episode.attention_mask[row].sum())
        ids, mask = episode.input_ids[row, :n], episode.loss_mask[row, :n]
        versions = episode.versions[row, :n]
        assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()
        spans = _spans(mask)
        assert len(spans) == 2  # two answers, with the tool turn between them as context
        assert "tool 7 assistant" in tok.decode(ids[spans[0][1] : spans[1][0]])
        with torch.no_grad():  # behaviour log-probs are the model's, on exactly these tokens
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        ref = logp.gather(1, ids[1:, None]).squeeze(1)
        assert (ref[mask[1:]] - episode.logprobs[row, 1:n][mask[1:]]).abs().max() < 1e-4


def _spans(mask):
    spans, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_individual_mode_discounts_the_episode_reward_per_turn(server, tok):
    gconfig = GenerationConfig(max_new_tokens=8, stop_token_ids=[tok.eos_token_id])

    async def main():
        inference = InferenceClient([server.address])
        try:
            flow = AgentWorkflow(
                calculator_agent, inference, tok, gconfig, mode="individual", turn_discount=0.5
            )
            return await flow({"question": "2*3", "answer": "6"})
        finally:
            await inference.aclose()

    episode = run(main())
    assert episode.rewards.tolist() == [0.125, 0.25]  # one row per call
    answers = episode.loss_mask.sum(1)
    assert ((answers >= 1) & (answers <= 8)).all()
    # the second row's context holds the first call's prompt and answer, then the tool turn
    first = episode.input_ids[0, : int(episode.attention_mask[0].sum())]
    assert torch.equal(episode.input_ids[1, : len(first)], first)


def test_rewards_per_completion_and_unsupported_arguments(server, tok):
    async def main():
        inference = InferenceClient([server.address])
        client = RecordingOpenAI(
            inference, tok, GenerationConfig(max_new_tokens=4, stop_token_ids=[2])
        )
        try:
            out = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                logprobs=True,
                temperature=0,
            )
            client.set_reward(out.id, 0.7)
            with pytest.raises(ValueError, match="frequency_penalty"):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], frequency_penalty=1
                )
            with pytest.raises(KeyError, match="completion_id"):
                client.set_reward("chatcmpl-nope", 1.0)
            return out, client.completions_made
        finally:
            await client.close()
            await inference.aclose()

    out, made = run(main())
    assert isinstance(out, openai.types.chat.ChatCompletion)
    assert len(made) == 1 and made[0].reward == 0.7 and made[0].id == out.id
    assert [c.logprob for c in out.choices[0].logprobs.content] == made[0].response.output_logprobs
    assert out.usage.completion_tokens == len(made[0].output_ids)


def test_an_agent_that_gives_no_reward_is_rejected(server, tok):
    """The same agent, its completion made either way: without a reward (returned or set) the
    episode is rejected, with one it trains on that completion."""
    made = []

    async def agent(client, data):
        out = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1"}], max_tokens=2
        )
        made.append(out.usage.completion_tokens)
        return data.get("reward")

    async def main(data):
        inference = InferenceClient([server.address])
        try:
            flow = AgentWorkflow(agent, inference, tok, GenerationConfig(max_new_tokens=2))
            return await flow(data)
        finally:
            await inference.aclose()

    assert run(main({})) is None
    assert len(made) == 1 and made[0] >= 1  # rejected for its missing reward, not a failed call
    episode = run(main({"reward": 0.5}))
    assert episode.rewards.tolist() == [0.5] and int(episode.loss_mask.sum()) == made[1]
