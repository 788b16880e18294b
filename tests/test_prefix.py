"""Shared-prompt packing (tidal.algorithms.prefix): a group's prompt computed once gives the
unpacked rows' log-probs and gradients, for sdpa and eager attention, with and without LoRA."""

import pytest
import torch
from test_tokens import tiny_llama

from tidal.algorithms.prefix import pack_shared_prefixes, shared_prefix_logprobs
from tidal.algorithms.tokens import token_logprobs


def grpo_rows():
    """Two groups of a 5-token prompt with answers of 3, 6 and 4 tokens; a row alone; and a
    group whose rows differ from their second token (nothing worth sharing)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 301, (5,), generator=g)
    other = torch.randint(0, 301, (5,), generator=g)
    specs = [(prompt, 3, 0), (prompt, 6, 0), (prompt, 4, 0), (other, 5, 1), (other, 2, 1)]
    specs += [(torch.randint(0, 301, (3,), generator=g), 4, 2)]
    specs += [(torch.tensor([7, 8]), 3, 3), (torch.tensor([7, 9]), 3, 3)]
    width = max(len(p) + n for p, n, _ in specs) + 1  # one column of padding at least
    ids = torch.zeros(len(specs), width, dtype=torch.long)
    mask = torch.zeros(len(specs), width, dtype=torch.bool)
    wanted = torch.zeros_like(mask)
    for r, (p, n, _) in enumerate(specs):
        ids[r, : len(p) + n] = torch.cat([p, torch.randint(0, 301, (n,), generator=g)])
        mask[r, : len(p) + n] = True
        wanted[r, len(p) : len(p) + n] = True
    return ids, mask, wanted, torch.tensor([s[2] for s in specs])


def test_a_group_shares_its_prompt_and_a_row_alone_packs_as_it_is():
    ids, mask, wanted, groups = grpo_rows()
    packed = pack_shared_prefixes(ids, mask, wanted, groups)
    # groups 0 and 1 pack once each; the lone row and group 3's two rows are packs of their own
    assert packed.input_ids.shape[0] == 5
    assert int(packed.wanted.sum()) == int(wanted.sum())
    assert int((packed.input_ids != 0).sum()) < int(mask.sum())  # fewer tokens than unpacked
    first = packed.position_ids[0]
    assert first[:4].tolist() == [0, 1, 2, 3] and first[4:8].tolist() == [4, 5, 6, 7]
    assert first[8] == 4  # the second answer starts at the prompt's last token again


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_unpacked_rows(lora, attention):
    model = tiny_llama(lora)
    model.config._attn_implementation = attention
    ids, mask, wanted, groups = grpo_rows()
    weights = torch.randn(ids.shape) * wanted

    def value_and_grads(fn, *extra):
        model.zero_grad()
        out = fn(model, ids, mask, *extra, 0.7, wanted=wanted)
        (out * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.detach(), grads

    want, want_grads = value_and_grads(token_logprobs)
    got, grads = value_and_grads(shared_prefix_logprobs, groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)


def test_micro_batches_keep_groups_whole_within_the_token_budget():
    from tidal.algorithms.prefix import group_micro_batches

    ids, mask, wanted, groups = grpo_rows()
    rows = torch.arange(len(ids))
    lengths = mask.sum(1).tolist()  # groups of 3, 2, 1, 2 rows: 35, 17, 7, 10 tokens
    batches = group_micro_batches(mask, groups, rows, budget=40)
    assert [b[0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert batches[0][1] == max(lengths[:3])
    assert [b[0].tolist() for b in group_micro_batches(mask, groups, rows, 1)] == [
        [0, 1, 2],
        [3, 4],
        [5],
        [6, 7],
    ]  # a group over the budget goes alone, never split


def test_shared_prefix_needs_an_attention_that_reads_a_4d_mask():
    from tidal.config import ConfigError, load_config
    from tidal.config.llm import LLMConfig
    from tidal.runners.llm.preflight import check_llm

    bad = ["actor.shared_prefix=true", "model.attn_implementation=flash_attention_2"]
    with pytest.raises(ConfigError, match=r"actor.shared_prefix: .*'flash_attention_2'"):
        check_llm(load_config(LLMConfig, None, bad))
    check_llm(load_config(LLMConfig, None, bad[:1]))


def test_shared_prefix_refuses_a_model_with_sliding_window_layers(tmp_path):
    """A packed row's block mask has no window: a windowed model would train on other
    log-probs than it samples with."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tidal.config import ConfigError, load_config
    from tidal.config.llm import LLMConfig
    from tidal.inference.tiny import save_tiny_model
    from tidal.runners.llm.preflight import check_llm_model, sliding_window_layers

    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=301)  # fmt: skip
    assert not sliding_window_layers(Qwen2Config(**config))
    windowed = Qwen2Config(**config, use_sliding_window=True, sliding_window=3)
    assert sliding_window_layers(windowed)
    Qwen2ForCausalLM(windowed).save_pretrained(tmp_path / "windowed")
    tiny = save_tiny_model(tmp_path / "tiny", hidden=16, layers=1, heads=2)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp_path / "windowed")
    keys = [f"model.path={tmp_path / 'windowed'}", "actor.shared_prefix=true"]
    cfg = load_config(LLMConfig, None, keys)
    with pytest.raises(ConfigError, match="actor.shared_prefix: .*sliding-window"):
        check_llm_model(cfg)
