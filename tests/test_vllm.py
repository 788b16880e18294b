"""vLLM as a rollout engine, for real (vLLM from its own virtualenv, built by `make vllm`; without
it these tests fail, never skip). One run of the arithmetic GRPO demo with rollout.engine=vllm
launches the server all the tests share: the run trains and vLLM serves the new weights; tidal's
client then drives that server directly (token ids in; tokens, sampled-distribution log-probs
and per-token weight versions out; pause, reload weights from a folder, resume); last, the
server is killed and the run's next call names it."""

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.config import load_config
from tidal.config.llm import LLMConfig
from tidal.inference import GenerationConfig, InferenceClient, ModelRequest
from tidal.inference.vllm import VLLMProtocol, VLLMServer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "llm" / "arith_grpo.yaml"
pytestmark = pytest.mark.timeout(600)  # the first test also waits for vLLM to start (~1-2 min)


def test_vllm_without_its_virtualenv_is_a_config_error(tmp_path):
    from tidal.config.loader import ConfigError
    from tidal.runners.llm.preflight import check_llm

    overrides = ["rollout.engine=vllm", f"rollout.vllm_python={tmp_path}/no/python"]
    with pytest.raises(ConfigError, match=r"rollout\.vllm_python: .*no/python does not exist"):
        check_llm(load_config(LLMConfig, None, overrides))
    with pytest.raises(ConfigError, match=r"rollout\.engine: expected one of tidal, vllm"):
        check_llm(load_config(LLMConfig, None, ["rollout.engine=sglang"]))


