"""The config of asynchronous RL for language agents (``runner.task: llm``) and of ``tidal sft``."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.config.embodied import ClusterConfig
from tidal.config.loader import require


@dataclass
class LLMRunnerConfig:
    task: str = "llm"
    experiment: str = "llm"
    run_dir: str = "runs"
    seed: int = 1
    max_steps: int = 100
    eval_interval: int = 10  # 0: never
    save_interval: int = 0  # 0: only at the end
    resume_from: str | None = None
    target_accuracy: float | None = None  # stop once an evaluation reaches it
    max_minutes: float | None = None  # stop after this much wall time
    timeout_s: float = 600.0
    progress: bool = True


@dataclass
class LMModelConfig:
    path: str = "runs/models/arith"  # a save_pretrained folder (tidal sft writes it)
    hidden: int = 128  # the tiny Llama tidal sft builds when path does not exist yet
    layers: int = 4
    heads: int = 4
    max_positions: int = 64


@dataclass
class DataConfig:
    task: str = "arithmetic"  # a registered task (tidal.rollout.tasks): arithmetic | reverse | guess_number
    digits: int = 2  # arithmetic
    max_len: int = 24  # reverse: the longest digit string
    ops: str = "+"
    train_size: int = 20000
    eval_size: int = 256
    seed: int = 0


@dataclass
class LLMRolloutConfig:
    num_servers: int = 1
    max_batch_size: int = 256  # per server
    max_staleness: int = 0  # eta: 0 is synchronous RL
    max_concurrent_rollouts: int = 16
    batch_size: int = 16  # episodes (prompts) per training step
    group_size: int = 8  # samples per prompt
    workflow: str = "auto"  # auto (by data.task) | rlvr | multi_turn | module.path:callable
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_turns: int = 6
    turn_discount: float = 0.9
    reward_timeout_s: float = 10.0
    # weight update: abort in-flight requests (resubmitted with their tokens so far, prefilled
    # again) or pause them in place (they keep their KV cache and continue on the new weights)
    pause_mode: str = "abort"


@dataclass
class LMActorConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_tokens_per_mb: int = 4096  # micro-batches are packed up to this many tokens
    ppo_minibatches: int = 1  # optimizer steps per training step
    adv_type: str = "grpo"
    use_decoupled_loss: bool = False
    prox_logp_method: str = "recompute"  # recompute | loglinear | metrics
    recompute_logprob: bool = True  # standard PPO: old logp from a forward pass (else from inference)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    behav_weight_cap: float | None = 5.0
    cap_mode: str = "mask"
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model
    kl_kind: str = "k3"
    kl_in: str = "loss"  # loss | reward


@dataclass
class SFTConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    eval_size: int = 256


@dataclass
class LLMConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: LLMRunnerConfig = field(default_factory=LLMRunnerConfig)
    model: LMModelConfig = field(default_factory=LMModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: LLMRolloutConfig = field(default_factory=LLMRolloutConfig)
    actor: LMActorConfig = field(default_factory=LMActorConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def validate_llm(cfg: LLMConfig) -> None:
    from tidal.algorithms import list_advantages
    from tidal.algorithms.kl import KL_KINDS
    from tidal.algorithms.losses import AGGREGATIONS

    a, r = cfg.actor, cfg.rollout
    require(a.adv_type in list_advantages() and a.adv_type != "gae", "actor.adv_type",
            f"expected a critic-free estimator ({', '.join(x for x in list_advantages() if x != 'gae')}), got {a.adv_type!r}")
    require(a.prox_logp_method in ("recompute", "loglinear", "metrics"), "actor.prox_logp_method",
            f"expected recompute, loglinear or metrics, got {a.prox_logp_method!r}")
    require(a.cap_mode in ("mask", "clamp"), "actor.cap_mode", f"expected mask or clamp, got {a.cap_mode!r}")
    require(a.loss_agg in AGGREGATIONS[:3], "actor.loss_agg", f"expected one of {', '.join(AGGREGATIONS[:3])}, got {a.loss_agg!r}")
    require(a.kl_kind in KL_KINDS, "actor.kl_kind", f"expected one of {', '.join(KL_KINDS)}, got {a.kl_kind!r}")
    require(a.kl_in in ("loss", "reward"), "actor.kl_in", f"expected loss or reward, got {a.kl_in!r}")
    require(a.lr_schedule in ("constant", "linear", "cosine"), "actor.lr_schedule", f"got {a.lr_schedule!r}")
    require(r.pause_mode in ("abort", "in_place"), "rollout.pause_mode", f"expected abort or in_place, got {r.pause_mode!r}")
    require(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    for key, value in (("rollout.batch_size", r.batch_size), ("rollout.group_size", r.group_size),
                       ("rollout.max_concurrent_rollouts", r.max_concurrent_rollouts), ("rollout.num_servers", r.num_servers),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("actor.ppo_minibatches", a.ppo_minibatches)):
        require(value >= 1, key, f"must be >= 1, got {value}")
    require(r.batch_size % a.ppo_minibatches == 0, "actor.ppo_minibatches",
            f"{a.ppo_minibatches} must divide rollout.batch_size {r.batch_size}")
    from tidal.rollout.tasks import TASKS

    require(cfg.data.task in TASKS.names(), "data.task", f"expected one of {', '.join(TASKS.names())}, got {cfg.data.task!r}")
    kind = "multi_turn" if TASKS.get(cfg.data.task).multi_turn else "rlvr"
    require(r.workflow in ("auto", kind) or ":" in r.workflow, "rollout.workflow",
            f"task {cfg.data.task!r} runs the {kind!r} workflow (or 'auto', or module.path:factory), got {r.workflow!r}")
    require(cfg.cluster.backend in ("local", "ray"), "cluster.backend", f"expected local or ray, got {cfg.cluster.backend!r}")
    _check_actor_ranks(cfg)


def _check_actor_ranks(cfg: LLMConfig) -> None:
    """A data-parallel trainer (ray only) takes whole prompts' groups: batch_size splits evenly."""
    from tidal.config.embodied import _num_devices_hint, placement_config_error
    from tidal.runtime import ComponentPlacement, PlacementError

    try:
        placement = ComponentPlacement(cfg.cluster.resolved_placement(["rollout", "actor"]), _num_devices_hint(cfg))
        ranks = placement.get_world_size("actor")
    except PlacementError as exc:
        raise placement_config_error(exc) from None
    require(ranks == 1 or cfg.cluster.backend == "ray", "cluster.placement",
            "a data-parallel trainer (more than one actor rank) needs cluster.backend=ray")
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    require(rows % (ranks * cfg.actor.ppo_minibatches) == 0, "rollout.batch_size",
            f"{rows} sequences per step do not split evenly into {cfg.actor.ppo_minibatches} minibatches "
            f"over {ranks} actor ranks")
