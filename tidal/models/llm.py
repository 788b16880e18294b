"""Causal language models from Hugging Face folders, and prompts and SFT examples rendered with the
tokenizer's chat template.

Everything loads from local files only. :func:`check_causal_lm` validates ``model.path`` cheaply
(config, weights, tokenizer files; no weights are read) so a bad folder fails before any server
starts; :func:`load_causal_lm` loads the model and tokenizer. ``model.path`` may also name a GGUF
file or a packaged model (``tidal.models.gguf``): each of these reads the folder it stands for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tidal.extras import needs_extra
from tidal.models.chat_template import render_chat
from tidal.models.gguf import ModelSourceError, load_pretrained, model_folder

log = logging.getLogger(__name__)

# model.dtype -> what transformers' from_pretrained takes
DTYPES: dict[str, Any] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Messages = list[dict[str, str]]


class ModelConfigError(ValueError):
    """A model folder or option that does not fit; the message names the config key."""


def hf_folder(path: str | Path, key: str = "model.path") -> str:
    """The Hugging Face folder ``path`` names (a GGUF file or packaged model: its converted one)."""
    try:
        return model_folder(path, key)
    except ModelSourceError as exc:
        raise ModelConfigError(str(exc)) from None


def _causal_lm_classes() -> set[str]:
    with needs_extra("llm", "Hugging Face causal LMs"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def check_causal_lm(path: str | Path, key: str = "model.path"):
    """The folder's ``PretrainedConfig`` once it holds a causal language model, weights and a tokenizer."""
    with needs_extra("llm", "Hugging Face causal language models"):
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(hf_folder(path, key))
    if not folder.is_dir():
        raise ModelConfigError(
            f"{key}: no such folder {str(folder)!r} (a Hugging Face model folder, "
            "as save_pretrained writes it; nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise ModelConfigError(
            f"{key}: {str(folder)!r} has no config.json; it is not a Hugging Face model folder"
        )
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # an unknown model_type, a malformed config.json
        raise ModelConfigError(
            f"{key}: cannot read {str(folder / 'config.json')!r}: {exc}"
        ) from exc
    architectures = getattr(config, "architectures", None) or []
    if architectures and not set(architectures) & _causal_lm_classes():
        raise ModelConfigError(
            f"{key}: {str(folder)!r} holds a {', '.join(architectures)}, not a causal "
            "language model (a *ForCausalLM model)"
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelConfigError(
            f"{key}: model type {config.model_type!r} in {str(folder)!r} has no "
            "causal language model class in transformers"
        )
    for kind, names in (("weights", WEIGHT_FILES), ("tokenizer", TOKENIZER_FILES)):
        if not any((folder / name).is_file() for name in names):
            raise ModelConfigError(
                f"{key}: {str(folder)!r} has no {kind} (expected one of {', '.join(names)})"
            )
    return config


def check_load_options(dtype: str, attn_implementation: str | None) -> None:
    with needs_extra("llm", "Hugging Face causal LMs"):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if dtype not in DTYPES:
        raise ModelConfigError(f"model.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if attn_implementation is not None and attn_implementation not in known:
        raise ModelConfigError(
            f"model.attn_implementation: expected one of {', '.join(known)}, "
            f"got {attn_implementation!r}"
        )


def load_tokenizer(path: str | Path, key: str = "model.path"):
    """The folder's tokenizer; without a pad token, EOS pads (masks keep padding out of losses)."""
    with needs_extra("llm", "Hugging Face causal LMs"):
        from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_folder(path, key), local_files_only=True)
    except Exception as exc:
        raise ModelConfigError(f"{key}: cannot load a tokenizer from {str(path)!r}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    key: str = "model.path",
    weights: bool = True,
):
    """``(model, tokenizer)`` from a local folder; options go to ``from_pretrained``.
    ``weights=False``: the same model from the folder's config.json, its weights not read
    (a skeleton to build on the meta device, e.g. the ranks fsdp2 fills from rank 0)."""
    with needs_extra("llm", "Hugging Face causal LMs"):
        from transformers import AutoModelForCausalLM

    check_load_options(dtype, attn_implementation)
    path = hf_folder(path, key)
    config = check_causal_lm(path, key)
    tokenizer = load_tokenizer(path, key)
    try:
        if weights:
            model = load_pretrained(
                path,
                local_files_only=True,
                dtype=DTYPES[dtype],
                attn_implementation=attn_implementation,
            )
        else:
            model = AutoModelForCausalLM.from_config(
                config, dtype=config_dtype(config, dtype), attn_implementation=attn_implementation
            )
    except Exception as exc:
        raise ModelConfigError(
            f"{key}: cannot load a causal language model from {str(path)!r} (model.dtype={dtype}, "
            f"model.attn_implementation={attn_implementation}): {exc}"
        ) from exc
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model, tokenizer


def config_dtype(config, dtype: str) -> torch.dtype:
    """``model.dtype`` as a torch dtype; ``auto``: the one config.json records (else fp32)."""
    if DTYPES[dtype] == "auto":
        return getattr(config, "dtype", None) or torch.float32
    return DTYPES[dtype]


def enable_checkpointing(model) -> None:
    """Recompute activations in the backward pass (transformers 5 renamed gradient
    checkpointing to activation checkpointing)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # a KV cache is useless when training, and unsupported with it


# ---------------------------------------------------------------- chat templates


def require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelConfigError(
            f"data.chat_template: the tokenizer of {tokenizer.name_or_path!r} has no "
            "chat template; set data.chat_template=false or use a chat tokenizer"
        )


def as_messages(prompt: str | Messages, system: str | None = None) -> Messages:
    """A prompt as chat messages: a string is one user turn; ``system`` goes first unless the
    messages already start with a system turn (two system prompts are an error)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is None:
        return messages
    if messages and messages[0]["role"] == "system":
        raise ModelConfigError(
            "data.system_prompt: the record's messages already start with a system turn"
        )
    return [{"role": "system", "content": system}, *messages]


def prompt_answer_messages(record: dict, system: str | None = None) -> Messages:
    """A single-turn record (``prompt``, ``answer``) as an SFT conversation."""
    reply = {"role": "assistant", "content": str(record["answer"])}
    return [*as_messages(record["prompt"], system), reply]


def _render(
    tokenizer, messages: Messages, generation_prompt: bool, tools: list[dict] | None = None
) -> str:
    """Through the one renderer the OpenAI server and the session proxy use, so that a warm
    start learns the prompts (tool calls, tool results, tools) exactly as training sees them."""
    try:
        return render_chat(messages, tokenizer, generation_prompt, tools)
    except ValueError as exc:
        raise ModelConfigError(f"data: {exc}") from None


def render_prompt(
    tokenizer, prompt: str | Messages, system: str | None = None, chat_template: bool = True
) -> list[int]:
    """Token ids of a prompt ready for generation. With ``chat_template`` the tokenizer's template
    renders it (special tokens included) with the assistant's generation prompt; without, the
    plain text follows BOS (when the tokenizer has one)."""
    if chat_template:
        require_template(tokenizer)
        text = _render(tokenizer, as_messages(prompt, system), generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise ModelConfigError(
            "data.chat_template: a prompt made of chat messages needs data.chat_template=true"
        )
    if system is not None:
        raise ModelConfigError("data.system_prompt: a system prompt needs data.chat_template=true")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return bos + tokenizer.encode(prompt, add_special_tokens=False)


def _chat_segments(
    tokenizer, messages: Messages, tools: list[dict] | None = None
) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, trained)`` pieces by rendering every prefix
    and taking differences; trained pieces are assistant replies up to and including EOS (the
    generation prompt before and the template's text after are context)."""
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], True, tools)
            segments.append((_suffix(prompt, done), False))
            done = prompt
        rendered = _render(tokenizer, messages[: i + 1], False, tools)
        piece = _suffix(rendered, done)
        if message["role"] == "assistant":
            cut = _after_eos(piece, tokenizer.eos_token)
            segments += [(piece[:cut], True), (piece[cut:], False)]
        else:
            segments.append((piece, False))
        done = rendered
    return [(text, trained) for text, trained in segments if text]


def _suffix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ModelConfigError(
            "data.chat_template: the tokenizer's chat template renders earlier turns "
            "differently once later turns follow (e.g. it drops the thinking), so "
            "assistant turns cannot be masked by prefix"
        )
    return text[len(prefix) :]


def _after_eos(reply: str, eos: str | None) -> int:
    """Where the reply's EOS ends (its whole length when the template writes no EOS)."""
    at = reply.rfind(eos) if eos else -1
    return len(reply) if at < 0 else at + len(eos)


def sft_tokens(
    tokenizer, messages: Messages, system: str | None = None, tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation (and the ``tools`` it may call) rendered with
    the chat template; the mask is 1 exactly on the assistant replies' tokens (their tool calls
    and EOS included). Each piece is tokenized on its own, as at generation time, where the
    reply's tokens follow the prompt's."""
    require_template(tokenizer)
    if not any(m["role"] == "assistant" for m in messages):
        raise ModelConfigError(
            "data.messages_key: a conversation without an assistant turn has nothing to learn"
        )
    ids, mask = [], []
    for text, trained in _chat_segments(tokenizer, as_messages(messages, system), tools):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask
