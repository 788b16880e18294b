"""The embodied training config and its rules between keys. Every field is visible here, with
its help (``tidal config FILE`` prints it). The checks that need the world (registered names,
the placement's ranks, the env, a saved policy) are tidal.runners.preflight's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tidal.config.common import (
    WEIGHT_SYNCS,
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
from tidal.config.offpolicy import (
    ON_POLICY,
    PPO_FAMILY,
    SAC_ONLY,
    ReplayConfig,
    SACAlgorithmFields,
    validate_offpolicy,
)
from tidal.config.schema import half, section, setting


@dataclass
class EmbodiedRunnerConfig(RunnerConfig):
    """The run loop, plus what only the embodied loop has."""

    max_env_steps: int | None = setting(None, "stop once this many env steps were collected")
    weight_sync_interval: int = setting(
        1, "send the actor's weights to the rollout every this many steps"
    )
    overlap_env_bootstrap: bool = setting(
        False, "while the actor trains, envs start the next epoch (resets, first observations)"
    )
    eval_video: bool = setting(
        False, "at each evaluation, write a video of eval episodes to run_folder/videos"
    )
    eval_video_envs: int = setting(2, "eval envs shown side by side in the video")
    eval_video_size: int = setting(128, "side of each env's square frame, in pixels")
    eval_video_format: str = setting("gif", "gif | mp4 (mp4 needs imageio-ffmpeg)")
    eval_sampled: bool = setting(
        False,
        "also evaluate each time with sampled actions, on the same episodes: eval_sampled/* "
        "(eval/* stays the rollout.eval_deterministic evaluation)",
    )


@dataclass
class EnvConfig:
    """The simulators: adapter, task, vectorisation, action chunks."""

    adapter: str = setting("gymnasium", "env adapter from the registry (tidal.envs)")
    id: str = setting(
        "CartPole-v1",
        "the env id the adapter makes (gymnasium: a registered id or module.path:EnvId)",
    )
    kwargs: dict[str, Any] = setting(factory=dict, help="passed to the env itself (gymnasium.make)")
    adapter_kwargs: dict[str, Any] = setting(factory=dict, help="passed to the adapter")
    obs_mode: str = setting(
        "state", "state | pixels | state+pixels (pixels: adapters that render, e.g. metaworld)"
    )
    image_size: int = setting(64, "side of the square rendered images (obs_mode with pixels)")
    total_num_envs: int = setting(8, "training envs over all env ranks")
    pipeline_stage_num: int = setting(
        1, "pipeline stages: stage i+1 simulates while stage i is inferred"
    )
    num_action_chunks: int = setting(
        1, "actions per chunk step (the policy predicts a chunk at once)"
    )
    auto_reset: bool = setting(True, "reset envs whose episode ended inside an epoch")
    max_episode_steps: int | None = setting(None, "time limit; None: the env's own")
    vectorization_mode: str = setting(
        "sync", "sync | async (gymnasium vector envs; sync is faster on few cores)"
    )
    eval_num_envs: int = setting(8, "evaluation envs over all env ranks")
    group_size: int = setting(1, "envs that reset with the same seed (embodied GRPO groups)")
    max_nonfinite_steps: int = setting(
        16,
        "abort when an env returns a non-finite observation or reward this many chunk steps in "
        "a row (fewer: warn, mask its samples, restart it)",
    )


@dataclass
class RolloutConfig:
    """The policy's inference side."""

    num_steps: int = setting(128, "chunk steps per env per training step")
    max_staleness: int = setting(
        0,
        "eta: how many versions behind a trained sample may be; 0 is synchronous RL, > 0 keeps "
        "the envs collecting while the actor trains",
    )
    staleness_policy: str = setting(
        "wait",
        "a segment that would exceed eta: wait (collection pauses until the actor catches up) "
        "or drop (collection never pauses; samples older than eta are left out of the loss, "
        "counted)",
    )
    eval_deterministic: bool = setting(True, "evaluate with the mode of the action distribution")
    weight_sync: str = setting(
        "auto",
        "how the actor's weights reach the rollout (tidal.runtime.weight_sync): channel | "
        "collective | disk; auto: collective, or channel in asynchronous runs (their rollout "
        "takes a waiting update between chunk steps)",
    )
    weight_sync_bucket_mb: float = setting(256.0, "collective: MiB per broadcast bucket")


