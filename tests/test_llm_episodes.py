"""Language episodes: batches and their rows, tasks and rewards, the multi-turn workflow,
token packing and the config rules of the language half."""

import asyncio

import pytest
import torch

from tidal.algorithms.tokens import length_grouped_micro_batches, pack_by_tokens, token_logprobs
from tidal.config import ConfigError, load_config
from tidal.config.llm import LLMConfig
from tidal.data import LLMBatch, TokenSequence
from tidal.rollout.tasks import (
    GuessNumberEnv,
    arithmetic_problems,
    exact_match_reward,
    reverse_problems,
)
from tidal.runners.llm.preflight import check_llm


def test_padded_episodes_and_merging():
    s1, s2 = TokenSequence(), TokenSequence()
    s1.add_context([1, 2])
    s2.add_context([1, 2, 3])
    from tidal.inference import ModelResponse
    from tidal.rollout.workflows import add_response

    add_response(
        s1,
        ModelResponse(output_tokens=[7, 8], output_logprobs=[-0.1, -0.2], output_versions=[3, 4]),
    )
    ep = LLMBatch.from_sequences([s1, s2], [1.0, 0.0])
    assert ep.input_ids.tolist() == [[1, 2, 7, 8], [1, 2, 3, 0]]
    assert ep.versions.tolist() == [[-1, -1, 3, 4], [-1, -1, -1, -1]]
    assert ep.loss_mask.tolist() == [[False, False, True, True], [False] * 4]
    merged = LLMBatch.concat([ep, LLMBatch.from_sequences([s2], [0.5])])
    assert merged.input_ids.shape == (3, 4) and merged.rewards.tolist() == [1.0, 0.0, 0.5]
    # each workflow call is a group of its own, whatever its number of rows
    assert ep.group_ids.tolist() == [0, 0] and merged.group_ids.tolist() == [0, 0, 1]
    assert LLMBatch.concat([merged, ep]).group_ids.tolist() == [0, 0, 1, 2, 2]


