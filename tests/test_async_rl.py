"""Asynchronous RL for language agents: staleness manager, dispatcher, workflows, trainer, runner."""

import asyncio
import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tidal.algorithms.tokens import length_grouped_micro_batches, pack_by_tokens, token_logprobs
from tidal.asynchrony import StalenessManager
from tidal.config import ConfigError, load_config
from tidal.config.llm import LLMConfig
from tidal.data import LLMBatch, TokenSequence
from tidal.rollout.dispatcher import EpisodeError, RolloutDispatcher
from tidal.rollout.rewards import register_reward
from tidal.rollout.tasks import (
    GuessNumberEnv,
    arithmetic_problems,
    exact_match_reward,
    reverse_problems,
)
from tidal.runners.llm.preflight import check_llm

# ----------------------------------------------------------------------------- staleness


def test_capacity_formula_and_hooks():
    m = StalenessManager(max_staleness=2, consumer_batch_size=4, max_concurrent_rollouts=10)
    assert m.get_capacity() == min(10, (2 + 0 + 1) * 4)  # 10 vs 12
    for _ in range(10):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    assert m.get_capacity() == 0  # concurrency bound
    for _ in range(6):
        m.on_rollout_accepted()
    for _ in range(2):
        m.on_rollout_rejected()
    assert m.snapshot() == {"enqueued": 0, "running": 2, "accepted": 6, "rejected": 2}
    assert m.get_capacity() == min(10 - 2, 12 - (6 + 2))  # staleness bound: 4
    m.set_version(1)
    assert m.get_capacity() == min(8, 16 - 8)
    for _ in range(2):
        m.on_rollout_accepted()
    m.set_version(0)
    assert m.get_capacity() == 12 - 8 - 0 == 4
    for _ in range(6):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    assert m.get_capacity() == 12 - 14  # may be negative


def test_restore_after_resume_and_bad_arguments():
    m = StalenessManager(1, 8, 100)
    m.restore(5)
    assert m.snapshot()["accepted"] == 40 and m.get_version() == 5
    assert m.get_capacity() == (1 + 5 + 1) * 8 - 40
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(-1, 8, 8)


def test_counters_are_thread_safe():
    m = StalenessManager(0, 1, 10**6)

    def work():
        for _ in range(2000):
            m.on_rollout_enqueued()
            m.on_rollout_submitted()
            m.on_rollout_accepted()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.snapshot() == {"enqueued": 0, "running": 0, "accepted": 8000, "rejected": 0}


# ----------------------------------------------------------------------------- dispatcher


def test_dispatcher_respects_the_staleness_bound_and_keeps_the_stream():
    staleness = StalenessManager(
        max_staleness=1, consumer_batch_size=4, max_concurrent_rollouts=100
    )
    peak = {"admitted": 0}

    async def episode(x):
        s = staleness.snapshot()
        peak["admitted"] = max(peak["admitted"], s["accepted"] + s["running"])
        await asyncio.sleep(0.01)
        return {"x": x}

    d = RolloutDispatcher(episode, staleness)
    try:
        first = d.prepare_batch(range(1000), 4, timeout=30)
        assert [r["x"] for r in first] == [0, 1, 2, 3]  # oldest first
        assert peak["admitted"] <= (1 + 0 + 1) * 4
        staleness.set_version(1)
        d.wake()
        second = d.prepare_batch(range(1000), 4, timeout=30)
        assert [r["x"] for r in second] == [4, 5, 6, 7]  # the stream goes on, it does not restart
        assert peak["admitted"] <= (1 + 1 + 1) * 4
    finally:
        d.shutdown()


