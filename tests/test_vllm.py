"""vLLM as a rollout engine, for real: a vLLM server (from its own virtualenv) driven by tidal's
client: token ids in, tokens, sampled-distribution log-probs and per-token weight versions
out; pause, reload weights from a folder, resume."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.inference import GenerationConfig, InferenceClient, ModelRequest
from tidal.inference.tiny import save_tiny_model, tiny_llama
from tidal.inference.vllm import VLLMProtocol, VLLMServer, vllm_python

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM virtualenv (make vllm)"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    v0 = save_tiny_model(
        root / "v0", hidden=128, heads=4, seed=0
    )  # vLLM's CPU attention needs head_dim >= 32
    v1 = root / "v1"
    vocab = AutoModelForCausalLM.from_pretrained(v0).config.vocab_size
    tiny_llama(vocab, hidden=128, heads=4, seed=1).save_pretrained(v1)
    return v0, v1


class _Address:
    def __init__(self, address):
        self.address = address


@pytest.fixture(scope="module")
def server(model_dirs):
    """A vLLM server launched by a rollout rank (``VLLMServerWorker``) in a local cluster."""
    from tidal.runtime import Cluster
    from tidal.workers.inference_worker import VLLMServerWorker

    cluster = Cluster("local", devices_per_node=1)
    group = VLLMServerWorker.create_group(str(model_dirs[0]), max_model_len=256).launch(
        cluster, placement=1, name="vllm", launch_timeout=900
    )
    try:
        [address] = group.address().wait(timeout=60)
        assert group.alive().wait(timeout=60) == [True]
        yield _Address(address)
        group.shutdown_server().wait(timeout=60)
        assert group.alive().wait(timeout=60) == [False]
    finally:
        group.shutdown()
        cluster.shutdown()


def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"vLLM exited with code \d+ while starting; see .*vllm-\d+\.log"
    ):
        VLLMServer(tmp_path / "no-such-model", log_dir=str(tmp_path)).start(timeout=300)


def teacher_forced(model, prompt, output, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return (
        torch.log_softmax(logits / temperature, -1)
        .gather(1, torch.tensor(output)[:, None])
        .squeeze(1)
    )


def run_client(server, body):
    async def main():
        client = InferenceClient([server.address], protocol=VLLMProtocol(), max_retries=1)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_tokens_and_the_sampled_distributions_log_probs(server, model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()

    async def body(client):
        greedy = await client.agenerate(
            ModelRequest([1, 5, 9], GenerationConfig(max_new_tokens=12, temperature=0))
        )
        sampled = await client.agenerate_n(
            ModelRequest([1, 7], GenerationConfig(max_new_tokens=12, temperature=0.7, seed=5)), 3
        )
        return greedy, sampled

    greedy, sampled = run_client(server, body)
    ref = model.generate(
        torch.tensor([[1, 5, 9]]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert greedy.output_tokens == ref[0, 3:].tolist()
    assert len({tuple(r.output_tokens) for r in sampled}) > 1
    for resp in sampled:
        expected = teacher_forced(model, resp.input_tokens, resp.output_tokens, temperature=0.7)
        assert (expected - torch.tensor(resp.output_logprobs)).abs().max() < 1e-4
        assert resp.output_versions == [0] * 12


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_a_weight_update_mid_generation_stamps_every_token(server, model_dirs, mode):
    old = AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dirs[1]).eval()
    budget = 200

    async def body(client):
        tasks = [
            asyncio.create_task(
                client.agenerate(
                    ModelRequest([1, 4 + i, 6], GenerationConfig(max_new_tokens=budget, seed=i))
                )
            )
            for i in range(8)
        ]
        await asyncio.sleep(0.3)
        await client.update_weights(version=1, model_path=str(model_dirs[1]), pause_mode=mode)
        responses = await asyncio.gather(*tasks)
        await client.update_weights(
            version=0, model_path=str(model_dirs[0])
        )  # restore for the next test
        return responses

    responses = run_client(server, body)
    switched = 0
    for resp in responses:
        assert resp.output_len == budget and resp.stop_reason == "length"
        v = resp.output_versions
        assert v == sorted(v) and set(v) <= {0, 1}
        cut = v.index(1) if 1 in v else len(v)
        switched += 0 < cut < budget
        if cut:
            ref = teacher_forced(old, resp.input_tokens, resp.output_tokens[:cut])
            assert (ref - torch.tensor(resp.output_logprobs[:cut])).abs().max() < 1e-4
        if (
            cut < budget and mode == "abort"
        ):  # after an abort the new weights recompute the whole context
            ref = teacher_forced(
                new, resp.input_tokens + resp.output_tokens[:cut], resp.output_tokens[cut:]
            )
            assert (ref - torch.tensor(resp.output_logprobs[cut:])).abs().max() < 1e-4
    assert switched >= 1


def test_vllm_takes_weights_from_a_folder_only(server):
    async def body(client):
        with pytest.raises(ValueError, match="give model_path"):
            await client.update_weights(version=3, state_dict={"w": torch.zeros(1)})

    run_client(server, body)
