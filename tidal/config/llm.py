"""The config of asynchronous RL for language agents (``runner.task: llm``) and of ``tidal sft``,
with its rules between keys. The checks that need the world (registered names, dataset files,
the reward, the model folder, the engine, the placement's ranks) are tidal.runners.preflight's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tidal.config.agent import AgentConfig, validate_agent
from tidal.config.common import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    RunnerConfig,
    SFTSchedule,
    one_of,
    resolve_algorithm,
    validate_common,
    validate_ref_offload,
    validate_sft_schedule,
)
from tidal.config.loader import require
from tidal.config.lora import LoRAConfig, validate_lora
from tidal.config.schema import half, section, setting


@dataclass
class LLMRunnerConfig(RunnerConfig):
    """The run loop (the language half's defaults)."""

    task: str = setting("llm", "which half trains: embodied | llm")
    experiment: str = setting(
        "llm", "the run folder is run_dir/experiment (suffixed -2, -3, ... when taken)"
    )
    target_metric: str = setting("eval/accuracy", "the metric the target_value stop rule watches")


@dataclass
class LLMModelConfig:
    """The causal language model."""

    path: str = setting(
        "runs/models/arith",
        "a local Hugging Face causal language model folder (tidal sft writes it), a GGUF file, "
        "or a packaged model (smollm2-135m-instruct, pkg://module/file.gguf): a GGUF is "
        "dequantised once into a folder under ~/.cache/tidal (TIDAL_CACHE)",
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
    lora: LoRAConfig = section(LoRAConfig)


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
    tools_key: str = setting(
        "tools",
        "tidal sft: the field holding a conversation's tools (OpenAI function specs), rendered "
        "with the chat template where a record has them",
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
        "without data.path: a registered task (tidal.rollout.tasks): arithmetic | reverse | guess_number | word_problems | word_sums | word_products | word_two_steps",
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
class LLMRewardConfig:
    """The reward of single-turn episodes and of evaluation."""

    name: str = setting(
        "auto",
        "a registered reward (exact_match | math_verify | regex_match), module.path:function, "
        "or auto: a generated task's own, exact_match for a dataset file",
    )
    kwargs: dict[str, Any] = setting(
        factory=dict, help="options passed to the reward (they win over record fields)"
    )
    overlong_buffer: int = setting(
        0,
        "DAPO's overlong reward shaping: over the last this many tokens of "
        "rollout.max_new_tokens the reward falls linearly by up to reward.overlong_penalty "
        "(0: off)",
    )
    overlong_penalty: float = setting(1.0, "the shaping's largest penalty, at the token budget")


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
    dynamic_sampling: bool = setting(
        False,
        "DAPO's dynamic sampling: a group whose rewards are all equal (no advantage to learn "
        "from; for agents and multi-turn episodes, the group's runs) is dropped and more "
        "prompts are drawn until the batch is full (rollout/filtered_groups)",
    )
    group_size: int = setting(8, "samples per prompt")
    workflow: str = setting(
        "auto",
        "auto (agent with rollout.agent.command or url, else by data.task) | rlvr | multi_turn | "
        "agent | module.path:factory(WorkflowContext) -> Workflow (tidal.rollout.workflows)",
    )
    agent: AgentConfig = section(
        AgentConfig, "an agent in its own process: a command per episode, or a service"
    )
    tool_parser: str = setting(
        "hermes",
        "how tool calls are parsed from the model's text, by the session proxy and by the run's "
        "servers' /v1/chat/completions (tidal.inference.tool_calls; tidal serve --tool-parser)",
    )
    agent_mode: str = setting(
        "auto",
        "agent: its calls as training sequences: concat (one per run) | individual (one per "
        "call, rollout.turn_discount per later call) | auto",
    )
    max_new_tokens: int = setting(6, "generated tokens per turn")
    temperature: float = setting(1.0, "sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "nucleus sampling mass")
    top_k: int = setting(-1, "top-k sampling; -1: off")
    max_turns: int = setting(6, "multi-turn: turns per episode")
    turn_discount: float = setting(0.9, "multi-turn: reward discount per extra turn")
    reward_timeout_s: float = setting(10.0, "bound on one reward function call")
    pause_mode: str = setting(
        "abort",
        "weight update: abort (in-flight requests aborted and resubmitted) | keep (paused in "
        "place; in_place, SGLang's name for it, is read as keep)",
    )
    engine: str = setting(
        "tidal",
        "the generation engine the rollout servers run (tidal.rollout.servers): tidal | vllm",
    )
    dtype: str | None = setting(
        None,
        "the servers' precision: float32 | bfloat16 | float16 | auto; None: model.dtype. The "
        "trainer keeps model.dtype and recomputes the log-probs (train/mismatch_kl is the gap); "
        "bfloat16 decodes faster on CPUs with AVX512-BF16 or AMX and on GPUs",
    )
    weight_sync: str = setting(
        "auto",
        "how the trainer's weights reach the servers (tidal.runtime.weight_sync): channel | "
        "collective | disk; auto: the engine's first (tidal: collective; vllm: disk, a "
        "safetensors folder its servers reload)",
    )
    weight_sync_bucket_mb: float = setting(256.0, "collective: MiB per broadcast bucket")
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
class LLMAlgorithmConfig(AlgorithmConfig):
    """The advantage estimator and the (decoupled) PPO objective for language agents."""

    adv_type: str = setting("grpo", "a critic-free advantage estimator from the registry")
    gamma: float = setting(1.0, "discount over tokens")
    recompute_logprob: bool = setting(
        True, "standard PPO: old log-probs from a forward pass (else from inference)"
    )
    kl_coef: float = setting(0.0, "KL penalty to a frozen reference model (> 0 keeps one)")
    kl_kind: str = setting("k3", "KL estimator: k1 | k2 | k3 | ...")
    kl_in: str = setting("loss", "apply the KL in the loss or shape it into the reward")
    importance_level: str = setting(
        "token", "the importance ratio per token (PPO) or per sequence (GSPO: its clip defaults)"
    )
    rollout_correction: str = setting(
        "none",
        "train-inference mismatch correction of standard PPO by r = pi_trainer / pi_rollout: "
        "none | token_tis | seq_tis (truncated at the cap) | seq_mis (sequences outside "
        "[lower, cap] dropped) | icepop (tokens outside [lower, cap] dropped); the decoupled "
        "loss corrects with its behaviour weight instead",
    )
    rollout_correction_cap: float = setting(2.0, "upper bound of the correction's ratio")
    rollout_correction_lower: float = setting(
        0.5, "lower bound of the ratio (seq_mis, icepop): below it the token or sequence drops"
    )


@dataclass
class LLMActorConfig(ActorConfig):
    """The train engine, with the language batch layout."""

    lr: float = setting(1e-4, "learning rate")
    optimizer: str = setting("adamw", "adam | adamw")
    max_tokens_per_mb: int = setting(4096, "micro-batches are packed up to this many tokens")
    ppo_minibatches: int = setting(1, "optimizer steps per training step")
    shared_prefix: bool = setting(
        False,
        "run a group's shared prompt once in the trainer's forward passes, its samples' answers "
        "attending to it through a block mask (tidal.algorithms.prefix): fewer tokens, longer "
        "attention; pays for short answers to long prompts (sdpa or eager attention)",
    )


@dataclass
class LLMSFTConfig(SFTSchedule):
    """``tidal sft``: supervised warm start."""

    steps: int = setting(600, "optimizer steps")
    batch_size: int = setting(64, "sequences per step")
    lr: float = setting(1e-3, "learning rate")
    eval_size: int = setting(
        256,
        "held-out problems scored at the end, greedy and single-turn (0: none, e.g. for an "
        "agent's demonstrations, which only the RL run's evaluation through the agent scores)",
    )


@half("llm")
@dataclass
class LLMConfig:
    cluster: ClusterConfig = section(ClusterConfig)
    runner: LLMRunnerConfig = section(LLMRunnerConfig)
    model: LLMModelConfig = section(LLMModelConfig)
    data: DataConfig = section(DataConfig)
    reward: LLMRewardConfig = section(LLMRewardConfig)
    rollout: LLMRolloutConfig = section(LLMRolloutConfig)
    algorithm: LLMAlgorithmConfig = section(LLMAlgorithmConfig)
    actor: LLMActorConfig = section(LLMActorConfig)
    sft: LLMSFTConfig = section(LLMSFTConfig)

    def __post_init__(self):
        resolve_algorithm(self, self.algorithm.importance_level)

    def inapplicable_sections(self) -> set[str]:
        """Sections a training run does not read (``tidal sft`` reads ``sft``)."""
        return {"sft"}

    @property
    def rollout_dtype(self) -> str:
        """The inference servers' precision: ``rollout.dtype``, else the trainer's."""
        return self.rollout.dtype or self.model.dtype

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
    """The rules between keys of a language config (no registry, file or placement needed)."""
    a, alg, r = cfg.actor, cfg.algorithm, cfg.rollout
    validate_common(cfg.cluster, cfg.runner, a, alg)
    validate_ref_offload(a, alg, cfg.model.lora.rank)
    validate_lora(cfg.model.lora)
    one_of(
        alg.prox_logp_method, ("recompute", "loglinear", "metrics"), "algorithm.prox_logp_method"
    )
    one_of(alg.kl_in, ("loss", "reward"), "algorithm.kl_in")
    if r.dtype is not None:
        one_of(r.dtype, ("float32", "bfloat16", "float16", "auto"), "rollout.dtype")
    lower, cap = alg.rollout_correction_lower, alg.rollout_correction_cap
    require(
        0 < lower < 1 < cap,
        "algorithm.rollout_correction_lower",
        f"needs 0 < rollout_correction_lower < 1 < rollout_correction_cap, got {lower} and {cap}",
    )
    if alg.rollout_correction != "none":
        require(
            not alg.use_decoupled_loss,
            "algorithm.rollout_correction",
            "the decoupled loss corrects the behaviour policy with its own weights "
            "(algorithm.behav_weight_cap, cap_mode: token_tis is cap_mode=clamp); set "
            "use_decoupled_loss=false to correct standard PPO",
        )
        require(
            alg.recompute_logprob,
            "algorithm.rollout_correction",
            "needs the trainer's own log-probs: set algorithm.recompute_logprob=true",
        )
    one_of(r.pause_mode, ("abort", "keep", "in_place"), "rollout.pause_mode")
    validate_agent(r.agent)
    require(
        r.workflow != "agent" or r.agent.command is not None or r.agent.url is not None,
        "rollout.workflow",
        "agent needs rollout.agent.command or rollout.agent.url",
    )
    one_of(r.agent_mode, ("concat", "individual", "auto"), "rollout.agent_mode")
    require(
        not (a.offload and r.max_staleness),
        "actor.offload",
        "asynchronous runs (rollout.max_staleness > 0) train while the servers generate",
    )
    require(
        r.weight_sync_bucket_mb > 0,
        "rollout.weight_sync_bucket_mb",
        f"must be > 0, got {r.weight_sync_bucket_mb}",
    )
    require(
        r.temperature >= 0, "rollout.temperature", f"must be >= 0 (0: greedy), got {r.temperature}"
    )
    require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    w = cfg.reward
    require(
        0 <= w.overlong_buffer < r.max_new_tokens,
        "reward.overlong_buffer",
        f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}), got {w.overlong_buffer}",
    )
    require(
        w.overlong_penalty >= 0,
        "reward.overlong_penalty",
        f"must be >= 0, got {w.overlong_penalty}",
    )
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


def validate_llm_sft(cfg: LLMConfig) -> None:
    """The ``sft`` section's rules."""
    s = cfg.sft
    for key in ("steps", "batch_size"):
        require(getattr(s, key) >= 1, f"sft.{key}", f"must be >= 1, got {getattr(s, key)}")
    require(s.eval_size >= 0, "sft.eval_size", f"must be >= 0, got {s.eval_size}")
    require(s.lr > 0, "sft.lr", f"must be > 0, got {s.lr}")
    validate_sft_schedule(s)


def validate_data(cfg: LLMConfig, sft: bool = False) -> None:
    """The ``data`` section's rules between keys (``sft``: data.messages_key conversations may
    replace prompt/answer records)."""
    d = cfg.data
    require(
        d.system_prompt is None or d.chat_template,
        "data.system_prompt",
        "a system prompt needs data.chat_template=true",
    )
    require(d.eval_size >= 1, "data.eval_size", f"must be >= 1, got {d.eval_size}")
    require(
        not (sft and d.path is not None and d.messages_key is not None) or d.chat_template,
        "data.messages_key",
        "conversations are rendered with the chat template: set data.chat_template=true",
    )


def validate_actor_ranks(cfg: LLMConfig, ranks: int) -> None:
    """A data-parallel trainer takes whole prompts' groups: batch_size splits evenly."""
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    require(
        rows % (ranks * cfg.actor.ppo_minibatches) == 0,
        "rollout.batch_size",
        f"{rows} sequences per step do not split evenly into {cfg.actor.ppo_minibatches} minibatches "
        f"over {ranks} actor ranks",
    )