@pytest.mark.parametrize("eta, slow", [(1, {0}), (2, {0, 1})])
def test_no_episode_is_trained_more_than_max_staleness_versions_after_it_started(eta, slow):
    """The first episodes are slow: later ones finish first and fill batches, but a batch
    waits for them when taking it now would leave more of them at the end of their budget
    than the next batches hold (with eta 2, two slow episodes reached it in one batch)."""
    staleness = StalenessManager(
        max_staleness=eta, consumer_batch_size=1, max_concurrent_rollouts=3
    )

    async def episode(x):
        started = staleness.get_version()
        await asyncio.sleep(0.5 if x in slow else 0.01)
        return {"x": x, "started": started}

    d = RolloutDispatcher(episode, staleness)
    data, trained = iter(range(100)), []
    try:
        for version in range(6):
            staleness.set_version(version)
            d.wake()
            (result,) = d.prepare_batch(data, 1, timeout=30)
            trained.append((result["x"], version - result["started"]))
    finally:
        d.shutdown()
    assert trained[0][0] not in slow  # a later episode went first
    assert slow <= {x for x, _ in trained}
    assert 0 < max(late for _, late in trained) <= eta  # the slow ones: at most at its end


def test_a_batch_that_waits_for_a_hung_episode_at_its_budget_times_out_naming_it():
    staleness = StalenessManager(max_staleness=1, consumer_batch_size=1, max_concurrent_rollouts=2)

    async def episode(x):
        await asyncio.sleep(3600 if x == 0 else 0.01)
        return x

    d = RolloutDispatcher(episode, staleness)
    data = iter(range(100))
    try:
        assert d.prepare_batch(data, 1, timeout=30) == [1]
        staleness.set_version(1)
        d.wake()
        with pytest.raises(TimeoutError, match=r"1 running episode\(s\) near the end of their"):
            d.prepare_batch(data, 1, timeout=1)
    finally:
        d.shutdown()


def test_a_checkpoint_rereads_the_inputs_no_batch_has_used():
    staleness = StalenessManager(max_staleness=0, consumer_batch_size=2, max_concurrent_rollouts=4)

    async def episode(x):
        await asyncio.sleep(0.01)
        return None if x == 2 else x  # input 2 is turned away (e.g. dynamic sampling)

    d = RolloutDispatcher(episode, staleness)
    data = iter(range(100))
    try:
        assert d.prepare_batch(data, 2, timeout=30) == [0, 1]
        assert d.submitted >= 6 and d.inputs_to_reread() == d.submitted - 2  # 2 on: not used
        staleness.set_version(1)
        d.wake()
        assert d.prepare_batch(data, 2, timeout=30) == [3, 4]
        assert d.inputs_to_reread() == d.submitted - 5  # from 5 on; 2 was used up (rejected)
    finally:
        d.shutdown()


def test_rejections_are_counted_and_failures_name_the_episode():
    staleness = StalenessManager(0, 2, 4)

    async def episode(x):
        if x == 1:
            return None
        if x == 4:
            raise ZeroDivisionError("bad episode")
        return x

    d = RolloutDispatcher(episode, staleness)
    try:
        assert d.prepare_batch(iter([0, 1, 2]), 2, timeout=30) == [0, 2]
        assert staleness.snapshot()["rejected"] == 1
        staleness.set_version(1)
        with pytest.raises(
            EpisodeError,
            match=r"episode 4 failed: ZeroDivisionError: bad episode\n(.|\n)*Traceback",
        ):
            d.prepare_batch(iter([3, 4, 5, 6]), 2, timeout=30)
    finally:
        d.shutdown()


def test_paused_dispatcher_submits_nothing():
    staleness = StalenessManager(10, 10, 10)
    started = []

    async def episode(x):
        started.append(x)
        return x

    d = RolloutDispatcher(episode, staleness)
    try:
        d.pause()
        d.submit(1)
        with pytest.raises(TimeoutError, match="only 0 of 1 episodes"):
            d.wait_results(1, timeout=0.5)
        assert started == []
        d.resume()
        assert [r.result for r in d.wait_results(1, timeout=10)] == [1]
    finally:
        d.shutdown()


