"""The language half's preflight checks (``tidal.runners.preflight`` has the shared ones and the
embodied half's): data files and their keys, rewards, tasks, engines, workflows and model
folders, each failing with a ``ConfigError`` that names the key."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tidal.algorithms import list_advantages
from tidal.algorithms.correction import ROLLOUT_CORRECTIONS
from tidal.algorithms.kl import KL_KINDS
from tidal.algorithms.losses import AGGREGATIONS, IMPORTANCE_LEVELS
from tidal.config import ConfigError
from tidal.config.common import one_of
from tidal.config.llm import (
    DataConfig,
    LLMConfig,
    validate_actor_ranks,
    validate_data,
    validate_llm,
    validate_llm_sft,
)
from tidal.config.loader import require
from tidal.data.datasets import DataConfigError, load_conversations, load_prompts
from tidal.inference.tool_calls import TOOL_PARSERS
from tidal.memory import MemoryPlan
from tidal.memory import plan as memory_plan
from tidal.models.gguf import is_model_file
from tidal.models.llm import (
    DTYPES,
    ModelConfigError,
    check_causal_lm,
    check_load_options,
    load_tokenizer,
    require_template,
)
from tidal.models.lora import apply_lora, check_lora, no_init
from tidal.rollout.rewards import Reward, resolve_reward
from tidal.rollout.servers import ROLLOUT_SERVERS
from tidal.rollout.tasks import TASKS, is_multi_turn
from tidal.runners.preflight import (
    check_actor_ranks,
    check_common,
    check_lora_extra,
    checkpoint_lora_argument,
    decide_weight_sync,
    import_object,
    world_sizes,
)
from tidal.strategies import STRATEGIES


def check_llm(cfg: LLMConfig) -> None:
    """Every rule of a language config but the model folder's (``check_llm_model``)."""
    check_common(cfg)
    alg, r = cfg.algorithm, cfg.rollout
    one_of(alg.adv_type, list_advantages(needs_critic=False), "algorithm.adv_type")
    one_of(alg.loss_agg, AGGREGATIONS[:3], "algorithm.loss_agg")
    one_of(alg.kl_kind, KL_KINDS, "algorithm.kl_kind")
    one_of(alg.importance_level, IMPORTANCE_LEVELS, "algorithm.importance_level")
    one_of(alg.rollout_correction, ROLLOUT_CORRECTIONS, "algorithm.rollout_correction")
    one_of(r.engine, ROLLOUT_SERVERS.names(), "rollout.engine")
    engine = ROLLOUT_SERVERS.get(r.engine)
    engine.validate(cfg)
    decide_weight_sync(cfg, engine.weight_syncs, f"rollout.engine={r.engine}")
    validate_llm(cfg)
    kind = data_kind(cfg.data)
    require(
        r.workflow in ("auto", kind, "agent") or ":" in r.workflow,
        "rollout.workflow",
        f"{_data_name(cfg.data)} runs the {kind!r} workflow (or 'auto', 'agent', or "
        f"module.path:factory), got {r.workflow!r}",
    )
    one_of(r.tool_parser, TOOL_PARSERS.names(), "rollout.tool_parser")
    if ":" in r.workflow:
        import_object(r.workflow, "rollout.workflow")
    require(
        not r.dynamic_sampling or r.group_size > 1,
        "rollout.dynamic_sampling",
        "filters a prompt's group of samples (or agent runs) by their rewards: it needs "
        f"rollout.group_size > 1, got {r.group_size}",
    )
    require(
        not cfg.actor.shared_prefix or cfg.model.attn_implementation in (None, "sdpa", "eager"),
        "actor.shared_prefix",
        "packs answers behind their prompt with a custom 4-D attention mask, which sdpa and "
        f"eager attention read; model.attn_implementation is {cfg.model.attn_implementation!r}",
    )
    ranks = world_sizes(cfg.cluster, ["rollout", "actor"])["actor"]
    check_actor_ranks(cfg, ranks, "a data-parallel trainer (more than one actor rank)")
    validate_actor_ranks(cfg, ranks)
    check_data(cfg)


