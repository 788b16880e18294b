"""The config of asynchronous RL for language agents (``runner.task: llm``) and of ``tidal sft``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tidal.config.common import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    RunnerConfig,
    one_of,
    require_extra,
    validate_common,
    world_sizes,
)
from tidal.config.loader import ConfigError, require
from tidal.config.schema import section, setting

# What the language half imports (the 'llm' extra), checked before anything is loaded.
LLM_PACKAGES = ("transformers", "datasets", "math_verify", "fastapi", "uvicorn", "aiohttp", "httpx")


@dataclass
class LLMRunnerConfig(RunnerConfig):
    """The run loop (the language half's defaults)."""

    task: str = setting("llm", "which half trains: embodied | llm")
    experiment: str = setting(
        "llm", "the run folder is run_dir/experiment (suffixed -2, -3, ... when taken)"
    )
    target_metric: str = setting("eval/accuracy", "the metric the target_value stop rule watches")


@dataclass
class LMModelConfig:
    """The causal LM."""

    path: str = setting(
        "runs/models/arith", "a local Hugging Face causal-LM folder (tidal sft writes it)"
    )
    dtype: str = setting("float32", "from_pretrained's dtype: float32 | bfloat16 | float16 | auto")
    attn_implementation: str | None = setting(
        None, "transformers' attention: eager | sdpa | ...; None: its default"
    )
    gradient_checkpointing: bool = setting(
        False, "recompute activations in the backward pass (the trainer's model)"
    )
    hidden: int = setting(
        128, "the tiny model tidal sft builds when path does not exist yet: width"
    )
    layers: int = setting(4, "... its layers")
    heads: int = setting(4, "... its attention heads")
    max_positions: int = setting(64, "... its context length")
    vocab_size: int = setting(
        512, "... with data.path: its byte-level BPE vocabulary, trained on the dataset's text"
    )


@dataclass
class DataConfig:
    """The prompts: a dataset file (data.path), or a registered task that generates them."""

    path: str | None = setting(
        None, "a JSONL, JSON or Parquet file of training records; None: data.task generates them"
    )
    eval_path: str | None = setting(
        None, "held-out records (same keys) for evaluation and tidal eval"
    )
    prompt_key: str = setting("prompt", "the prompt's field (a string or a list of chat messages)")
    answer_key: str = setting("answer", "the reference answer's field (given to the reward)")
    messages_key: str | None = setting(
        None, "tidal sft: the field holding chat conversations; None: prompt/answer pairs"
    )
    id_key: str = setting("id", "the field naming a record in logs and eval rows (else its row)")
    chat_template: bool = setting(
        False, "render prompts with the tokenizer's chat template (SFT, RL and evaluation)"
    )
    system_prompt: str | None = setting(
        None, "a system turn before each prompt (needs chat_template)"
    )
    cache_dir: str | None = setting(
        None, "the datasets cache; None: inside the run folder (a temporary one for sft)"
    )
    task: str = setting(
        "arithmetic",
        "without data.path: a registered task (tidal.rollout.tasks): arithmetic | reverse | guess_number",
    )
    digits: int = setting(2, "arithmetic: digits per operand")
    max_len: int = setting(24, "reverse: the longest digit string")
    ops: str = setting("+", "arithmetic: operators to draw from")
    train_size: int = setting(20000, "generated training problems")
    eval_size: int = setting(
        256, "held-out problems: generated, or the first this many of data.eval_path"
    )
    seed: int = setting(0, "the seed the problems are generated with (the same data across runs)")


@dataclass
class RewardConfig:
    """The reward of single-turn episodes and of evaluation."""

    name: str = setting(
        "auto",
        "a registered reward (exact_match | math_verify | regex_match), module.path:function, "
        "or auto: a generated task's own, exact_match for a dataset file",
    )
    kwargs: dict[str, Any] = setting(
        factory=dict, help="options passed to the reward (they win over record fields)"
    )


@dataclass
class LLMRolloutConfig:
    """Inference servers, admission and sampling."""

    num_servers: int = setting(1, "inference servers (rollout ranks)")
    max_batch_size: int = setting(256, "sequences a server decodes at once")
    max_staleness: int = setting(
        0, "eta: how many versions behind a trained sample may be; 0 is synchronous RL"
    )
    max_concurrent_rollouts: int = setting(16, "episodes in flight at once")
    batch_size: int = setting(16, "episodes (prompts) per training step")
    group_size: int = setting(8, "samples per prompt")
    workflow: str = setting("auto", "auto (by data.task) | rlvr | multi_turn | module.path:factory")
    max_new_tokens: int = setting(6, "generated tokens per turn")
    temperature: float = setting(1.0, "sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "nucleus sampling mass")
    top_k: int = setting(-1, "top-k sampling; -1: off")
    max_turns: int = setting(6, "multi-turn: turns per episode")
    turn_discount: float = setting(0.9, "multi-turn: reward discount per extra turn")
    reward_timeout_s: float = setting(10.0, "bound on one reward function call")
    pause_mode: str = setting(
        "abort",
        "weight update: abort in-flight requests (resubmitted) or keep them paused in place "
        "(in_place: SGLang's name for keep)",
    )
    engine: str = setting("tidal", "what serves rollouts (tidal.rollout.engines): tidal | vllm")
    server_urls: list[str] = setting(
        factory=list,
        help="vllm: running servers to use instead of launching one per rollout rank",
    )
    vllm_python: str | None = setting(
        None,
        "vllm: the python of vLLM's virtualenv; None: $TIDAL_VLLM_PYTHON, else the repo's "
        ".venv-vllm (make vllm)",
    )
    vllm_args: list[str] = setting(
        factory=list, help="vllm: extra arguments of vLLM's OpenAI server"
    )
    vllm_start_timeout_s: float = setting(600.0, "vllm: bound on a server's start (/health)")


@dataclass
class LMAlgorithmConfig(AlgorithmConfig):
    """The advantage estimator and the (decoupled) PPO objective for language agents."""

    adv_type: str = setting("grpo", "a critic-free advantage estimator from the registry")
    gamma: float = setting(1.0, "discount over tokens")
    recompute_logprob: bool = setting(
        True, "standard PPO: old log-probs from a forward pass (else from inference)"
    )
    kl_coef: float = setting(0.0, "KL penalty to a frozen reference model (> 0 keeps one)")
    kl_kind: str = setting("k3", "KL estimator: k1 | k2 | k3 | ...")
    kl_in: str = setting("loss", "apply the KL in the loss or shape it into the reward")


@dataclass
class LMActorConfig(ActorConfig):
    """The train engine, with the language batch layout."""

    lr: float = setting(1e-4, "learning rate")
    optimizer: str = setting("adamw", "adam | adamw")
    max_tokens_per_mb: int = setting(4096, "micro-batches are packed up to this many tokens")
    ppo_minibatches: int = setting(1, "optimizer steps per training step")


@dataclass
class SFTConfig:
    """``tidal sft``: supervised warm start."""

    steps: int = setting(600, "optimizer steps")
    batch_size: int = setting(64, "sequences per step")
    lr: float = setting(1e-3, "learning rate")
    eval_size: int = setting(256, "held-out problems scored at the end")


@dataclass
class LLMConfig:
    cluster: ClusterConfig = section(ClusterConfig)
    runner: LLMRunnerConfig = section(LLMRunnerConfig)
    model: LMModelConfig = section(LMModelConfig)
    data: DataConfig = section(DataConfig)
    reward: RewardConfig = section(RewardConfig)
    rollout: LLMRolloutConfig = section(LLMRolloutConfig)
    algorithm: LMAlgorithmConfig = section(LMAlgorithmConfig)
    actor: LMActorConfig = section(LMActorConfig)
    sft: SFTConfig = section(SFTConfig)

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        **{
            f"actor.{k}": f"algorithm.{k}"
            for k in (
                "adv_type",
                "use_decoupled_loss",
                "prox_logp_method",
                "recompute_logprob",
                "clip_ratio_low",
                "clip_ratio_high",
                "behav_weight_cap",
                "cap_mode",
                "loss_agg",
                "kl_coef",
                "kl_kind",
                "kl_in",
            )
        },
        "runner.target_accuracy": "runner.target_value (with runner.target_metric: eval/accuracy)",
    }


def validate_llm(cfg: LLMConfig) -> None:
    from tidal.algorithms import list_advantages
    from tidal.algorithms.kl import KL_KINDS
    from tidal.algorithms.losses import AGGREGATIONS

    a, alg, r = cfg.actor, cfg.algorithm, cfg.rollout
    validate_common(cfg.cluster, cfg.runner, a, alg)
    require_extra("runner.task", "llm", "the llm half", *LLM_PACKAGES)
    one_of(alg.adv_type, list_advantages(needs_critic=False), "algorithm.adv_type")
    one_of(
        alg.prox_logp_method, ("recompute", "loglinear", "metrics"), "algorithm.prox_logp_method"
    )
    one_of(alg.loss_agg, AGGREGATIONS[:3], "algorithm.loss_agg")
    one_of(alg.kl_kind, KL_KINDS, "algorithm.kl_kind")
    one_of(alg.kl_in, ("loss", "reward"), "algorithm.kl_in")
    one_of(r.pause_mode, ("abort", "keep", "in_place"), "rollout.pause_mode")
    _check_engine(cfg)
    require(
        r.temperature >= 0, "rollout.temperature", f"must be >= 0 (0: greedy), got {r.temperature}"
    )
    require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    require(alg.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {alg.kl_coef}")
    require(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    for key, value in (
        ("rollout.batch_size", r.batch_size),
        ("rollout.group_size", r.group_size),
        ("rollout.max_concurrent_rollouts", r.max_concurrent_rollouts),
        ("rollout.num_servers", r.num_servers),
        ("rollout.max_new_tokens", r.max_new_tokens),
        ("actor.ppo_minibatches", a.ppo_minibatches),
    ):
        require(value >= 1, key, f"must be >= 1, got {value}")
    require(
        r.batch_size % a.ppo_minibatches == 0,
        "actor.ppo_minibatches",
        f"{a.ppo_minibatches} must divide rollout.batch_size {r.batch_size}",
    )
    kind = _data_kind(cfg.data)
    require(
        r.workflow in ("auto", kind) or ":" in r.workflow,
        "rollout.workflow",
        f"{_data_name(cfg.data)} runs the {kind!r} workflow (or 'auto', or module.path:factory), "
        f"got {r.workflow!r}",
    )
    if ":" in r.workflow:
        import_object(r.workflow, "rollout.workflow")
    _check_actor_ranks(cfg)
    validate_data(cfg)


def validate_sft(cfg: LLMConfig) -> None:
    require_extra("runner.task", "llm", "the llm half", *LLM_PACKAGES)
    s = cfg.sft
    for key in ("steps", "batch_size", "eval_size"):
        require(getattr(s, key) >= 1, f"sft.{key}", f"must be >= 1, got {getattr(s, key)}")
    require(s.lr > 0, "sft.lr", f"must be > 0, got {s.lr}")
    validate_data(cfg, sft=True)
    from pathlib import Path

    if Path(cfg.model.path).exists():  # else tidal sft builds a tiny model there
        validate_model_path(cfg)
    else:
        from tidal.models.lm import ModelConfigError, check_load_options

        try:
            check_load_options(cfg.model.dtype, cfg.model.attn_implementation)
        except ModelConfigError as exc:
            raise ConfigError(str(exc)) from None
        require(
            cfg.data.path is None or cfg.data.chat_template,
            "data.chat_template",
            "tidal sft builds a chat model for a dataset file: set data.chat_template=true",
        )


def _data_kind(d: DataConfig) -> str:
    """The workflow the data runs: a dataset file is single-turn; a task says which it is."""
    if d.path is not None:
        return "rlvr"
    from tidal.rollout.tasks import TASKS

    require(
        d.task in TASKS.names(),
        "data.task",
        f"expected one of {', '.join(TASKS.names())}, got {d.task!r}",
    )
    return "multi_turn" if TASKS.get(d.task).multi_turn else "rlvr"


def _data_name(d: DataConfig) -> str:
    return f"data.path {d.path!r}" if d.path is not None else f"task {d.task!r}"


def validate_data(cfg: LLMConfig, sft: bool = False) -> None:
    """Dataset files, their keys, the chat-template options and the reward, checked before the run
    folder exists (``sft``: data.messages_key conversations may replace prompt/answer records)."""
    d = cfg.data
    kind = _data_kind(d)
    require(
        d.system_prompt is None or d.chat_template,
        "data.system_prompt",
        "a system prompt needs data.chat_template=true",
    )
    require(d.eval_size >= 1, "data.eval_size", f"must be >= 1, got {d.eval_size}")
    if d.path is not None:
        conversations = sft and d.messages_key is not None
        require(
            not conversations or d.chat_template,
            "data.messages_key",
            "conversations are rendered with the chat template: set data.chat_template=true",
        )
        _check_file(d, d.path, "data.path", conversations)
    if d.eval_path is not None:
        _check_file(d, d.eval_path, "data.eval_path", conversations=False)
    require(
        kind == "rlvr" or cfg.reward.name == "auto",
        "reward.name",
        f"task {d.task!r} is multi-turn: its environment gives the reward (leave reward.name: auto)",
    )
    if kind == "rlvr":
        configured_reward(cfg)


def _check_file(d: DataConfig, path: str, key: str, conversations: bool) -> None:
    """The file loads, holds records with the configured keys, and chat-message prompts come
    with data.chat_template."""
    import tempfile

    from tidal.data.datasets import DataConfigError, load_conversations, load_prompts

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


def configured_reward(cfg: LLMConfig):
    """The :class:`~tidal.rollout.rewards.Reward` of single-turn episodes and evaluation:
    ``reward.name`` resolved, or with ``auto`` a generated task's own (exact_match for a file)."""
    from tidal.rollout.rewards import Reward, resolve_reward

    name, kwargs = cfg.reward.name, dict(cfg.reward.kwargs)
    if name == "auto" and cfg.data.path is None:
        from tidal.rollout.tasks import TASKS

        return Reward(cfg.data.task, TASKS.get(cfg.data.task).reward, kwargs)
    try:
        return resolve_reward("exact_match" if name == "auto" else name, kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def validate_model_path(cfg: LLMConfig) -> None:
    """The model folder holds a causal LM (no weights read), the load options are known, its
    context holds the generated tokens, and its tokenizer has a chat template when asked."""
    from tidal.models.lm import (
        ModelConfigError,
        check_causal_lm,
        check_load_options,
        load_tokenizer,
        require_template,
    )

    m = cfg.model
    try:
        check_load_options(m.dtype, m.attn_implementation)
        model_cfg = check_causal_lm(m.path)
        if cfg.data.chat_template:
            require_template(load_tokenizer(m.path))
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None
    context = getattr(model_cfg, "max_position_embeddings", None)
    require(
        context is None or cfg.rollout.max_new_tokens < context,
        "rollout.max_new_tokens",
        f"{cfg.rollout.max_new_tokens} does not fit the model's context of {context} tokens",
    )


def import_object(spec: str, key: str):
    """``module.path:name`` imported, or a config error naming ``key``."""
    import importlib

    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {exc}") from None
    require(hasattr(module, name), key, f"module {module_name!r} has no {name!r}")
    return getattr(module, name)


def _check_engine(cfg: LLMConfig) -> None:
    from tidal.rollout.engines import ROLLOUT_ENGINES

    one_of(cfg.rollout.engine, ROLLOUT_ENGINES.names(), "rollout.engine")
    ROLLOUT_ENGINES.get(cfg.rollout.engine).validate(cfg)


def _check_actor_ranks(cfg: LLMConfig) -> None:
    """A data-parallel trainer (ray only) takes whole prompts' groups: batch_size splits evenly."""
    ranks = world_sizes(cfg.cluster, ["rollout", "actor"])["actor"]
    require(
        ranks == 1 or cfg.cluster.backend == "ray",
        "cluster.placement",
        "a data-parallel trainer (more than one actor rank) needs cluster.backend=ray",
    )
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    require(
        rows % (ranks * cfg.actor.ppo_minibatches) == 0,
        "rollout.batch_size",
        f"{rows} sequences per step do not split evenly into {cfg.actor.ppo_minibatches} minibatches "
        f"over {ranks} actor ranks",
    )