# ----------------------------------------------------------------------------- episodes and tasks


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


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def arith_model(tmp_path_factory):
    from tidal.runners.llm.sft import run_sft

    path = tmp_path_factory.mktemp("m") / "arith"
    cfg = load_config(
        LLMConfig,
        None,
        [
            f"model.path={path}",
            "model.hidden=32",
            "model.layers=1",
            "sft.steps=20",
            "sft.eval_size=16",
        ],
    )
    summary = run_sft(cfg)
    # 20 steps must already beat guessing uniformly over the vocabulary
    assert summary["final_loss"] < math.log(len(AutoTokenizer.from_pretrained(path))), summary
    return path


@pytest.mark.parametrize(
    "preset", ["sync", "throughput", "stable", "grpo", "dr_grpo", "dapo", "gspo", "cispo"]
)
def test_presets_run_the_async_loop_and_resume(arith_model, tmp_path, preset):
    from tidal.runners.llm.train import LLMRunner

    presets = Path(__file__).parent.parent / "examples" / "llm" / "presets"
    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=3",
        "runner.eval_interval=3",
        "data.eval_size=8",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "rollout.max_concurrent_rollouts=8",
        "runner.experiment=e",
    ]
    extra = ["algorithm.loss_agg=seq-mean-token-mean"] if preset == "stable" else []
    cfg = load_config(LLMConfig, presets / f"{preset}.yaml", overrides + extra)
    runner = LLMRunner(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] <= cfg.rollout.max_staleness for r in steps)
    assert "eval/accuracy" in steps[-1] and "train/tokens_per_s" in steps[-1]
    if preset == "sync":
        cfg = load_config(
            LLMConfig,
            presets / f"{preset}.yaml",
            overrides + ["runner.max_steps=4", f"runner.resume_from={summary['checkpoint']}"],
        )
        runner = LLMRunner(cfg)
        try:
            assert runner.staleness.snapshot()["accepted"] == 3 * 4 and runner.version == 3
            resumed = runner.run()
        finally:
            runner.close()
        assert resumed["steps"] == 4
    assert torch.isfinite(torch.tensor([r["train/policy_loss"] for r in steps])).all()