@dataclass
class FlowConfig:
    """The ``flow`` policy's denoising chain (flow matching; tidal.models.flow)."""

    steps: int = setting(10, "Euler steps from noise to an action chunk")
    noise: str = setting(
        "sde",
        "RL's stochastic chain: sde (the ODE as an SDE with the same marginals, noise from "
        "sigma) | learned (a noise head, starting at sigma)",
    )
    sigma: float = setting(0.5, "the chain's noise scale: exploration (sde) or its start (learned)")


@dataclass
class ModelConfig:
    """The policy network."""

    name: str = setting("mlp", "policy from the registry (tidal.models)")
    hidden_sizes: list[int] = setting(factory=lambda: [64, 64], help="hidden layer widths")
    activation: str = setting("tanh", "tanh | relu | gelu")
    critic: bool = setting(True, "a value head (needed by estimators that need a critic, e.g. gae)")
    obs_norm: bool = setting(False, "normalise observations with running statistics")
    init_log_std: float = setting(0.0, "initial log std of Gaussian policies")
    squash: bool = setting(False, "tanh-squash Gaussian actions into the action bounds")
    critic_layer_norm: bool = setting(
        False, "sac: LayerNorm after each hidden layer of the Q critics (RLPD)"
    )
    kwargs: dict[str, Any] = setting(
        factory=dict, help="policy-specific constructor args (vla: hidden_size, num_layers, ...)"
    )
    path: str | None = setting(
        None, "a saved policy folder: train starts from it; tidal sft writes it"
    )
    lora: LoRAConfig = section(LoRAConfig)
    flow: FlowConfig = section(FlowConfig)


@dataclass
class EmbodiedSFTConfig(SFTSchedule):
    """Behaviour cloning on scripted demonstrations (``tidal sft``; metaworld, libero envs)."""

    demos: int = setting(10, "demonstrations per task")
    steps: int = setting(500, "optimizer steps of behaviour cloning")
    batch_size: int = setting(64, "demonstration steps per optimizer step")
    lr: float = setting(1e-3, "learning rate of behaviour cloning")
    action_noise: float = setting(0.1, "std of Gaussian noise on the expert's executed actions")
    log_interval: int = setting(50, "log the loss every this many steps")


@dataclass
class EmbodiedAlgorithmConfig(AlgorithmConfig, SACAlgorithmFields):
    """The algorithm (``name``): the advantage estimator and the PPO objective with the
    embodied extras, or SAC's keys (tidal.config.offpolicy)."""

    gae_lambda: float = setting(0.95, "GAE lambda", when=PPO_FAMILY)
    normalize_advantages: bool = setting(
        True,
        "whiten advantages over the batch (estimators that ask for it)",
        when=PPO_FAMILY,
    )
    reward_type: str = setting(
        "chunk", "chunk: a chunk is one step; action: every action is a step"
    )
    reward_scale: float = setting(1.0, "multiply env rewards by this")
    logprob_type: str = setting(
        "chunk", "token | action | chunk: the level the PPO ratio is taken at"
    )
    dual_clip: float | None = setting(None, "dual-clip PPO constant (> 1)", when=PPO_FAMILY)
    value_clip: float | None = setting(
        None,
        "clip value updates to this distance from the old values",
        when=PPO_FAMILY,
    )
    huber_delta: float | None = setting(
        None,
        "Huber value loss with this delta; None: squared error",
        when=PPO_FAMILY,
    )
    vf_coef: float = setting(0.5, "value loss weight", when=PPO_FAMILY)
    entropy_bonus: float = setting(0.0, "entropy bonus weight", when=PPO_FAMILY)
    bootstrap_type: str = setting(
        "truncated", "truncated: bootstrap truncations; always: every done"
    )
    update_epochs: int = setting(4, "passes over the batch per training step", when=PPO_FAMILY)
    critic_warmup_steps: int = setting(
        0, "training steps that update only the critic", when=PPO_FAMILY
    )
    target_kl: float | None = setting(
        None, "stop a step's epochs early past this approximate KL", when=PPO_FAMILY
    )
    kl_coef: float = setting(
        0.0,
        "KL penalty (in the loss) to the policy training started from, e.g. model.path's "
        "behaviour-cloned one (> 0 keeps a frozen copy)",
        when=PPO_FAMILY,
    )
    kl_kind: str = setting("k3", "KL estimator: k1 | k2 | k3 | abs")
    recompute_values: bool = setting(
        True,
        "asynchronous runs: GAE, returns and value clipping use the actor's critic, not the "
        "older one the rollout collected with (eta = 0: they are the same)",
    )


