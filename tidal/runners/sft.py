"""``tidal sft``: supervised warm start of a tiny causal LM on generated examples."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.config.common import ActorConfig
from tidal.config.llm import LLMConfig, validate_sft
from tidal.engine import TrainEngine
from tidal.inference.tiny import char_tokenizer, tiny_llama
from tidal.rollout.tasks import ARITH_ALPHABET, TASKS

log = logging.getLogger("tidal.sft")


def load_or_build(cfg: LLMConfig):
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tokenizer = char_tokenizer(ARITH_ALPHABET)
    m = cfg.model
    model = tiny_llama(len(tokenizer), hidden=m.hidden, layers=m.layers, heads=m.heads, max_positions=m.max_positions,
                       seed=cfg.runner.seed)
    return model, tokenizer


def encode(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """BOS, then each segment; a trained segment (a model turn) ends with EOS and is learned."""
    ids, trained = [tokenizer.bos_token_id], [False]
    for text, learn in segments:
        part = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if learn else [])
        ids += part
        trained += [learn] * len(part)
    return ids, trained


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int) -> float:
    """Exact match of greedy answers, batched with left padding."""
    model.eval()
    correct = 0
    for start in range(0, len(problems), 128):
        chunk = problems[start:start + 128]
        prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p["prompt"], add_special_tokens=False) for p in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (ids != tokenizer.pad_token_id).long()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for p, row in zip(chunk, out[:, width:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            correct += text.strip().split(" ")[0] == p["answer"]
    return correct / len(problems)


def run_sft(cfg: LLMConfig) -> dict:
    validate_sft(cfg)
    torch.manual_seed(cfg.runner.seed)
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    model, tokenizer = load_or_build(cfg)
    d = cfg.data
    task = TASKS.get(d.task)
    train = task.problems(d.train_size, d.seed, d)
    held_out = task.problems(cfg.sft.eval_size, d.seed + 10_000, d)
    # torch's AdamW defaults and no clipping: how the warm start has always trained
    engine = TrainEngine(model, ActorConfig(lr=cfg.sft.lr, optimizer="adamw", weight_decay=0.01, max_grad_norm=None),
                         total_steps=cfg.sft.steps, name="sft")

    def loss_fn(module, micro):
        ids, labels = micro
        loss = module(input_ids=ids, labels=labels).loss
        return loss, {"loss": loss.item()}

    rng = random.Random(cfg.runner.seed)
    start = time.perf_counter()
    for step in range(cfg.sft.steps):
        batch = [encode(tokenizer, task.demonstration(p, rng)) for p in rng.sample(train, cfg.sft.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        learn = torch.tensor([trained + [False] * (width - len(trained)) for _, trained in batch])
        labels = torch.where(learn, ids, -100)
        loss = engine.train_batch([(ids, labels)], loss_fn)["loss"][0]
        engine.end_step()
        if (step + 1) % 100 == 0:
            log.info("sft step %d loss %.4f", step + 1, loss)
    # multi-turn tasks are scored by the RL runner's first evaluation (it needs the environment)
    accuracy = None if task.multi_turn else greedy_accuracy(model, tokenizer, held_out, cfg.rollout.max_new_tokens)
    Path(cfg.model.path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cfg.model.path)
    tokenizer.save_pretrained(cfg.model.path)
    return {"model_path": cfg.model.path, "steps": cfg.sft.steps, "held_out_accuracy": accuracy,
            "final_loss": loss, "wall_time": time.perf_counter() - start}
