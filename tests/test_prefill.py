"""The generation engine's prefill: what it asks of the model."""

import asyncio

import torch
from transformers import AutoModelForCausalLM

from tidal.inference import GenerationEngine
from tidal.inference.params import GenerationConfig
from tidal.inference.protocol import generate_all
from tidal.inference.tiny import save_tiny_model


def run(coro):
    return asyncio.run(coro)


def test_a_prefill_computes_the_logits_of_the_last_position_only(tmp_path):
    """The prompt's other positions' logits ([B, L, vocab]) are never sampled from: the model
    is asked for the last one alone, and the tokens are those of the full pass."""
    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    engine = GenerationEngine(model_dir)
    widths = []
    forward = engine.model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        widths.append((kwargs["input_ids"].shape[1], out.logits.shape[1]))
        return out

    engine.model.forward = recording
    prompt = [1, 3, 3, 3, 3, 8, 20, 11]
    try:
        got = run(
            generate_all(
                engine, [(prompt, GenerationConfig(max_new_tokens=4, temperature=0), None)]
            )
        )
    finally:
        engine.close()
    assert widths[0] == (len(prompt), 1) and all(w == (1, 1) for w in widths[1:]), widths
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[
        0, len(prompt) :
    ]
    assert got[0].output_ids == ref.tolist()


def test_requests_sharing_a_prompt_prefill_it_once_and_sample_as_if_alone(tmp_path):
    """A GRPO group's samples ask with one prompt: it goes through the model once (the
    engine's prefilled_tokens), and each request still samples with its own seed, its tokens
    those it samples when it comes alone."""
    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    shared, other = [1, 3, 3, 8, 20, 11], [1, 5, 9]

    def ask(prompts_and_seeds):
        engine = GenerationEngine(model_dir)
        try:
            requests = [
                (p, GenerationConfig(max_new_tokens=6, temperature=1.0, seed=s), None)
                for p, s in prompts_and_seeds
            ]
            results = run(generate_all(engine, requests))
            return [r.output_ids for r in results], engine.stats["prefilled_tokens"]
        finally:
            engine.close()

    asks = [(shared, 1), (shared, 2), (other, 3), (shared, 4)]
    together, prefilled = ask(asks)
    assert prefilled == len(shared) + len(other)
    alone = [ask([one])[0][0] for one in asks]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the seeds differ: so do the samples


def test_a_prompt_asked_again_with_the_same_weights_is_not_prefilled_again(tmp_path):
    """Requests that arrive apart (as a group's samples do over HTTP) find their prompt in the
    engine's prompt cache; new weights compute it anew, and its tokens are those of a fresh
    engine's."""
    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    prompt = [1, 3, 3, 8, 20, 11]
    greedy = GenerationConfig(max_new_tokens=5, temperature=0)
    engine = GenerationEngine(model_dir)
    try:
        first = run(generate_all(engine, [(prompt, greedy, None)]))[0].output_ids
        again = run(generate_all(engine, [(prompt, greedy, None)] * 2))
        assert engine.stats["prefilled_tokens"] == len(prompt)  # computed once for all three
        assert [r.output_ids for r in again] == [first, first]
        engine.pause()
        engine.update_weights(
            {k: v.clone() for k, v in engine.model.state_dict().items()}, weight_version=1
        )
        engine.resume()
        run(generate_all(engine, [(prompt, greedy, None)]))
        assert engine.stats["prefilled_tokens"] == 2 * len(prompt)  # the new weights' own
    finally:
        engine.close()