def check_llm_run(cfg: LLMConfig) -> None:
    """Everything ``tidal train`` checks before a worker starts (``tidal config`` runs it too)."""
    check_llm(cfg)
    check_llm_model(cfg)


def check_llm_sft(cfg: LLMConfig) -> None:
    """``tidal sft`` on a language config: the data, and the model folder, or the options of the
    tiny model it builds there."""
    validate_llm_sft(cfg)
    check_data(cfg, sft=True)
    check_sft_destination(cfg.model.path)
    if Path(cfg.model.path).exists():  # else tidal sft builds a tiny model there
        check_llm_model(cfg)
        return
    try:
        check_load_options(cfg.model.dtype, cfg.model.attn_implementation)
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None
    require(
        cfg.data.path is None or cfg.data.chat_template,
        "data.chat_template",
        "tidal sft builds a chat model for a dataset file: set data.chat_template=true",
    )


def check_sft_destination(path: str) -> None:
    """tidal sft saves to model.path: a GGUF file or packaged model cannot take it."""
    if is_model_file(path):
        raise ConfigError(
            f"model.path: tidal sft saves the model there, and {path!r} is a GGUF file or "
            f"packaged model: run `tidal export --from-gguf {path} -o DIR` and set model.path=DIR"
        )


def check_llm_eval(cfg: LLMConfig, checkpoint: str | None, n: int) -> Path | None:
    """The config and model as for training, something to evaluate on, and the checkpoint (its
    folder) when one is given; all before the run folder exists."""
    check_llm(cfg)
    check_llm_model(cfg)
    if is_multi_turn(cfg.data):
        raise ConfigError(
            f"data.task: tidal eval scores single-turn records; {cfg.data.task!r} is multi-turn "
            "(the training run evaluates it)"
        )
    if cfg.data.path is not None and cfg.data.eval_path is None:
        raise ConfigError("data.eval_path: tidal eval needs held-out records (a dataset file)")
    if n < 0:
        raise ConfigError(f"--n: must be >= 0, got {n}")
    return checkpoint_lora_argument(checkpoint, cfg.model.lora)


def data_kind(d: DataConfig) -> str:
    """The workflow the data runs: a dataset file is single-turn; a task says which it is."""
    if d.path is None:
        one_of(d.task, TASKS.names(), "data.task")
    return "multi_turn" if is_multi_turn(d) else "rlvr"


def _data_name(d: DataConfig) -> str:
    return f"data.path {d.path!r}" if d.path is not None else f"task {d.task!r}"


def check_data(cfg: LLMConfig, sft: bool = False) -> None:
    """Dataset files, their keys, the chat-template options and the reward (``sft``:
    data.messages_key conversations may replace prompt/answer records)."""
    d = cfg.data
    validate_data(cfg, sft)
    kind = data_kind(d)
    if d.path is not None:
        _check_file(d, d.path, "data.path", sft and d.messages_key is not None)
    if d.eval_path is not None:
        _check_file(d, d.eval_path, "data.eval_path", conversations=False)
    require(
        kind == "rlvr" or cfg.reward.name == "auto",
        "reward.name",
        f"task {d.task!r} is multi-turn: its environment gives the reward (leave reward.name: auto)",
    )
    if kind == "rlvr":
        configured_reward(cfg)


