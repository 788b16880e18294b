"""The embodied training config and its validation rules. Every field is visible here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidal.config.loader import ConfigError, require

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinpp_baseline")


@dataclass
class ClusterConfig:
    backend: str = "local"  # local: threads of this process; ray: Ray actors
    address: str | None = None  # a running Ray cluster to join (ray backend)
    devices_per_node: int | None = None  # GPUs or CPU slots per node; None: detected
    # intra-op threads per process: small models run fastest single-threaded (3.6 ms vs 12.7 ms
    # per PPO micro-step of a 64x64 MLP on a 2-core machine); raise it for large models
    torch_threads: int = 1
    # component(s) -> devices, e.g. {"env": "0", "rollout,actor": "1"}; empty: all on device 0
    placement: dict[str, str] = field(default_factory=dict)

    def resolved_placement(self, components: list[str]) -> dict[str, str]:
        return dict(self.placement) or {",".join(components): "0"}


@dataclass
class RunnerConfig:
    task: str = "embodied"
    experiment: str = "run"
    run_dir: str = "runs"  # the run folder is run_dir/experiment
    seed: int = 1
    max_steps: int = 100  # training steps (each: one rollout epoch, then an update)
    max_env_steps: int | None = None  # stop once this many env steps were collected
    target_eval_return: float | None = None  # stop once an evaluation reaches this
    weight_sync_interval: int = 1
    eval_interval: int = 10  # 0: never
    save_interval: int = 0  # 0: only at the end
    resume_from: str | None = None  # a checkpoint folder
    timeout_s: float = 600.0  # bound on every wait for a phase
    # while the actor trains, envs start the next epoch (resets, first observations)
    overlap_env_bootstrap: bool = False
    progress: bool = True  # live progress on the terminal


@dataclass
class EnvConfig:
    adapter: str = "gymnasium"
    id: str = "CartPole-v1"
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the env itself (gymnasium.make)
    adapter_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the adapter
    total_num_envs: int = 8
    pipeline_stage_num: int = 1
    num_action_chunks: int = 1
    auto_reset: bool = True
    max_episode_steps: int | None = None  # None: the env's own limit
    vectorization_mode: str = "sync"
    eval_num_envs: int = 8
    group_size: int = 1  # envs that reset with the same seed (embodied GRPO groups)


@dataclass
class RolloutConfig:
    num_steps: int = 128  # chunk steps per env per training step
    eval_deterministic: bool = True


@dataclass
class ModelConfig:
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: str = "tanh"
    critic: bool = True
    obs_norm: bool = False
    init_log_std: float = 0.0
    squash: bool = False


@dataclass
class AlgorithmConfig:
    adv_type: str = "gae"
    gamma: float = 0.99
    gae_lambda: float = 0.95
    normalize_advantages: bool = True
    reward_type: str = "chunk"  # chunk: a chunk is one step; action: every action is a step
    reward_scale: float = 1.0
    logprob_type: str = "chunk"  # token | action | chunk
    loss_agg: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: float | None = None
    value_clip: float | None = None
    huber_delta: float | None = None
    vf_coef: float = 0.5
    entropy_bonus: float = 0.0
    bootstrap_type: str = "truncated"  # truncated: bootstrap truncations; always: every done
    update_epochs: int = 4
    critic_warmup_steps: int = 0  # training steps that update only the critic
    target_kl: float | None = None  # stop the epochs of a step early past this approx KL


@dataclass
class ActorConfig:
    global_batch_size: int = 256  # samples per optimizer step, over all actor ranks
    micro_batch_size: int = 64  # samples per forward/backward
    lr: float = 2.5e-4
    lr_schedule: str = "constant"  # constant | linear | cosine (over runner.max_steps)
    warmup_steps: int = 0
    max_grad_norm: float | None = 0.5
    adam_eps: float = 1e-5
    weight_decay: float = 0.0
    bf16: bool = False
    seed: int = 1


@dataclass
class RewardConfig:
    enabled: bool = False
    name: str = "scale"  # a registered reward model (tidal.workers.reward)
    mode: str = "replace"  # replace the env reward, or add to it
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbodiedConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


def _one_of(value, allowed, key: str) -> None:
    require(value in allowed, key, f"expected one of {', '.join(map(str, allowed))}, got {value!r}")


def validate_embodied(cfg: EmbodiedConfig) -> dict[str, int]:
    """Check every cross-field rule; return the world size of each component."""
    from tidal.algorithms import list_advantages
    from tidal.algorithms.losses import AGGREGATIONS, LOGPROB_LEVELS
    from tidal.envs import list_env_adapters
    from tidal.runtime import ComponentPlacement, PlacementError

    env, alg, act = cfg.env, cfg.algorithm, cfg.actor
    _one_of(cfg.cluster.backend, ("local", "ray"), "cluster.backend")
    _one_of(alg.adv_type, list_advantages(), "algorithm.adv_type")
    _one_of(alg.reward_type, ("chunk", "action"), "algorithm.reward_type")
    _one_of(alg.logprob_type, LOGPROB_LEVELS, "algorithm.logprob_type")
    _one_of(alg.loss_agg, AGGREGATIONS, "algorithm.loss_agg")
    _one_of(alg.bootstrap_type, ("truncated", "always"), "algorithm.bootstrap_type")
    _one_of(act.lr_schedule, ("constant", "linear", "cosine"), "actor.lr_schedule")
    _one_of(env.adapter, list_env_adapters(), "env.adapter")
    _one_of(cfg.reward.mode, ("replace", "add"), "reward.mode")
    for key, value in (("env.total_num_envs", env.total_num_envs), ("env.pipeline_stage_num", env.pipeline_stage_num),
                       ("env.num_action_chunks", env.num_action_chunks), ("env.eval_num_envs", env.eval_num_envs),
                       ("rollout.num_steps", cfg.rollout.num_steps), ("actor.global_batch_size", act.global_batch_size),
                       ("actor.micro_batch_size", act.micro_batch_size), ("algorithm.update_epochs", alg.update_epochs),
                       ("runner.max_steps", cfg.runner.max_steps), ("env.group_size", env.group_size),
                       ("runner.weight_sync_interval", cfg.runner.weight_sync_interval)):
        require(value >= 1, key, f"must be >= 1, got {value}")
    require(alg.reward_type == "chunk" or alg.adv_type != "gae", "algorithm.reward_type",
             "'action' needs a value per action; use 'chunk' with adv_type gae")
    require(alg.reward_type == "chunk" or alg.logprob_type != "chunk", "algorithm.logprob_type",
             "reward_type 'action' gives one advantage per action: use logprob_type action or token")
    require(not (alg.adv_type == "gae" and not cfg.model.critic), "model.critic", "adv_type gae needs a critic")
    require(alg.dual_clip is None or alg.dual_clip > 1, "algorithm.dual_clip", f"must be > 1, got {alg.dual_clip}")
    require(0 <= alg.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {alg.gamma}")

    components = ["env", "rollout", "actor"] + (["reward"] if cfg.reward.enabled else [])
    try:
        num_devices = _num_devices_hint(cfg)
        placement = ComponentPlacement(cfg.cluster.resolved_placement(components), num_devices)
        worlds = {c: placement.get_world_size(c) for c in components}
    except PlacementError as exc:
        raise placement_config_error(exc) from None

    stages = env.pipeline_stage_num
    require(env.total_num_envs % (worlds["env"] * stages) == 0, "env.total_num_envs",
             f"{env.total_num_envs} must divide evenly over {worlds['env']} env ranks x {stages} pipeline stages")
    per_stage = env.total_num_envs // stages
    require(per_stage % worlds["rollout"] == 0, "env.total_num_envs",
             f"each pipeline stage's {per_stage} envs must divide evenly over {worlds['rollout']} rollout ranks")
    require(env.total_num_envs % worlds["actor"] == 0, "env.total_num_envs",
             f"{env.total_num_envs} must divide evenly over {worlds['actor']} actor ranks")
    require(env.eval_num_envs % worlds["env"] == 0 and env.eval_num_envs % worlds["rollout"] == 0, "env.eval_num_envs",
             f"{env.eval_num_envs} must divide evenly over {worlds['env']} env and {worlds['rollout']} rollout ranks")
    if cfg.reward.enabled:
        require(per_stage % worlds["reward"] == 0, "env.total_num_envs",
                 f"each pipeline stage's {per_stage} envs must divide evenly over {worlds['reward']} reward ranks")
    samples = env.total_num_envs * cfg.rollout.num_steps
    require(samples % act.global_batch_size == 0, "actor.global_batch_size",
             f"the {samples} samples of a step (total_num_envs x num_steps) must divide into batches of {act.global_batch_size}")
    require(act.global_batch_size % (act.micro_batch_size * worlds["actor"]) == 0, "actor.global_batch_size",
             f"{act.global_batch_size} must be a multiple of micro_batch_size x actor ranks "
             f"= {act.micro_batch_size} x {worlds['actor']}")
    if alg.adv_type in GROUP_ESTIMATORS:
        require(env.group_size > 1, "env.group_size", f"adv_type {alg.adv_type} needs groups of 2 or more envs")
        require(not env.auto_reset, "env.auto_reset", f"adv_type {alg.adv_type} scores whole episodes: set it to false")
        per_actor = env.total_num_envs // worlds["actor"]
        require(per_actor % env.group_size == 0, "env.group_size",
                 f"groups of {env.group_size} must not straddle actor ranks ({per_actor} envs each)")
    if cfg.cluster.backend == "local":
        require(worlds["actor"] == 1, "cluster.placement",
                 "a data-parallel actor (more than one rank) needs cluster.backend=ray")
    return worlds


def placement_config_error(exc: Exception) -> ConfigError:
    """A placement error as a config error naming its key (some already start with it)."""
    msg = str(exc)
    return ConfigError(msg if msg.startswith("cluster.") else f"cluster.{msg}")


def _num_devices_hint(cfg: EmbodiedConfig) -> int:
    """Devices to validate placement against before the cluster exists: the configured count,
    or the highest device named (the cluster checks the real count when it starts)."""
    if cfg.cluster.devices_per_node is not None:
        return cfg.cluster.devices_per_node
    import os

    from tidal.runtime.placement import _parse_spec_string

    named = [d for spec in cfg.cluster.placement.values() if spec != "all"
             for d in _parse_spec_string(str(spec), 1 << 16, "cluster.placement")]
    return max([os.cpu_count() or 1, *(d + 1 for d in named)])
