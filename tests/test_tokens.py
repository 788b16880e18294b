"""Chosen-token log-probs computed chunk by chunk over the sequence (tidal.algorithms.tokens):
the same values and gradients as the whole ``[B, L, vocab]`` form, for a plain model, one with
LoRA adapters, and at a temperature."""

import pytest
import torch

from tidal.algorithms.tokens import token_logprobs


def whole_logprobs(model, input_ids, attention_mask, temperature):
    """The unchunked definition: every position's logits at once."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def tiny_llama(lora: bool, targets=("q_proj", "v_proj")):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=301,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
        for name, p in model.named_parameters():  # adapters start as a no-op: move them
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    return model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_whole_form(lora, temperature):
    model = tiny_llama(lora)
    ids = torch.randint(0, 301, (3, 11))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 8:] = False  # right padding, as micro-batches have
    weights = torch.randn(3, 11)

    def value_and_grads(fn, **kw):
        model.zero_grad()
        out = fn(model, ids, mask, temperature, **kw)
        (out * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.detach(), grads

    want, want_grads = value_and_grads(whole_logprobs)
    for chunk_tokens in (3, 7, 1024):  # 1, 2 and all 10 positions per chunk over 3 rows
        got, got_grads = value_and_grads(token_logprobs, chunk_tokens=chunk_tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys() and want_grads
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, ids, mask, temperature, 5), want)


@pytest.mark.parametrize("lora", [False, True])
def test_logprobs_of_the_wanted_positions_only_equal_the_whole_form_there(lora):
    """``wanted`` (the generated tokens): those positions' values and the gradients of a loss
    on them are the whole form's; every other position is 0 and feeds no gradient."""
    model = tiny_llama(lora)
    ids = torch.randint(0, 301, (3, 11))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 8:] = False
    wanted = torch.zeros_like(mask)
    wanted[0, 4:8], wanted[1, 6:], wanted[2, 2:] = True, True, True  # prompts of 4, 6, 2
    weights = torch.randn(3, 11) * wanted

    def value_and_grads(fn, **kw):
        model.zero_grad()
        out = fn(model, ids, mask, 0.7, **kw)
        (out * weights).sum().backward()
        return out.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    want, want_grads = value_and_grads(whole_logprobs)
    for chunk_tokens in (5, 1024):
        got, grads = value_and_grads(token_logprobs, chunk_tokens=chunk_tokens, wanted=wanted)
        torch.testing.assert_close(got, torch.where(wanted, want, 0.0), rtol=1e-5, atol=1e-5)
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def test_backward_keeps_no_vocabulary_wide_activation():
    """What autograd keeps for the backward pass (its saved tensors): the whole form keeps the
    batch's float logits (and more); the chunked form keeps no tensor as wide as the
    vocabulary, each chunk's logits being recomputed in the backward pass."""
    model = tiny_llama(lora=False)
    ids = torch.randint(0, 301, (8, 64))
    mask = torch.ones_like(ids, dtype=torch.bool)

    def vocabulary_wide_bytes(fn, **kw):
        sizes = []

        def pack(t):
            if t.dim() == 3 and t.shape[-1] == 301:
                sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(model, ids, mask, 1.0, **kw).sum()
        return sum(sizes)

    assert vocabulary_wide_bytes(whole_logprobs) >= 8 * 63 * 301 * 4
    assert vocabulary_wide_bytes(token_logprobs, chunk_tokens=64) == 0


def test_the_reference_with_adapters_disabled_projects_with_them_disabled_too():
    """The KL reference of a LoRA model (its adapters off for the call, the head's included)
    gives the base model's log-probs, not the adapted ones."""
    from tidal.models.lora import AdaptersDisabled

    model = tiny_llama(lora=True, targets=("q_proj", "lm_head"))
    ids = torch.randint(0, 301, (2, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        with model.disable_adapter():
            base = whole_logprobs(model, ids, mask, 1.0)
        adapted = whole_logprobs(model, ids, mask, 1.0)
        got = token_logprobs(AdaptersDisabled(model), ids, mask, 1.0, chunk_tokens=4)
    assert not torch.allclose(base, adapted, atol=1e-3)  # the adapters do change the output
    torch.testing.assert_close(got, base)


def test_rows_with_nothing_wanted_give_zeros_that_still_backpropagate():
    """A micro-batch whose rows have no generated token (e.g. an agent's empty completions)
    gives zeros, in float32 whatever the model's dtype, on the graph: its loss of 0 steps."""
    model = tiny_llama(lora=False).to(torch.bfloat16)
    ids = torch.randint(0, 301, (2, 6))
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = token_logprobs(model, ids, mask, 1.0, wanted=torch.zeros_like(mask))
    assert out.dtype == torch.float32 and not out.any()
    out.sum().backward()  # no "does not require grad"