@dataclass
class EmbodiedActorConfig(ActorConfig):
    """The train engine, with the embodied batch sizes."""

    global_batch_size: int = setting(256, "samples per optimizer step, over all actor ranks")
    micro_batch_size: int = setting(
        64, "samples per forward/backward (gradient accumulation up to global)"
    )
    adam_eps: float = setting(1e-5, "the optimizer's epsilon")
    max_grad_norm: float | None = setting(0.5, "clip the gradient norm to this; None: no clipping")


@dataclass
class RewardModelConfig:
    """An optional reward model group between env and actor."""

    enabled: bool = setting(False, "run a reward group")
    name: str = setting("scale", "a registered reward model (tidal.workers.reward_worker)")
    mode: str = setting("replace", "replace the env reward, or add to it")
    kwargs: dict[str, Any] = setting(factory=dict, help="passed to the reward model")


@half("embodied")
@dataclass
class EmbodiedConfig:
    cluster: ClusterConfig = section(ClusterConfig)
    runner: EmbodiedRunnerConfig = section(EmbodiedRunnerConfig)
    env: EnvConfig = section(EnvConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    model: ModelConfig = section(ModelConfig)
    algorithm: EmbodiedAlgorithmConfig = section(EmbodiedAlgorithmConfig)
    actor: EmbodiedActorConfig = section(EmbodiedActorConfig)
    reward: RewardModelConfig = section(RewardModelConfig)
    sft: EmbodiedSFTConfig = section(EmbodiedSFTConfig)
    replay: ReplayConfig = section(ReplayConfig, when=SAC_ONLY)

    def __post_init__(self):
        resolve_algorithm(self)

    def inapplicable_sections(self) -> set[str]:
        """Sections this run does not read (``tidal config`` leaves them out at defaults)."""
        unread = set() if self.replay.sft_demos else {"sft"}
        return unread | (set() if self.reward.enabled else {"reward"})

    def asynchronous_rollout(self) -> bool:
        """Whether the rollout takes weight updates between chunk steps (asynchronous PPO,
        off-policy algorithms)."""
        return bool(self.rollout.max_staleness) or self.algorithm.name not in ON_POLICY

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "actor.seed": "runner.seed",
        "runner.target_eval_return": "runner.target_value (with runner.target_metric: eval/return_mean)",
    }


# metric names an embodied evaluation no longer reports, and the name that replaced them
RENAMED_METRICS = {
    "eval/return": "eval/return_mean",
    "eval_sampled/return": "eval_sampled/return_mean",
}
OBS_MODES = ("state", "pixels", "state+pixels")
SHARED_MODEL_FIELDS = (
    "hidden_sizes",
    "activation",
    "critic",
    "obs_norm",
    "init_log_std",
    "squash",
    "flow",
)


def components(cfg: EmbodiedConfig) -> list[str]:
    """The worker groups of a run, as ``cluster.placement`` names them."""
    return ["env", "rollout", "actor"] + (["reward"] if cfg.reward.enabled else [])


def same_process(cfg: EmbodiedConfig) -> list[str]:
    """The groups whose ranks share processes: ``cluster.same_process`` as set. Unset (null),
    env and rollout share theirs on ray when one placement entry names both and there is one
    pipeline stage: the two then take turns, so a process boundary only adds a message to every
    chunk step. With several stages, processes apart let one stage simulate while the other
    infers."""
    cluster = cfg.cluster
    if cluster.same_process is not None:
        return list(cluster.same_process)
    if cluster.backend != "ray" or cfg.env.pipeline_stage_num != 1:
        return []
    for key in cluster.resolved_placement(components(cfg)):
        if {"env", "rollout"} <= {name.strip() for name in str(key).split(",")}:
            return ["env,rollout"]
    return []