def test_each_actor_rank_trains_its_share_of_a_minibatch_and_no_row_is_dropped():
    """An agent's episodes give a row per call: a minibatch's rows need not divide over the
    ranks (they were cut to equal blocks, the rest dropped)."""
    from types import SimpleNamespace

    from tidal.workers.llm_actor import LLMActor

    def shares(rows: int, ranks: int) -> list[list[int]]:
        return [
            LLMActor.my_rows(SimpleNamespace(rank=r, world_size=ranks), torch.arange(rows)).tolist()
            for r in range(ranks)
        ]

    assert shares(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shares(7, 2) == [[0, 1, 2, 3], [4, 5, 6]]
    with pytest.raises(RuntimeError, match="a minibatch of 1 rows cannot feed 2 actor ranks"):
        shares(1, 2)


def test_tasks_and_rewards():
    p = arithmetic_problems(50, digits=2, seed=3)
    assert all(int(x["prompt"][:2]) + int(x["prompt"][3:5]) == int(x["answer"]) for x in p)
    assert exact_match_reward(completion="122", answer="122") == 1.0
    assert exact_match_reward(completion="12", answer="122") == 0.0
    env = GuessNumberEnv(42)
    assert (
        env.step("10") == (" >", 0.0, False)
        and env.step("50") == (" <", 0.0, False)
        and env.step("42")[1:] == (1.0, True)
    )


def test_word_problem_tasks_answer_their_story():
    import re

    from tidal.rollout.tasks import TASKS

    sums = TASKS.get("word_sums").problems(64, 1, None)
    for record in sums:
        a, b = map(int, re.findall(r"\d+", record["prompt"]))
        assert "buys" in record["prompt"] and int(record["answer"]) == a + b
    mixed = TASKS.get("word_problems").problems(64, 1, None)
    assert any("away" in r["prompt"] or "lost" in r["prompt"] for r in mixed)
    for record in mixed:
        a, b = map(int, re.findall(r"\d+", record["prompt"]))
        took = "away" in record["prompt"] or "lost" in record["prompt"]
        assert int(record["answer"]) == (a - b if took else a + b)
    products = TASKS.get("word_products").problems(256, 1, None)
    for record in products:
        a, b = map(int, re.findall(r"\d+", record["prompt"]))
        assert 2 <= a <= 9 and 10 <= b <= 60 and int(record["answer"]) == a * b
    assert len({r["prompt"] for r in products}) > 200  # names, items and numbers vary
    for record in TASKS.get("word_two_steps").problems(256, 1, None):
        a, b, c = map(int, re.findall(r"\d+", record["prompt"]))
        assert 2 <= a <= 9 and 2 <= b <= 9 and 1 <= c < a + b
        assert "gives" in record["prompt"] and int(record["answer"]) == a + b - c


def test_reverse_task_has_long_tailed_lengths():
    p = reverse_problems(4000, max_len=24, seed=1)
    assert all(x["prompt"] == f"r{x['answer'][::-1]}=" for x in p)
    lengths = sorted(len(x["answer"]) for x in p)
    assert lengths[0] == 1 and lengths[-1] == 24
    assert (
        lengths[len(lengths) // 2] <= 5 < 15 <= lengths[int(0.97 * len(lengths))]
    )  # median short, tail long


def test_token_packing():
    assert pack_by_tokens([5, 5, 5, 9], 15) == [[0, 1, 2], [3]]
    assert pack_by_tokens([20], 8) == [[0]]


def test_length_grouped_micro_batches_cover_every_row_once_without_padding_beyond_the_longest():
    lengths = torch.tensor([3, 9, 2, 7, 7, 1])
    mask = torch.arange(10)[None, :] < lengths[:, None]
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    groups = length_grouped_micro_batches(mask, rows, budget=16)
    assert sorted(torch.cat([g for g, _ in groups]).tolist()) == rows.tolist()
    assert [w for _, w in groups] == [int(lengths[g].max()) for g, _ in groups]
    assert all(len(g) * w <= 16 or len(g) == 1 for g, w in groups)
    # trimming the right padding does not change a log-prob
    from tidal.inference.tiny import tiny_llama

    model = tiny_llama(20, seed=0).eval()
    ids = torch.randint(3, 20, (6, 10))
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 1.0)
        for g, w in groups:
            part = token_logprobs(model, ids[g, :w], mask[g, :w], 1.0)
            assert torch.allclose(part, full[g, :w], atol=1e-5)


def test_llm_config_rules():
    with pytest.raises(ConfigError, match="algorithm.adv_type: expected one of .*got .gae."):
        check_llm(load_config(LLMConfig, None, ["algorithm.adv_type=gae"]))
    with pytest.raises(ConfigError, match="algorithm.prox_logp_method"):
        check_llm(load_config(LLMConfig, None, ["algorithm.prox_logp_method=guess"]))
    with pytest.raises(
        ConfigError, match="rollout.workflow: task 'arithmetic' runs the 'rlvr' workflow"
    ):
        check_llm(load_config(LLMConfig, None, ["rollout.workflow=multi_turn"]))
    with pytest.raises(
        ConfigError, match="data.task: expected one of arithmetic, guess_number, reverse"
    ):
        check_llm(load_config(LLMConfig, None, ["data.task=chess"]))
    with pytest.raises(ConfigError, match="cluster.placement: a data-parallel trainer"):
        check_llm(load_config(LLMConfig, None, ["cluster.placement={rollout: '0', actor: '1-2'}"]))
    with pytest.raises(
        ConfigError, match="rollout.batch_size: 9 sequences per step do not split evenly"
    ):
        check_llm(
            load_config(
                LLMConfig,
                None,
                [
                    "cluster.backend=ray",
                    "cluster.placement={rollout: '0', actor: '1-2'}",
                    "rollout.batch_size=3",
                    "rollout.group_size=3",
                ],
            )
        )


def test_dynamic_sampling_needs_groups_of_several_samples_or_runs():
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling: .*group_size > 1"):
        check_llm(
            load_config(LLMConfig, None, ["rollout.dynamic_sampling=true", "rollout.group_size=1"])
        )
    # multi-turn episodes and agents are groups of runs too: their zero-advantage groups drop
    for data in (["data.task=guess_number"], ["rollout.agent.command=[python, agent.py]"]):
        check_llm(load_config(LLMConfig, None, ["rollout.dynamic_sampling=true", *data]))


def test_overlong_shaping_falls_linearly_over_the_buffer():
    from tidal.rollout.workflows import overlong_penalty

    values = [overlong_penalty(n, max_tokens=20, buffer=8, factor=0.5) for n in (5, 12, 16, 20)]
    assert values == [0.0, 0.0, -0.25, -0.5]
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer: must be in \[0, rollout"):
        check_llm(
            load_config(LLMConfig, None, ["reward.overlong_buffer=64", "rollout.max_new_tokens=64"])
        )


def test_multi_turn_workflow_appends_feedback_with_loss_mask_zero():
    from tidal.inference import ModelResponse
    from tidal.inference.tiny import char_tokenizer
    from tidal.rollout.tasks import ARITH_ALPHABET
    from tidal.rollout.workflows import MultiTurnWorkflow

    tok = char_tokenizer(ARITH_ALPHABET)
    guesses = iter(["10", "60", "42"])

    class FakeClient:
        async def agenerate(self, req):
            out = tok.encode(next(guesses), add_special_tokens=False)
            return ModelResponse(
                input_tokens=req.input_ids,
                output_tokens=out,
                output_logprobs=[-0.5] * len(out),
                output_versions=[7] * len(out),
            )

    wf = MultiTurnWorkflow(
        FakeClient(),
        tok,
        lambda d: GuessNumberEnv(d["target"]),
        None,
        max_turns=5,
        turn_discount=0.5,
    )
    ep = asyncio.run(wf({"prompt": "guess?", "target": 42}))
    text = tok.decode(ep.input_ids[0].tolist(), skip_special_tokens=True)
    assert text == "guess?10 >60 <42"
    assert ep.rewards.tolist() == [0.25]  # success on the third turn: 1 * 0.5^2
    mask = ep.loss_mask[0].tolist()
    generated = [t for t, m in zip(ep.input_ids[0].tolist(), mask) if m]
    assert tok.decode(generated) == "106042"
    assert set(ep.versions[0][ep.loss_mask[0]].tolist()) == {7}
    assert set(ep.versions[0][~ep.loss_mask[0]].tolist()) == {-1}


def test_sft_demonstrations_match_the_multi_turn_episode_layout():
    """What ``tidal sft`` learns from is token for token what the workflow later trains on:
    the model turns (with EOS) are learned, prompt and feedback are not."""
    import random

    from tidal.inference import ModelResponse
    from tidal.inference.tiny import char_tokenizer
    from tidal.rollout.tasks import ARITH_ALPHABET, TASKS
    from tidal.rollout.workflows import MultiTurnWorkflow
    from tidal.runners.llm.sft import encode

    tok = char_tokenizer(ARITH_ALPHABET)
    record = {"prompt": "guess?", "target": 37}
    segments = TASKS.get("guess_number").demonstration(record, random.Random(5))
    turns = iter([text for text, learned in segments if learned])
    assert all(0 <= int(t) <= 99 for t in [text for text, learned in segments if learned])

    class Replay:
        async def agenerate(self, req):
            out = tok.encode(next(turns), add_special_tokens=False) + [tok.eos_token_id]
            return ModelResponse(
                input_tokens=req.input_ids,
                output_tokens=out,
                output_logprobs=[0.0] * len(out),
                output_versions=[0] * len(out),
            )

    wf = MultiTurnWorkflow(Replay(), tok, lambda d: GuessNumberEnv(d["target"]), None, max_turns=6)
    ep = asyncio.run(wf(record))
    ids, learned = encode(tok, segments)
    assert ep.input_ids[0].tolist()[: len(ids)] == ids
    assert ep.loss_mask[0].tolist()[: len(ids)] == learned
    # every guess is consistent with the feedback before it
    lo, hi = 0, 99
    for text, is_guess in segments[1:]:
        if is_guess:
            assert lo <= int(text) <= hi
            last = int(text)
        else:
            lo, hi = (last + 1, hi) if text == " >" else (lo, last - 1)
