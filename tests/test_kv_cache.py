"""The engine's batch KV cache: layers that grow in place instead of by concatenation."""

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tidal.inference import kv_cache
from tidal.inference.kv_cache import GrowingCache, keep_rows, merge_caches
from tidal.inference.tiny import save_tiny_model


def layer_tensors(batch=2, heads=3, length=5, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, length, dim, generator=g),
             torch.randn(batch, heads, length, dim, generator=g)) for _ in range(2)]  # fmt: skip


def test_a_growing_layer_holds_what_concatenation_holds_through_growth(monkeypatch):
    """Step by step, past its first buffer's room, the layer returns what DynamicLayer's
    concatenation returns; the buffer is reallocated only when full."""
    monkeypatch.setattr(kv_cache, "ROOM", 3)
    start = layer_tensors()
    growing, reference = GrowingCache(start), DynamicCache(start)
    buffers = []
    for step in range(12):
        new = layer_tensors(length=1 + step % 2, seed=step + 1)
        for i, (k, v) in enumerate(new):
            got, want = growing.update(k, v, i), reference.update(k, v, i)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        buffers.append(growing.layers[0]._buffers[0].data_ptr())
    assert growing.get_seq_length() == reference.get_seq_length() == 5 + 18
    assert 1 < len(set(buffers)) < len(buffers)  # grew, but not at every step


def test_a_growing_layer_adopts_keys_a_dynamic_layer_method_replaced():
    """``batch_select_indices`` (a DynamicLayer method) replaces the keys: the next update
    builds on them, not on the stale buffer."""
    cache = GrowingCache(layer_tensors())
    cache.layers[0].batch_select_indices(torch.tensor([1]))
    k, v = layer_tensors(batch=1, length=1, seed=9)[0]
    keys, values = cache.layers[0].update(k, v)
    assert torch.equal(keys, torch.cat([layer_tensors()[0][0][1:], k], 2))
    assert torch.equal(values, torch.cat([layer_tensors()[0][1][1:], v], 2))


@torch.no_grad()  # as the engine decodes
def test_a_batch_that_grows_joins_and_drops_rows_decodes_each_row_as_alone(tmp_path, monkeypatch):
    """Greedy decoding through the engine's cache (rows joined by merge, one dropped by keep,
    buffers growing every 2 columns) gives each row the logits it gets decoded alone."""
    monkeypatch.setattr(kv_cache, "ROOM", 2)
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", seed=0))
    key = kv_cache.cache_key(model)

    def prefill(ids):
        out = model(input_ids=torch.tensor(ids), use_cache=True)
        layers = [(k, v) for k, v, *_ in getattr(out, key)]
        return layers, out.logits[:, -1]

    def alone(prompt, steps):
        layers, last = prefill([prompt])
        cache, logits = DynamicCache(layers), [last[0]]
        for _ in range(steps):
            out = model(input_ids=last.argmax(-1)[:, None], use_cache=True, **{key: cache})
            cache, last = getattr(out, key), out.logits[:, -1]
            logits.append(last[0])
        return logits

    prompts = [[1, 5, 7, 9, 2], [1, 2, 3, 4, 6]]
    layers, last = prefill(prompts)
    mask = torch.ones(2, 5, dtype=torch.long)
    joined, joined_last = prefill([[1, 8, 8]])  # a shorter prompt joins: left-padded
    cache, mask = merge_caches(GrowingCache(layers), mask, GrowingCache(joined), mask[:1, :3])
    last, rows = torch.cat([last, joined_last]), [[] for _ in range(3)]
    live = [0, 1, 2]
    for step in range(6):
        for row, logits in zip(live, last):
            rows[row].append(logits)
        if step == 3:  # the middle row finishes
            cache, mask = keep_rows(cache, mask, [0, 2])
            live, last = [0, 2], last[[0, 2]]
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long)], 1)
        out = model(input_ids=last.argmax(-1)[:, None], attention_mask=mask,
                    position_ids=mask.sum(1, keepdim=True) - 1, use_cache=True, **{key: cache})  # fmt: skip
        cache, last = getattr(out, key), out.logits[:, -1]
    assert isinstance(cache, GrowingCache)
    for row, prompt, steps in zip(rows, prompts + [[1, 8, 8]], (5, 3, 5)):
        assert torch.allclose(torch.stack(row), torch.stack(alone(prompt, steps)), atol=1e-5)


def test_cropping_a_growing_layer_forgets_columns_in_place():
    """``crop(-n)`` (as a benchmark repeating a decode step calls it) keeps the buffer: the
    next step writes over the forgotten column, no copy."""
    (keys, values), _ = layer_tensors()
    layer = GrowingCache([(keys, values)]).layers[0]
    buffer = layer._buffers[0].data_ptr()
    for seed in (1, 2):
        k, v = layer_tensors(length=1, seed=seed)[0]
        got, _ = layer.update(k, v)
        layer.crop(-1)
    assert torch.equal(got, torch.cat([keys, k], 2)) and layer.get_seq_length() == 5
    assert layer._buffers[0].data_ptr() == buffer