def validate_embodied(cfg: EmbodiedConfig) -> None:
    """The rules between keys of an embodied config (no registry, env or placement needed)."""
    env, alg, act = cfg.env, cfg.algorithm, cfg.actor
    validate_common(cfg.cluster, cfg.runner, act, alg)
    validate_ref_offload(act, alg, cfg.model.lora.rank)
    validate_lora(cfg.model.lora)
    validate_offpolicy(cfg)
    renamed = RENAMED_METRICS.get(cfg.runner.target_metric)
    require(
        renamed is None,
        "runner.target_metric",
        f"{cfg.runner.target_metric!r} is now {renamed!r} (tidal sft and tidal eval report the "
        "names a training run's evaluation does)",
    )
    one_of(cfg.model.activation, ("tanh", "relu", "gelu"), "model.activation")
    one_of(env.vectorization_mode, ("sync", "async"), "env.vectorization_mode")
    one_of(alg.reward_type, ("chunk", "action"), "algorithm.reward_type")
    one_of(alg.bootstrap_type, ("truncated", "always"), "algorithm.bootstrap_type")
    require(alg.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {alg.kl_coef}")
    one_of(cfg.reward.mode, ("replace", "add"), "reward.mode")
    one_of(cfg.runner.eval_video_format, ("gif", "mp4"), "runner.eval_video_format")
    one_of(alg.prox_logp_method, ("recompute", "loglinear"), "algorithm.prox_logp_method")
    one_of(cfg.rollout.staleness_policy, ("wait", "drop"), "rollout.staleness_policy")
    one_of(cfg.rollout.weight_sync, ("auto", *WEIGHT_SYNCS), "rollout.weight_sync")
    require(
        not (cfg.actor.offload and cfg.rollout.max_staleness),
        "actor.offload",
        "asynchronous runs (rollout.max_staleness > 0) train while the rollout generates",
    )
    require(
        cfg.rollout.weight_sync_bucket_mb > 0,
        "rollout.weight_sync_bucket_mb",
        f"must be > 0, got {cfg.rollout.weight_sync_bucket_mb}",
    )
    require(
        cfg.rollout.max_staleness >= 0,
        "rollout.max_staleness",
        f"must be >= 0, got {cfg.rollout.max_staleness}",
    )
    require(
        cfg.rollout.max_staleness == 0 or cfg.runner.weight_sync_interval == 1,
        "runner.weight_sync_interval",
        "asynchronous runs (rollout.max_staleness > 0) send weights after every step: set it to 1",
    )
    for key, value in (
        ("env.total_num_envs", env.total_num_envs),
        ("env.pipeline_stage_num", env.pipeline_stage_num),
        ("env.num_action_chunks", env.num_action_chunks),
        ("env.eval_num_envs", env.eval_num_envs),
        ("rollout.num_steps", cfg.rollout.num_steps),
        ("actor.global_batch_size", act.global_batch_size),
        ("actor.micro_batch_size", act.micro_batch_size),
        ("algorithm.update_epochs", alg.update_epochs),
        ("runner.max_steps", cfg.runner.max_steps),
        ("env.group_size", env.group_size),
        ("runner.weight_sync_interval", cfg.runner.weight_sync_interval),
        ("env.max_nonfinite_steps", env.max_nonfinite_steps),
        ("runner.eval_video_envs", cfg.runner.eval_video_envs),
        ("runner.eval_video_size", cfg.runner.eval_video_size),
    ):
        require(value >= 1, key, f"must be >= 1, got {value}")
    require(
        alg.reward_type == "chunk" or alg.logprob_type != "chunk",
        "algorithm.logprob_type",
        "reward_type 'action' gives one advantage per action: use logprob_type action or token",
    )
    require(
        alg.dual_clip is None or alg.dual_clip > 1,
        "algorithm.dual_clip",
        f"must be > 1, got {alg.dual_clip}",
    )
    one_of(env.obs_mode, OBS_MODES, "env.obs_mode")
    require(env.image_size >= 8, "env.image_size", f"must be >= 8, got {env.image_size}")
    for key in ("obs_mode", "image_size"):
        require(
            key not in env.adapter_kwargs, f"env.adapter_kwargs.{key}", f"set env.{key} instead"
        )
    for key in cfg.model.kwargs:
        require(key not in SHARED_MODEL_FIELDS, f"model.kwargs.{key}", f"set model.{key} instead")
    validate_flow(cfg.model.flow)


def validate_flow(flow: FlowConfig) -> None:
    require(flow.steps >= 1, "model.flow.steps", f"must be >= 1, got {flow.steps}")
    one_of(flow.noise, ("sde", "learned"), "model.flow.noise")
    require(flow.sigma > 0, "model.flow.sigma", f"must be > 0, got {flow.sigma}")


def validate_sft(cfg: EmbodiedConfig) -> None:
    """``tidal sft`` on an embodied config: a place to save (that the env has scripted
    demonstrations is the preflight's: tidal.envs.demos.DEMO_SOURCES)."""
    s = cfg.sft
    require(cfg.model.path is not None, "model.path", "tidal sft saves the policy there; set it")
    for key in ("demos", "steps", "batch_size", "log_interval"):
        require(getattr(s, key) >= 1, f"sft.{key}", f"must be >= 1, got {getattr(s, key)}")
    require(s.lr > 0, "sft.lr", f"must be > 0, got {s.lr}")
    require(s.action_noise >= 0, "sft.action_noise", f"must be >= 0, got {s.action_noise}")
    validate_sft_schedule(s)
