"""Tiny causal language models and tokenizers built locally (nothing is downloaded): for tests, demos and
benchmarks on a CPU. ``save_tiny_model`` writes a character-level Llama; ``save_tiny_chat_model``
writes a Qwen2 with a byte-level BPE tokenizer and a ChatML chat template, a folder that loads
like any Hugging Face chat model."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tidal.extras import needs_extra

with needs_extra("llm", "tiny Hugging Face models"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus ``<pad>``, ``<bos>``, ``<eos>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def _tiny_sizes(vocab_size: int, hidden: int, layers: int, heads: int, max_positions: int) -> dict:
    """The shape every tiny decoder here shares (GQA with half the heads, untied embeddings)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
    }


def tiny_llama(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    import torch

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **_tiny_sizes(vocab_size, hidden, layers, heads, max_positions),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


def save_tiny_model(
    path: str | Path, alphabet: str = "0123456789+=-*<>?abcdefghijklmnopqrstuvwxyz ", **kwargs
) -> Path:
    path = Path(path)
    tokenizer = char_tokenizer(alphabet)
    model = tiny_llama(len(tokenizer), **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ChatML, as Qwen writes it, after a BOS: the template (not the caller) adds every special token
CHATML_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML with tools the way Qwen 2.5 lays them out (Hermes tool calls): the tools' schemas in a
# system turn, each call as <tool_call>{json}</tool_call>, tool results as <tool_response> turns
TOOLS_CHATML_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}{%- for t in tools %}{{- t['function'] | tojson }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + m['content'] }}"
    "{%- for c in m['tool_calls'] or [] %}"
    "{{- '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{- c['function']['arguments'] | tojson }}{{- '}</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_SPECIALS = {
    "pad_token": "<|endoftext|>",
    "bos_token": "<|startoftext|>",
    "eos_token": "<|im_end|>",
}


def byte_level_tokenizer(
    corpus: Iterable[str] = (), vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes; GPT-2's byte alphabet) whose merges are
    trained on ``corpus`` up to ``vocab_size`` (no merges for an empty corpus), with ChatML's
    special tokens (``<|im_end|>`` is EOS) and ``chat_template``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [*CHAT_SPECIALS.values(), "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, **CHAT_SPECIALS, additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = chat_template
    return fast


def tiny_qwen2(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    special_ids: dict[str, int] | None = None,
) -> Qwen2ForCausalLM:
    """A tiny Qwen2; head_dim = hidden / heads (32 by default: vLLM's CPU kernels reject 16)."""
    import torch

    torch.manual_seed(seed)
    ids = special_ids or {}
    cfg = Qwen2Config(
        **_tiny_sizes(vocab_size, hidden, layers, heads, max_positions),
        **ids,
    )
    return Qwen2ForCausalLM(cfg)


def save_tiny_chat_model(
    path: str | Path,
    corpus: Iterable[str] = (),
    vocab_size: int = 512,
    chat_template: str = CHATML_TEMPLATE,
    **kwargs,
) -> Path:
    """A Qwen2 folder with a chat tokenizer, loadable with ``AutoModelForCausalLM`` /
    ``AutoTokenizer`` (``local_files_only=True``); ``kwargs`` go to :func:`tiny_qwen2`.
    ``TOOLS_CHATML_TEMPLATE`` renders tools and tool calls as Qwen does."""
    path = Path(path)
    tokenizer = byte_level_tokenizer(corpus, vocab_size, chat_template)
    special_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    model = tiny_qwen2(len(tokenizer), special_ids=special_ids, **kwargs)
    model.generation_config.update(**special_ids)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
