import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, ViTConfig

from tidal.inference.tiny import char_tokenizer, save_tiny_chat_model
from tidal.models.llm import (
    ModelConfigError,
    check_causal_lm,
    load_causal_lm,
    load_tokenizer,
    prompt_answer_messages,
    render_prompt,
    sft_tokens,
)

DATA = Path(__file__).resolve().parents[1] / "examples" / "llm" / "data"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    corpus = [
        json.loads(line)["answer"] for line in (DATA / "train.jsonl").read_text().splitlines()
    ]
    return save_tiny_chat_model(
        tmp_path_factory.mktemp("models") / "chat", corpus=corpus, vocab_size=400
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def test_tiny_chat_model_loads_with_auto_classes(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (
        model.config.hidden_size == 64
        and model.config.hidden_size // model.config.num_attention_heads >= 16
    )
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    text = "Ava earns 12 * 3 = 36 dollars. ünïcode ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte level: any text
    assert len(tok.encode("The packs hold", add_special_tokens=False)) < len(
        "The packs hold"
    )  # merges
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_load_causal_lm_options(model_dir):
    model, tok = load_causal_lm(model_dir)
    assert next(model.parameters()).dtype == torch.float32 and tok.eos_token == "<|im_end|>"
    model, _ = load_causal_lm(
        model_dir, dtype="bfloat16", attn_implementation="eager", gradient_checkpointing=True
    )
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert model.model.gradient_checkpointing and not model.config.use_cache
    model.train()
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_the_trainer_and_the_engine_load_without_a_progress_bar(model_dir, capfd):
    """transformers draws a bar per load ("Loading weights: 100%|...") into every worker's log."""
    from transformers.utils import logging as hf_logging

    from tidal.inference import GenerationEngine

    hf_logging.enable_progress_bar()
    load_causal_lm(model_dir)
    GenerationEngine(model_dir).close()
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"dtype": "float64"},
            "model.dtype: expected one of float32, bfloat16, float16, auto, got 'float64'",
        ),
        ({"attn_implementation": "flash"}, "model.attn_implementation: expected one of eager, "),
    ],
)
def test_bad_options_name_their_key(model_dir, kwargs, message):
    with pytest.raises(ModelConfigError, match=message):
        load_causal_lm(model_dir, **kwargs)


def test_bad_folders_name_model_path(tmp_path, model_dir):
    with pytest.raises(ModelConfigError, match=r"model.path: no such folder '.*missing'"):
        check_causal_lm(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match="model.path: .*empty' has no config.json"):
        load_causal_lm(tmp_path / "empty")
    BertConfig(architectures=["BertForSequenceClassification"]).save_pretrained(tmp_path / "bert")
    with pytest.raises(
        ModelConfigError,
        match="model.path: .*bert' holds a BertForSequenceClassification, not a causal language model",
    ):
        check_causal_lm(tmp_path / "bert")
    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(
        ModelConfigError, match="model.path: model type 'vit' .* has no causal language model class"
    ):
        check_causal_lm(tmp_path / "vit")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "no_weights")
    with pytest.raises(ModelConfigError, match="model.path: .*no_weights' has no weights"):
        check_causal_lm(tmp_path / "no_weights")
    assert check_causal_lm(model_dir).model_type == "qwen2"


def test_render_prompt_with_the_chat_template(tokenizer):
    ids = render_prompt(tokenizer, "2+2?", system="Be brief.")
    assert tokenizer.decode(ids) == (
        "<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == render_prompt(tokenizer, CHAT[:2])  # chat messages render the same
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, not another one


def test_render_prompt_plain_text(tokenizer):
    ids = render_prompt(tokenizer, "2+2=", chat_template=False)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "2+2="
    with pytest.raises(
        ModelConfigError, match="data.chat_template: a prompt made of chat messages"
    ):
        render_prompt(tokenizer, CHAT[:2], chat_template=False)
    with pytest.raises(ModelConfigError, match="data.system_prompt: a system prompt needs"):
        render_prompt(tokenizer, "2+2=", system="Be brief.", chat_template=False)


def test_system_prompt_joins_messages_without_one(tokenizer):
    assert render_prompt(tokenizer, CHAT[1:2], system="Be brief.") == render_prompt(
        tokenizer, CHAT[:2]
    )
    with pytest.raises(
        ModelConfigError, match="data.system_prompt: .* already start with a system turn"
    ):
        render_prompt(tokenizer, CHAT[:2], system="Be brief.")


def test_missing_chat_template_is_a_config_error():
    tok = char_tokenizer("0123456789+=")
    assert render_prompt(tok, "1+1=", chat_template=False) == [tok.bos_token_id] + tok.encode(
        "1+1=", add_special_tokens=False
    )
    with pytest.raises(
        ModelConfigError, match="data.chat_template: the tokenizer .* has no chat template"
    ):
        render_prompt(tok, "1+1=")
    with pytest.raises(ModelConfigError, match="data.chat_template"):
        sft_tokens(tok, CHAT)


def test_sft_mask_covers_only_assistant_replies(tokenizer):
    ids, mask = sft_tokens(tokenizer, CHAT)
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    trained = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(trained) == "4<|im_end|>It is 6.<|im_end|>"
    # the context before the first reply is exactly what generation is prompted with
    first = mask.index(1)
    assert ids[:first] == render_prompt(tokenizer, CHAT[:2])
    assert sum(mask) == len(
        tokenizer.encode("4<|im_end|>It is 6.<|im_end|>", add_special_tokens=False)
    )


def test_sft_tokens_on_the_example_conversations(tokenizer):
    for line in (DATA / "sft.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        ids, mask = sft_tokens(tokenizer, messages)
        replies = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
        assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == replies


def test_sft_rejects_templates_that_rewrite_history(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}[elided]"
        "{%- else %}{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}"
    )
    with pytest.raises(
        ModelConfigError, match="data.chat_template: .* renders earlier turns differently"
    ):
        sft_tokens(tok, CHAT)
    with pytest.raises(ModelConfigError, match="data.messages_key: .* without an assistant turn"):
        sft_tokens(tok, CHAT[:2])


def test_prompt_answer_records_become_conversations(tokenizer):
    record = {"prompt": "2+2?", "answer": 4, "id": 0}
    messages = prompt_answer_messages(record, system="Be brief.")
    assert messages == CHAT[:3]
    ids, mask = sft_tokens(tokenizer, messages)
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "4<|im_end|>"


def test_a_tied_head_left_on_the_meta_device_is_tied_and_other_empty_weights_are_named(tmp_path):
    """transformers 5.25 now and then loads a tied model with its head untied on the meta device
    (CI, a long-lived xdist worker): tidal's loaders tie it, and name anything else left empty."""
    from transformers import LlamaConfig

    from tidal.models.gguf import ModelSourceError, complete_tied_head

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    model.config.tie_word_embeddings = False  # a config said otherwise: the folder ties
    model.lm_head.weight = torch.nn.Parameter(torch.empty(64, 16, device="meta"))
    complete_tied_head(model, tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.to("cpu")  # what failed: "Cannot copy out of meta tensor"
    model.model.norm.weight = torch.nn.Parameter(torch.empty(16, device="meta"))
    with pytest.raises(ModelSourceError, match=r"no weights were loaded for model\.norm\.weight"):
        complete_tied_head(model, tmp_path)
