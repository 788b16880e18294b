"""What the RL runner, ``tidal sft`` and ``tidal eval`` build alike from an LLM config: the records
(a dataset file, or a registered task that generates them), prompt rendering (plain, or with the
tokenizer's chat template and the system prompt), the reward and the evaluator."""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tidal.config.llm import LLMConfig
from tidal.data.datasets import RecordIterator, load_conversations, load_prompts
from tidal.inference import GenerationConfig, InferenceClient
from tidal.models.llm import prompt_answer_messages, render_prompt, sft_tokens
from tidal.rollout.evaluation import Evaluator, greedy_config
from tidal.rollout.rewards import Reward
from tidal.rollout.tasks import TASKS
from tidal.runners.llm.preflight import configured_reward

log = logging.getLogger(__name__)


@contextlib.contextmanager
def data_cache(cfg: LLMConfig, run_dir: Path | None) -> Iterator[Path]:
    """Where ``datasets`` caches Arrow files: data.cache_dir, else the run folder, else a
    temporary folder removed afterwards (read the records out before leaving)."""
    if cfg.data.cache_dir is not None:
        yield Path(cfg.data.cache_dir)
    elif run_dir is not None:
        yield run_dir / "datasets_cache"
    else:
        with tempfile.TemporaryDirectory(prefix="tidal-datasets-") as tmp:
            yield Path(tmp)


def _prompt_table(cfg: LLMConfig, path: str, cache: Path, key: str):
    d = cfg.data
    return load_prompts(path, cache, d.prompt_key, d.answer_key, d.id_key, key=key)


def train_records(cfg: LLMConfig, cache: Path) -> RecordIterator:
    """Training records in an order shuffled with the run seed; its state is the data position."""
    d = cfg.data
    if d.path is not None:
        table = _prompt_table(cfg, d.path, cache, "data.path")
    else:
        table = TASKS.get(d.task).problems(d.train_size, d.seed, d)
    return RecordIterator(table, seed=cfg.runner.seed)


def eval_records(cfg: LLMConfig, cache: Path, size: int | None = None) -> list[dict]:
    """The first ``size`` (default data.eval_size) held-out records: data.eval_path, or generated
    by the task; none for a training file without an evaluation file."""
    d = cfg.data
    size = size or d.eval_size
    if d.eval_path is not None:
        table = _prompt_table(cfg, d.eval_path, cache, "data.eval_path")
        return table.select(range(min(size, len(table)))).to_list()
    if d.path is not None:
        return []
    return TASKS.get(d.task).problems(size, d.seed + 10_000, d)


def prompt_renderer(cfg: LLMConfig, tokenizer):
    """A record's prompt -> token ids, as configured (chat template, system prompt)."""
    d = cfg.data
    return functools.partial(
        render_prompt, tokenizer, system=d.system_prompt, chat_template=d.chat_template
    )


def conversation_tools(row: dict, d) -> list[dict] | None:
    """A conversation record's tools (data.tools_key), without the null fields a table adds
    where records' tools differ in shape."""
    tools = row.get(d.tools_key)
    return [drop_nulls(t) for t in tools] if tools else None


def drop_nulls(value):
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def sft_examples(cfg: LLMConfig, tokenizer, cache: Path) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` per training record of data.path: conversations
    (data.messages_key) or prompt/answer pairs, learned only on the assistant's turns."""
    d = cfg.data
    if d.messages_key is not None:
        table = load_conversations(d.path, cache, d.messages_key, d.id_key)
        return [
            sft_tokens(tokenizer, row["messages"], d.system_prompt, conversation_tools(row, d))
            for row in table
        ]
    table = _prompt_table(cfg, d.path, cache, "data.path")
    if d.chat_template:
        return [
            sft_tokens(tokenizer, prompt_answer_messages(row, d.system_prompt)) for row in table
        ]
    eos = [tokenizer.eos_token_id]
    examples = []
    for row in table:
        prompt = render_prompt(tokenizer, row["prompt"], chat_template=False)
        answer = tokenizer.encode(str(row["answer"]), add_special_tokens=False) + eos
        examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return examples


def warmed_reward(cfg: LLMConfig, record: dict | None) -> Reward:
    """The configured reward, called once on ``record``'s own answer before any timeout runs: a
    lazy start (math_verify spawns its checker process) happens here, and a broken reward is
    logged now rather than as a run of timeouts."""
    reward = configured_reward(cfg)
    if record is not None:
        try:
            reward(str(record.get("answer", "")), **record)
        except Exception as exc:  # noqa: BLE001 - the run counts the reward's failures itself
            log.warning("reward %s failed on record %r: %s", reward.name, record.get("id"), exc)
    return reward


def generation_config(cfg: LLMConfig, tokenizer) -> GenerationConfig:
    r = cfg.rollout
    return GenerationConfig(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=[tokenizer.eos_token_id],
    )


def evaluator(
    cfg: LLMConfig, client: InferenceClient, tokenizer, records: list[dict], n: int = 0
) -> Evaluator:
    """The configured evaluation of ``records``: greedy (and ``n`` samples drawn like rollouts),
    the reward."""
    gconfig = generation_config(cfg, tokenizer)
    return Evaluator(
        client,
        tokenizer,
        prompt_renderer(cfg, tokenizer),
        warmed_reward(cfg, records[0] if records else None),
        greedy_config(gconfig),
        gconfig,
        n,
        cfg.rollout.reward_timeout_s,
        max_concurrent=cfg.rollout.max_batch_size,
    )