def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"vLLM exited with code 1 while starting; see .*vllm-\d+\.log"
    ):
        VLLMServer(tmp_path / "model", python="/bin/false", log_dir=str(tmp_path)).start(60)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The arithmetic demo's tiny Llama (head_dim 32, as vLLM's CPU attention needs) briefly
    warm-started by `tidal sft`, then two GRPO steps with rollout.engine=vllm: a vLLM server
    launched and supervised by the rollout rank. The reward (a low first digit) is one a barely
    trained model earns half the time, so that the updates move the weights."""
    from tidal.runners.llm.sft import run_sft
    from tidal.runners.llm.train import LLMRunner

    root = tmp_path_factory.mktemp("arith")
    model = root / "model"
    sft = [f"model.path={model}", "model.layers=2", "model.max_positions=256", "sft.steps=30"]
    run_sft(load_config(LLMConfig, DEMO, [*sft, "sft.eval_size=16"]))
    overrides = [
        f"model.path={model}",
        f"runner.run_dir={root}/runs",
        "runner.progress=false",
        "runner.max_steps=2",
        "runner.eval_interval=2",
        "runner.save_interval=0",
        "runner.timeout_s=300",
        "data.eval_size=8",
        "reward.name=regex_match",
        "reward.kwargs={pattern: '^[0-4]'}",
        "rollout.engine=vllm",
        "rollout.pause_mode=keep",
        "rollout.batch_size=4",
        "rollout.group_size=4",
        "rollout.max_concurrent_rollouts=8",
        "actor.lr=3e-3",
    ]
    runner = LLMRunner(load_config(LLMConfig, DEMO, overrides))
    try:
        summary = runner.run()
        yield runner, summary, model, overrides
    finally:
        runner.close()


def teacher_forced(model, prompt, output, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return (
        torch.log_softmax(logits / temperature, -1)
        .gather(1, torch.tensor(output)[:, None])
        .squeeze(1)
    )


def run_client(address, body):
    async def main():
        client = InferenceClient([address], protocol=VLLMProtocol(), max_retries=1)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def trained(runner):
    """The trainer's own weights (its rank 0's, after the run's last update: version 2), in
    fp32: what vLLM must serve. Not the folder vLLM reloads (a folder written wrong would
    agree with what vLLM serves from it); the folder gives only the architecture."""
    model = AutoModelForCausalLM.from_pretrained(runner.rollout.weights_dir).float().eval()
    weights = runner.actor.state_dict().wait(60)[0]
    model.load_state_dict(weights)  # strict: every weight the trainer has, none left as read
    return model


def test_the_demo_trains_and_vllm_serves_the_new_weights(run):
    runner, summary, start_model, _ = run
    rows = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, rows) if r["step"] >= 1]
    assert [r["version"] for r in steps] == [1, 2]
    assert "eval/accuracy" in steps[-1] and steps[0]["train/grad_norm"] > 0
    # the trainer's log-probs of vLLM's samples agree with vLLM's (behaviour weights ~ 1)
    assert abs(steps[0]["train/behave_weight_max"] - 1) < 1e-3  # all sampled by version 0

    request = ModelRequest([1, 5, 9], GenerationConfig(max_new_tokens=8, seed=3))
    out = runner._run(runner.client.agenerate(request))
    assert out.output_versions == [2] * 8
    got = torch.tensor(out.output_logprobs)
    on_new = teacher_forced(trained(runner), out.input_tokens, out.output_tokens)
    start = AutoModelForCausalLM.from_pretrained(start_model).eval()
    on_start = teacher_forced(start, out.input_tokens, out.output_tokens)
    assert (on_new - got).abs().max() < 1e-4
    assert (on_start - got).abs().max() > 1e-3


def test_tokens_and_the_sampled_distributions_log_probs(run):
    runner = run[0]
    model = trained(runner)

    async def body(client):
        greedy = await client.agenerate(
            ModelRequest([1, 5, 9], GenerationConfig(max_new_tokens=12, temperature=0))
        )
        sampled = await client.agenerate_n(
            ModelRequest([1, 7], GenerationConfig(max_new_tokens=12, temperature=0.7, seed=5)), 3
        )
        return greedy, sampled

    greedy, sampled = run_client(runner.client.addresses[0], body)
    ref = model.generate(
        torch.tensor([[1, 5, 9]]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert greedy.output_tokens == ref[0, 3:].tolist()
    assert len({tuple(r.output_tokens) for r in sampled}) > 1
    for resp in sampled:
        expected = teacher_forced(model, resp.input_tokens, resp.output_tokens, temperature=0.7)
        assert (expected - torch.tensor(resp.output_logprobs)).abs().max() < 1e-4
        assert resp.output_versions == [2] * 12


@pytest.fixture(scope="module")
def other_weights(run, tmp_path_factory):
    """Other weights of the same architecture, and the trained ones (version 2)."""
    model = trained(run[0])
    folder = tmp_path_factory.mktemp("other")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(model.config).save_pretrained(folder)
    return model, AutoModelForCausalLM.from_pretrained(folder).eval(), folder


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_weight_update_mid_generation_stamps_every_token(run, other_weights, mode):
    """8 prompts of 16 samples each keep vLLM generating for seconds (the tiny model makes 8
    sequences of 240 tokens in about one); the update is sent once vLLM's metrics show all 128
    running (vLLM does not stream here: the test cannot wait for tokens). Every attempt is
    checked in full; one whose update still landed before any sequence ran or after all had
    ended proves nothing mid-generation and repeats (3 attempts at most), and the failure shows
    where they were. Unseeded: vLLM 0.32's CPU worker dies on a seeded sequence whose sampled
    token it discards (a chunked prefill): `CPU Generator does not use offset`."""
    runner = run[0]
    old, new, new_dir = other_weights
    budget = 240  # the tiny Llama's 256 positions, less the prompt
    samples = 16

    async def body(client):
        tasks = [
            asyncio.create_task(
                client.agenerate_n(
                    ModelRequest([1, 4 + i, 6], GenerationConfig(max_new_tokens=budget)),
                    samples,
                )
            )
            for i in range(8)
        ]
        await _until_running(client.addresses[0], 8 * samples, tasks)
        await client.update_weights(version=3, model_path=str(new_dir), pause_mode=mode)
        responses = [r for group in await asyncio.gather(*tasks) for r in group]
        # restore the run's weights for the next attempt and the next test
        await client.update_weights(version=2, model_path=str(runner.rollout.weights_dir))
        return responses

    attempts = []
    for _attempt in range(3):
        responses = run_client(runner.client.addresses[0], body)
        cuts = [_check_versions_and_logprobs(old, new, budget, mode)(r) for r in responses]
        if any(0 < cut < budget for cut in cuts):
            return
        attempts.append(f"{cuts.count(0)} all new, {cuts.count(budget)} all old")
    pytest.fail(f"no sequence was mid-generation when the update landed: {'; '.join(attempts)}")


async def _until_running(address, sequences, tasks, timeout=120.0):
    """Until vLLM's ``num_requests_running`` gauge (one per sequence) reaches ``sequences``, or
    one of ``tasks`` has ended (too late to wait: the attempt's check decides)."""
    async with aiohttp.ClientSession() as http:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline and not any(t.done() for t in tasks):
            async with http.get(f"{address}/metrics") as resp:
                text = await resp.text()
            running = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.split("{")[0] == "vllm:num_requests_running"
            )
            if running >= sequences:
                return
            await asyncio.sleep(0.02)
    if not any(t.done() for t in tasks):
        pytest.fail(f"vLLM was not running {sequences} sequences within {timeout} s")


