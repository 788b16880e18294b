"""``tidal sft``: supervised warm start of the causal language model at model.path.

With data.path it learns the file's records: conversations (data.messages_key) or prompt/answer
pairs, rendered with the chat template when data.chat_template is set, with the loss only on the
assistant's turns. Without, it learns a registered task's generated demonstrations. When
model.path does not exist yet it builds a tiny model there first: a chat Qwen2 with a byte-level
BPE tokenizer trained on the dataset's text, or a character-level Llama for a generated task.
The result is saved to model.path and scored on the held-out records as ``tidal eval`` scores it;
the run folder ``run_dir/<experiment>-sft`` holds its config and ``sft.log``.
"""

from __future__ import annotations

import logging
import random
import re
import time
from pathlib import Path

import torch

from tidal.config.common import ActorConfig
from tidal.config.llm import LLMConfig
from tidal.data.datasets import RecordIterator, load_conversations, load_prompts
from tidal.engine import TrainEngine
from tidal.inference.tiny import (
    TOOLS_CHATML_TEMPLATE,
    byte_level_tokenizer,
    save_tiny_chat_model,
    save_tiny_model,
)
from tidal.models.chat_template import render_chat
from tidal.models.llm import as_messages, load_causal_lm
from tidal.rollout.tasks import ARITH_ALPHABET, TASKS, is_multi_turn
from tidal.runners.llm.common import (
    conversation_tools,
    data_cache,
    eval_records,
    sft_examples,
)
from tidal.runners.llm.preflight import check_llm_sft
from tidal.runners.run_folder import RunFolder

log = logging.getLogger("tidal.sft")

Example = tuple[list[int], list[int]]  # (input_ids, loss_mask)


def dataset_text(cfg: LLMConfig, cache: Path) -> list[str]:
    """Every string of the training file an SFT example renders (to train a tokenizer on):
    conversations as the chat template renders them (tool calls and tools too), less the
    special tokens, which are whole tokens already."""
    d = cfg.data
    if d.messages_key is not None:
        rows = load_conversations(d.path, cache, d.messages_key, d.id_key)
        plain = byte_level_tokenizer(chat_template=TOOLS_CHATML_TEMPLATE)
        specials = re.compile("|".join(map(re.escape, plain.all_special_tokens + ["<|im_start|>"])))
        return [
            specials.sub(
                "\n",
                render_chat(
                    as_messages(row["messages"], d.system_prompt),
                    plain,
                    False,
                    conversation_tools(row, d),
                ),
            )
            for row in rows
        ]
    rows = load_prompts(d.path, cache, d.prompt_key, d.answer_key, d.id_key)
    texts = [str(answer) for answer in rows["answer"]]
    for prompt in rows["prompt"]:
        texts += [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    return texts + ([d.system_prompt] if d.system_prompt else [])


def load_or_build(cfg: LLMConfig, cache: Path):
    """``(model, tokenizer)`` from model.path, where a tiny model is built first when it does not
    exist (a chat model for a dataset file, a character-level one for a generated task)."""
    m, path = cfg.model, Path(cfg.model.path)
    if not path.exists():
        size = dict(hidden=m.hidden, layers=m.layers, heads=m.heads, max_positions=m.max_positions)
        if cfg.data.path is not None:
            save_tiny_chat_model(
                path,
                dataset_text(cfg, cache),
                m.vocab_size,
                chat_template=TOOLS_CHATML_TEMPLATE,  # ChatML, and tools where records have them
                seed=cfg.runner.seed,
                **size,
            )
        else:
            save_tiny_model(path, ARITH_ALPHABET, seed=cfg.runner.seed, **size)
        log.info("sft: built a tiny model in %s", path)
    return load_causal_lm(path, m.dtype, m.attn_implementation, m.gradient_checkpointing)


def encode(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """BOS, then each segment; a trained segment (a model turn) ends with EOS and is learned."""
    ids, trained = [tokenizer.bos_token_id], [False]
    for text, learn in segments:
        part = tokenizer.encode(text, add_special_tokens=False) + (
            [tokenizer.eos_token_id] if learn else []
        )
        ids += part
        trained += [learn] * len(part)
    return ids, trained


def batches(cfg: LLMConfig, tokenizer, cache: Path):
    """``next_batch() -> [Example]``: the file's examples in a seeded shuffled order, or fresh
    demonstrations of the task's generated problems."""
    d, size = cfg.data, cfg.sft.batch_size
    if d.path is not None:
        examples = RecordIterator(sft_examples(cfg, tokenizer, cache), seed=cfg.runner.seed)
        return lambda: examples.next_batch(size)
    task, rng = TASKS.get(d.task), random.Random(cfg.runner.seed)
    train = task.problems(d.train_size, d.seed, d)
    return lambda: [encode(tokenizer, task.demonstration(p, rng)) for p in rng.sample(train, size)]


def collate(batch: list[Example], pad_id: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` (-100 off the learned tokens), cut to the
    context."""
    batch = [(ids[:context], mask[:context]) for ids, mask in batch]
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])
    learn = torch.tensor(
        [[bool(x) for x in mask] + [False] * (width - len(mask)) for _, mask in batch]
    )
    return ids, torch.where(learn, ids, -100)


def run_sft(cfg: LLMConfig) -> dict:
    check_llm_sft(cfg)
    torch.manual_seed(cfg.runner.seed)
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    with RunFolder(cfg, "sft") as run:
        return {**_train(cfg), "run_dir": str(run.path)}


def _train(cfg: LLMConfig) -> dict:
    with data_cache(cfg, None) as cache:
        model, tokenizer = load_or_build(cfg, cache)
        next_batch = batches(cfg, tokenizer, cache)
        held_out = eval_records(cfg, cache, cfg.sft.eval_size) if cfg.sft.eval_size else []
    context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    # torch's AdamW defaults and no clipping: how the warm start has always trained
    s = cfg.sft
    engine = TrainEngine(
        model,
        ActorConfig(
            lr=s.lr,
            lr_schedule=s.lr_schedule,
            warmup_steps=s.warmup_steps,
            optimizer="adamw",
            weight_decay=0.01,
            max_grad_norm=None,
        ),
        total_steps=cfg.sft.steps,
        name="sft",
    )

    def loss_fn(module, micro):
        ids, labels = micro
        loss = module(input_ids=ids, labels=labels).loss
        return loss, {"loss": loss.item()}

    start, losses = time.perf_counter(), []
    for step in range(cfg.sft.steps):
        losses.append(
            engine.train_batch([collate(next_batch(), tokenizer.pad_token_id, context)], loss_fn)[
                "loss"
            ][0]
        )
        engine.end_step()
        if (step + 1) % 100 == 0:
            log.info("sft step %d loss %.4f", step + 1, losses[-1])
    Path(cfg.model.path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cfg.model.path)
    tokenizer.save_pretrained(cfg.model.path)
    # multi-turn tasks are scored by the RL runner's first evaluation (it needs the environment)
    accuracy = None
    if held_out and not is_multi_turn(cfg.data):
        from tidal.runners.llm.eval import serve_and_evaluate

        accuracy = serve_and_evaluate(cfg, held_out).metrics["eval/accuracy"]
    return {
        "model_path": cfg.model.path,
        "steps": cfg.sft.steps,
        "held_out_accuracy": accuracy,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "wall_time": time.perf_counter() - start,
    }
