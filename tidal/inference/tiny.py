"""Tiny causal LMs and a character-level tokenizer built locally (nothing is downloaded): for
tests, demos and benchmarks on a CPU."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus ``<pad>``, ``<bos>``, ``<eos>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_llama(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, max_positions: int = 256,
               seed: int = 0) -> LlamaForCausalLM:
    import torch

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


def save_tiny_model(path: str | Path, alphabet: str = "0123456789+=-*<>?abcdefghijklmnopqrstuvwxyz ", **kwargs) -> Path:
    path = Path(path)
    tokenizer = char_tokenizer(alphabet)
    model = tiny_llama(len(tokenizer), **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