@register_reward("test_digit_share")
def _digit_share(completion: str, answer: str, **_) -> float:
    """A reward with spread for a model that rarely answers right: every step trains."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def test_a_synchronous_run_resumed_mid_way_ends_as_one_run_straight_through(arith_model, tmp_path):
    """8 episodes in flight read records ahead of each batch: the checkpoint rewinds over them,
    and each episode samples with seeds drawn from runner.seed and its record's place in the
    data stream, so the resumed run makes the same rollouts, rewards and weights."""
    from safetensors.torch import load_file

    from tidal.runners.llm.train import LLMRunner

    def run(name, steps, *extra):
        cfg = load_config(
            LLMConfig,
            Path(__file__).parent.parent / "examples" / "llm" / "presets" / "sync.yaml",
            [
                f"model.path={arith_model}",
                f"runner.run_dir={tmp_path / name}",
                "runner.progress=false",
                "runner.eval_interval=0",
                "runner.save_interval=2",
                f"runner.max_steps={steps}",
                "rollout.batch_size=4",
                "rollout.group_size=4",
                "rollout.max_concurrent_rollouts=8",
                "reward.name=test_digit_share",
                "actor.lr=1e-3",
                *extra,
            ],
        )
        with LLMRunner(cfg) as runner:
            summary = runner.run()
        rows = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        rewards = [json.loads(r)["rollout/reward_mean"] for r in rows if json.loads(r)["step"] >= 0]
        weights = load_file(Path(summary["checkpoint"]) / "model.safetensors")
        return rewards, weights

    straight = run("straight", 4)
    first_half = run("resumed", 2)[0]
    resumed = run("resumed", 4, "runner.resume_from=auto")
    assert len(set(straight[0])) > 1  # the rewards differ: the steps trained
    assert resumed[0] == straight[0] and first_half == straight[0][:2]
    assert all(torch.equal(straight[1][k], resumed[1][k]) for k in straight[1])


def test_the_same_experiment_twice_makes_two_run_folders(arith_model, tmp_path):
    from tidal.runners.llm.train import LLMRunner

    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=1",
        "runner.eval_interval=0",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "runner.experiment=twice",
    ]
    folders = []
    for _ in range(2):
        with LLMRunner(load_config(LLMConfig, None, overrides)) as runner:
            folders.append(Path(runner.run()["run_dir"]))
    assert [f.name for f in folders] == ["twice", "twice-2"]
    assert all(len((f / "metrics.jsonl").read_text().splitlines()) == 1 for f in folders)


@pytest.mark.ray
def test_ray_servers_and_a_sharded_data_parallel_trainer_run_the_loop_and_resume(
    ray_session, arith_model, tmp_path
):
    """The whole loop on Ray: a server process and two trainer ranks, FSDP2-sharded (every
    rank gathers the weights as rank 0 streams them to the server over the collective link;
    the checkpoint is sharded), in-place pauses, then a resume on the same layout. (Two DDP
    ranks take the same steps as one: test_data_parallel_trainer_takes_the_same_step_as_one_rank,
    and as FSDP2's: tests/test_strategies.py.)"""
    from tidal.runners.llm.train import LLMRunner

    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=2",
        "runner.eval_interval=2",
        "data.eval_size=8",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "rollout.max_staleness=1",
        "algorithm.use_decoupled_loss=true",
        "rollout.pause_mode=in_place",
        "cluster.backend=ray",
        "cluster.devices_per_node=3",
        "cluster.placement={rollout: '0', actor: '1-2'}",
        "actor.strategy=fsdp2",
    ]
    summaries = []
    for extra in ([], ["runner.max_steps=3"]):
        if summaries:
            extra.append(f"runner.resume_from={summaries[-1]['checkpoint']}")
        runner = LLMRunner(load_config(LLMConfig, None, overrides + extra))
        try:
            summaries.append(runner.run())
        finally:
            runner.close()
    rows = [
        json.loads(x)
        for x in (Path(summaries[-1]["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["version"] for r in rows if r["step"] >= 0] == [1, 2, 3]
    assert summaries[-1]["steps"] == 3 and Path(summaries[-1]["checkpoint"]).is_dir()


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


def _synthetic_batch(
    rows: int, width: int, vocab: int, seed: int = 0, group_size: int = 4
) -> LLMBatch:
    """Random rows in groups of ``group_size`` (the trainer config's rollout.group_size)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    attention = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = attention & (torch.arange(width)[None, :] >= 3)
    return LLMBatch(
        input_ids=torch.randint(3, vocab, (rows, width), generator=g) * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        logprobs=torch.where(loss_mask, -torch.rand(rows, width, generator=g) - 0.5, 0.0),
        versions=torch.where(loss_mask, 0, -1),
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        group_ids=torch.arange(rows) // group_size,
    )


def _trainer_config(model, loss_agg: str, *extra: str) -> LLMConfig:
    """A trainer for the synthetic batches: 16 rows in 2 minibatches, decoupled PPO."""
    return load_config(
        LLMConfig,
        None,
        [
            f"model.path={model}",
            "rollout.group_size=4",
            "rollout.batch_size=4",
            "actor.ppo_minibatches=2",
            f"algorithm.loss_agg={loss_agg}",
            "algorithm.use_decoupled_loss=true",
            "actor.lr=1e-3",
            *extra,
        ],
    )


@pytest.mark.ray
def test_data_parallel_trainer_takes_the_same_step_as_one_rank(ray_session, arith_model):
    """Two DDP ranks, each on its half of every minibatch, end a PPO step with the weights a
    single rank reaches on the whole batch: losses are weighted by global counts."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    vocab = AutoTokenizer.from_pretrained(arith_model).vocab_size
    batch = _synthetic_batch(16, 12, vocab)
    cluster = Cluster("ray", devices_per_node=3, ray_init_kwargs={"num_cpus": 2})
    try:
        # KL to a reference model shaping the reward, with groups that straddle the ranks
        # (token-mean), and LoRA adapters under DDP with the KL reference (in the loss) the base
        # with them disabled (seq-mean-token-mean: per-sequence global counts); each case starts
        # three processes, so each covers one aggregation
        cases = {
            "kl-in-reward": (
                "token-mean",
                [
                    "algorithm.kl_coef=0.5",
                    "algorithm.kl_in=reward",
                    "rollout.group_size=8",
                    "rollout.batch_size=2",
                ],
            ),
            "lora": ("seq-mean-token-mean", ["model.lora.rank=4", "algorithm.kl_coef=0.5"]),
        }
        for agg, (loss_agg, extra) in cases.items():
            cfg = _trainer_config(arith_model, loss_agg, "actor.max_tokens_per_mb=40", *extra)
            size = cfg.rollout.group_size  # the batch's groups as the config has them
            grouped = replace(batch, group_ids=torch.arange(len(batch)) // size)
            one = LLMActor.create_group(cfg).launch(cluster, "0", name=f"one-{agg}")
            two = LLMActor.create_group(cfg).launch(cluster, "1-2", name=f"two-{agg}")
            m1 = one.train_step(grouped).wait(120)[0]
            m2 = two.train_step(grouped).wait(120)
            w1 = one.state_dict().wait(60)[0]
            w2 = two.state_dict().wait(60)
            one.shutdown()
            two.shutdown()
            assert m2[0] == m2[1] and m1["train/tokens"] == m2[0]["train/tokens"], agg
            for name, value in w1.items():
                assert torch.equal(w2[0][name], w2[1][name]), (
                    agg,
                    name,
                )  # the ranks stay in lockstep
                assert torch.allclose(value, w2[0][name], atol=2e-6), (agg, name)
    finally:
        cluster.shutdown()


@pytest.mark.ray
def test_a_killed_inference_server_restarts_the_llm_run(ray_session, arith_model, tmp_path):
    """The inference server's Ray actor killed after the first checkpoint: the run restarts its
    groups, resumes from the newest checkpoint and finishes, each step logged once."""
    import time

    import ray

    from tidal.runners.llm.train import LLMRunner
    from tidal.runners.loop import run_with_restarts

    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=4",
        "runner.eval_interval=0",
        "runner.save_interval=1",
        "runner.max_restarts=1",
        "runner.timeout_s=60",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
    ]
    runners = []

    def kill_server_after_first_checkpoint():
        deadline = time.time() + 240
        while time.time() < deadline and not (
            runners and list(runners[0].run_dir.glob("checkpoints/step_000001"))
        ):
            time.sleep(0.05)
        ray.kill(runners[0].rollout.servers._ranks[0].actor, no_restart=True)

    killer = threading.Thread(target=kill_server_after_first_checkpoint, daemon=True)
    killer.start()
    summary = run_with_restarts(
        lambda c, run_dir: runners.append(LLMRunner(c, run_dir)) or runners[-1],
        load_config(LLMConfig, None, overrides),
    )
    killer.join(5)
    assert summary["restarts"] == 1 and summary["steps"] == 4 and len(runners) == 2
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_language_step_does_not_depend_on_the_micro_batch_split(arith_model, loss_agg):
    """Micro-batches packed by a token budget of 400 (one per minibatch) or 40 (several, of
    unequal token counts), decoupled PPO with behaviour-capped tokens: the same weights."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    vocab = AutoTokenizer.from_pretrained(arith_model).vocab_size
    batch = _synthetic_batch(16, 12, vocab, seed=3)
    g = torch.Generator().manual_seed(4)  # behaviour log-probs far from the model's: some capped
    batch.logprobs = torch.where(batch.loss_mask, -5 * torch.rand(16, 12, generator=g) - 1, 0.0)
    weights = {}
    cluster = Cluster("local")
    try:
        for budget in (400, 40):
            cfg = _trainer_config(
                arith_model,
                loss_agg,
                f"actor.max_tokens_per_mb={budget}",
                "algorithm.behav_weight_cap=1.5",
            )
            group = LLMActor.create_group(cfg).launch(cluster, "0", name=f"budget{budget}")
            metrics = group.train_step(batch).wait(120)[0]
            assert 0 < metrics["train/behave_capped_frac"] < 1
            weights[budget] = group.state_dict().wait(60)[0]
            group.shutdown()
    finally:
        cluster.shutdown()
    for name, value in weights[400].items():
        torch.testing.assert_close(weights[40][name], value, rtol=1e-5, atol=2e-6)


def test_a_host_resident_kl_reference_trains_bitwise_as_one_on_the_device(arith_model):
    """actor.ref_offload: the reference copy waits in host memory between its passes (its
    storages hold nothing after a step) and two steps take exactly the weights they take with
    the reference kept on the device; actor.offload takes the copy off with the engine."""
    from tidal.runtime import Cluster
    from tidal.workers.llm_actor import LLMActor

    batch = _synthetic_batch(16, 12, AutoTokenizer.from_pretrained(arith_model).vocab_size)
    kl = ["algorithm.kl_coef=0.5", "algorithm.kl_in=reward"]
    runs = {}
    cluster = Cluster("local")
    try:
        for parked in (False, True):
            cfg = _trainer_config(arith_model, "token-mean", *kl, f"actor.ref_offload={parked}")
            group = LLMActor.create_group(cfg).launch(cluster, "0", name=f"parked{parked}")
            metrics = [group.train_step(batch).wait(120)[0] for _ in range(2)]
            resident = group.reference_bytes().wait(30)[0]
            assert (resident == 0) == parked, resident
            if not parked:  # the collocated phase takes the reference off with the engine
                assert group.offload_engine().wait(30)[0] > 0
                assert group.reference_bytes().wait(30)[0] == 0
                group.onload_engine().wait(30)
                assert group.reference_bytes().wait(30)[0] == resident
            runs[parked] = metrics, group.state_dict().wait(60)[0]
            group.shutdown()
    finally:
        cluster.shutdown()
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name


def test_dynamic_sampling_keeps_the_batch_size_and_never_trains_on_a_filtered_group():
    """DAPO: groups with equal rewards are turned away and more prompts are drawn until the
    batch is full; the turned-away groups are counted and leave room under the staleness bound."""
    from tidal.rollout.workflows import has_reward_spread

    staleness = StalenessManager(max_staleness=0, consumer_batch_size=4, max_concurrent_rollouts=3)

    async def episode(x):  # every third prompt's group is all-correct: nothing to learn
        rewards = torch.ones(4) if x % 3 == 0 else torch.tensor([1.0, 0.0, 0.0, 1.0])
        return LLMBatch(
            input_ids=torch.zeros(4, 2, dtype=torch.long),
            attention_mask=torch.ones(4, 2, dtype=torch.bool),
            loss_mask=torch.ones(4, 2, dtype=torch.bool),
            logprobs=torch.zeros(4, 2),
            versions=torch.zeros(4, 2, dtype=torch.long),
            rewards=rewards,
        ), x

    d = RolloutDispatcher(episode, staleness, should_accept=lambda r: has_reward_spread(r[0]))
    try:
        batch = d.prepare_batch(range(100), 4, timeout=30)
        assert [x for _, x in batch] == [1, 2, 4, 5]
        assert all(has_reward_spread(b) for b, _ in batch)
        assert d.filtered >= 2 and staleness.snapshot()["rejected"] == d.filtered
    finally:
        d.shutdown()


def test_dynamic_sampling_needs_groups_of_single_turn_samples():
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling: .*group_size > 1"):
        check_llm(
            load_config(LLMConfig, None, ["rollout.dynamic_sampling=true", "rollout.group_size=1"])
        )


def test_overlong_shaping_falls_linearly_over_the_buffer():
    from tidal.rollout.workflows import overlong_penalty

    values = [overlong_penalty(n, max_tokens=20, buffer=8, factor=0.5) for n in (5, 12, 16, 20)]
    assert values == [0.0, 0.0, -0.25, -0.5]
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer: must be in \[0, rollout"):
        check_llm(
            load_config(LLMConfig, None, ["reward.overlong_buffer=64", "rollout.max_new_tokens=64"])
        )