def _check_versions_and_logprobs(old, new, budget, mode):
    """Checks one response; returns how many of its tokens came before the update (version 2)."""

    def check(resp) -> int:
        assert resp.output_len == budget and resp.stop_reason == "length"
        v = resp.output_versions
        assert v == sorted(v) and set(v) <= {2, 3}
        cut = v.index(3) if 3 in v else len(v)
        if cut:
            ref = teacher_forced(old, resp.input_tokens, resp.output_tokens[:cut])
            assert (ref - torch.tensor(resp.output_logprobs[:cut])).abs().max() < 1e-4
        if cut < budget and mode == "abort":  # after an abort the new weights recompute it all
            ref = teacher_forced(
                new, resp.input_tokens + resp.output_tokens[:cut], resp.output_tokens[cut:]
            )
            assert (ref - torch.tensor(resp.output_logprobs[cut:])).abs().max() < 1e-4
        return cut

    return check


def test_vllm_takes_weights_from_a_folder_only(run):
    async def body(client):
        with pytest.raises(ValueError, match="give model_path"):
            await client.update_weights(version=3, state_dict={"w": torch.zeros(1)})

    run_client(run[0].client.addresses[0], body)


def test_a_run_connects_to_running_servers(run, tmp_path):
    """rollout.server_urls: no server launched; the run's weights reach the running one."""
    from tidal.runners.llm.train import LLMRunner

    runner, _, _, overrides = run
    [address] = runner.client.addresses
    other = LLMRunner(
        load_config(
            LLMConfig,
            DEMO,
            [
                *overrides,
                f"runner.run_dir={tmp_path}",
                "runner.max_steps=1",
                "runner.eval_interval=0",
                f"rollout.server_urls=['{address}']",
            ],
        )
    )
    try:
        summary = other.run()
        assert other.rollout.servers is None and summary["steps"] == 1
        out = other._run(other.client.agenerate(ModelRequest([1, 5], GenerationConfig(4))))
        assert out.output_versions == [1] * 4
        on_new = teacher_forced(trained(other), out.input_tokens, out.output_tokens)
        assert (on_new - torch.tensor(out.output_logprobs)).abs().max() < 1e-4
    finally:
        other.close()


def test_a_dead_server_is_named_with_its_rank_and_call(run):
    """Last: it kills the shared server."""
    from tidal.runners.loop import is_worker_fault
    from tidal.runtime.errors import WorkerError

    runner = run[0]
    [rank] = runner.rollout.servers._ranks  # a local rank: its worker is in this process
    server = rank.runner.worker.server
    os.killpg(server.process.pid, signal.SIGKILL)  # the server and its engine-core process
    server.process.wait(30)
    with pytest.raises(
        WorkerError, match=r"rollout\[rank 0\]\.pause_generation failed: ServerDied"
    ) as err:
        runner.rollout.pause("abort")
    assert is_worker_fault(err.value)
    assert "vllm-" in str(err.value)  # its log is named