def configured_reward(cfg: LLMConfig) -> Reward:
    """The reward of single-turn episodes and evaluation: ``reward.name`` resolved, or with
    ``auto`` a generated task's own (exact_match for a file)."""
    name, kwargs = cfg.reward.name, dict(cfg.reward.kwargs)
    if name == "auto" and cfg.data.path is None:
        return Reward(cfg.data.task, TASKS.get(cfg.data.task).reward, kwargs)
    try:
        return resolve_reward("exact_match" if name == "auto" else name, kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_file(d: DataConfig, path: str, key: str, conversations: bool) -> None:
    """The file loads, holds records with the configured keys, and chat-message prompts come
    with data.chat_template."""
    with tempfile.TemporaryDirectory(prefix="tidal-data-check-") as cache:
        try:
            if conversations:
                load_conversations(path, cache, d.messages_key, d.id_key, key=key)
                return
            table = load_prompts(path, cache, d.prompt_key, d.answer_key, d.id_key, key=key)
        except DataConfigError as exc:
            raise ConfigError(str(exc)) from None
        text = getattr(table.features["prompt"], "dtype", None) in ("string", "large_string")
        require(
            d.chat_template or text,
            "data.chat_template",
            f"the prompts in {path!r} are chat messages: set data.chat_template=true",
        )


def check_llm_model(cfg: LLMConfig) -> None:
    """The model folder holds a causal language model (no weights read), the load options are known, its
    context holds the generated tokens, and its tokenizer has a chat template when asked."""
    m = cfg.model
    try:
        check_load_options(m.dtype, m.attn_implementation)
        model_cfg = check_causal_lm(m.path)
        if cfg.data.chat_template:
            require_template(load_tokenizer(m.path))
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None
    STRATEGIES.get(cfg.actor.strategy).check_model(lambda: meta_training_model(cfg, model_cfg))
    check_llm_lora(cfg, model_cfg)
    require(
        not cfg.actor.shared_prefix or not sliding_window_layers(model_cfg),
        "actor.shared_prefix",
        f"{cfg.model.path} has sliding-window attention layers, which a packed row's block "
        "mask does not window: set actor.shared_prefix=false",
    )
    context = getattr(model_cfg, "max_position_embeddings", None)
    require(
        context is None or cfg.rollout.max_new_tokens < context,
        "rollout.max_new_tokens",
        f"{cfg.rollout.max_new_tokens} does not fit the model's context of {context} tokens",
    )


def sliding_window_layers(model_cfg) -> bool:
    """Whether the model windows some attention layers (Mistral, Gemma 2/3, Qwen2 with
    use_sliding_window, any ``layer_types`` with sliding layers)."""
    if "sliding_attention" in (getattr(model_cfg, "layer_types", None) or ()):
        return True
    window = getattr(model_cfg, "sliding_window", None)
    return bool(window) and getattr(model_cfg, "use_sliding_window", True)


def meta_training_model(cfg: LLMConfig, model_cfg=None):
    """The model the actor trains, built on the meta device from model.path's config (no
    weights read), in model.dtype: what ``tidal config --memory`` counts and fsdp2 checks.
    Whatever freezes part of it for training (e.g. adapters over a frozen base) freezes it
    here too, so the trainable count follows."""
    import torch
    from transformers import AutoModelForCausalLM

    model_cfg = model_cfg or check_causal_lm(cfg.model.path)
    dtype = DTYPES[cfg.model.dtype]
    if dtype == "auto":
        dtype = getattr(model_cfg, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_cfg, dtype=dtype)
        return apply_lora(model, cfg.model.lora, repr(cfg.model.path))


def actor_memory(cfg: LLMConfig) -> MemoryPlan:
    """Per actor rank, the parameters, gradients and optimizer state the config implies."""
    check_llm(cfg)
    check_llm_model(cfg)
    ranks = world_sizes(cfg.cluster, ["rollout", "actor"])["actor"]
    return memory_plan(meta_training_model(cfg), cfg.actor, ranks)


def check_llm_lora(cfg: LLMConfig, model_cfg) -> None:
    """``model.lora`` on the model, built as a skeleton from its config.json (no weights)."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return
    check_lora_extra(lora)
    from transformers import AutoModelForCausalLM

    with no_init():
        model = AutoModelForCausalLM.from_config(model_cfg)
    check_lora(model, lora, repr(cfg.model.path))
