"""The sections both halves share: one key per concept, whichever half you train.

``cluster`` (where workers run), ``runner`` (the run loop: folder, cadence, stop rules,
resume, loggers), ``actor`` (the train engine: optimizer, schedule, clipping, precision,
non-finite guard) and ``algorithm`` (the advantage estimator and the PPO clip). Each half
extends them with what only it has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tidal.config.loader import require
from tidal.config.offpolicy import PPO_FAMILY
from tidal.config.schema import decide, section, setting

# Every wait has a bound; this one when nobody gives one (``runner.timeout_s``, and the runtime's
# handles, channels and groups through tidal.runtime.defaults). ``TIDAL_WAIT_TIMEOUT`` overrides
# it for a whole process.
DEFAULT_TIMEOUT_S = float(os.environ.get("TIDAL_WAIT_TIMEOUT", "600"))

WEIGHT_SYNCS = ("channel", "collective", "disk")  # tidal.runtime.weight_sync registers them
LR_SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adam", "adamw")
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # 'trackers'


@dataclass
class ClusterConfig:
    """Where the worker groups run."""

    backend: str = setting(
        "local", "local: threads of this process; ray: Ray actors (processes, many nodes)"
    )
    address: str | None = setting(
        None, "a running Ray cluster to join (ray backend); None starts one"
    )
    connect_timeout_s: float = setting(30.0, "bound on joining the Ray cluster at cluster.address")
    devices_per_node: int | None = setting(None, "GPUs or CPU slots per node; None: detected")
    torch_threads: int = setting(1, "intra-op threads per process (small models run fastest on 1)")
    gil_switch_interval: float | None = setting(
        2e-4,
        "local backend: sys.setswitchinterval while the run lives (ranks woken by a peer get the GIL sooner); null: Python's 5 ms",
    )
    pin_cpus: bool = setting(
        False,
        "ray backend, CPU nodes: each rank's process runs only on the core of its CPU slot (slot mod cores), so ranks placed apart never share a core",
    )
    device: str = setting(
        "auto",
        "auto | cpu | cuda: where each rank computes (auto: CUDA where the rank sees a GPU); cuda without one is an error before start",
    )
    placement: dict[str, str] = setting(
        factory=dict,
        help="component(s) -> devices, e.g. {env: '0', 'rollout,actor': '1'}; empty: all on 0",
    )
    same_process: list[str] | None = setting(
        None,
        "ray: groups whose rank i shares one process, e.g. ['env,rollout'] (placed alike): items between them pass in memory, not as messages; [] for none; null: embodied runs share env and rollout when one placement entry names both and env.pipeline_stage_num is 1, llm runs share none; local: every rank shares one process already",
    )

    def resolved_placement(self, components: list[str]) -> dict[str, str]:
        return dict(self.placement) or {",".join(components): "0"}

    def same_process_entries(self) -> list[str]:
        """``same_process`` as set, null read as none (a half with a default resolves it)."""
        return list(self.same_process or [])


@dataclass
class RunnerConfig:
    """The run loop: run folder, cadence, stop rules, resume, loggers."""

    task: str = setting("embodied", "which half trains: embodied | llm")
    experiment: str = setting(
        "run", "the run folder is run_dir/experiment (suffixed -2, -3, ... when taken)"
    )
    run_dir: str = setting("runs", "where run folders are created")
    seed: int = setting(1, "the one seed of the run (weights, shuffling, envs, sampling)")
    max_steps: int = setting(
        100,
        "training steps (each: collect a batch, then update), numbered from 1 in the log, metrics.jsonl (0: before training) and checkpoints",
    )
    max_minutes: float | None = setting(None, "stop after this much wall time")
    target_metric: str = setting(
        "eval/return_mean", "the metric the target_value stop rule watches"
    )
    target_value: float | None = setting(None, "stop once target_metric reaches this value")
    eval_interval: int = setting(10, "evaluate every this many steps (and at the end); 0: never")
    save_interval: int = setting(
        10, "checkpoint every this many steps (and at the end, and on SIGINT/SIGTERM)"
    )
    keep_checkpoints: int = setting(
        3, "newest checkpoints kept in run_folder/checkpoints; 0: keep all"
    )
    resume_from: str | None = setting(
        None,
        "a checkpoint folder, a checkpoints/ folder, or 'auto' (the experiment's newest, else fresh)",
    )
    timeout_s: float = setting(
        DEFAULT_TIMEOUT_S, "bound on every wait for a phase; a hung rank is named after this"
    )
    max_restarts: int = setting(
        0,
        "when a worker dies or hangs, restart the groups and resume from the newest checkpoint, up to this many times",
    )
    progress: bool = setting(True, "live progress on the terminal")
    loggers: list[str] | None = setting(
        None,
        "metric sinks: jsonl, tensorboard, wandb, mlflow; null: jsonl, plus tensorboard where "
        "the 'trackers' extra is installed",
    )
    wandb: dict[str, Any] = setting(
        factory=dict,
        help="W&B settings (project, entity, mode, name); WANDB_MODE=offline needs no network",
    )
    mlflow: dict[str, Any] = setting(
        factory=dict,
        help="MLflow settings (experiment); MLFLOW_TRACKING_URI or a store in the run folder",
    )


@dataclass
class FSDPConfig:
    """FSDP2's options (actor.strategy=fsdp2 only; null: FSDP2's default)."""

    reshard_after_forward: bool | None = setting(
        None,
        "free each layer's gathered parameters after its forward and gather them again for "
        "backward (less memory, more communication); null: true",
    )
    cpu_offload: bool | None = setting(
        None,
        "keep the parameter, gradient and optimizer shards on the CPU between uses (a GPU "
        "holds only what it computes with); null: false",
    )


@dataclass
class ActorConfig:
    """The train engine: optimizer, schedule, clipping, precision, non-finite guard."""

    strategy: str = setting(
        "ddp",
        "how the actor ranks share the model: ddp (each holds all of it; gradients averaged) | "
        "fsdp2 (parameters, gradients and optimizer state sharded over the ranks, each decoder "
        "layer gathered for its compute; needs the ray backend for more than one rank)",
    )
    fsdp: FSDPConfig = section(FSDPConfig)

    lr: float = setting(2.5e-4, "learning rate")
    lr_schedule: str = setting("constant", "constant | linear | cosine, over runner.max_steps")
    warmup_steps: int = setting(0, "training steps of linear warm-up")
    optimizer: str = setting("adam", "adam | adamw")
    adam_eps: float = setting(1e-8, "the optimizer's epsilon")
    weight_decay: float = setting(0.0, "weight decay (decoupled with adamw)")
    max_grad_norm: float | None = setting(1.0, "clip the gradient norm to this; None: no clipping")
    bf16: bool = setting(
        False, "bfloat16 autocast for forward passes (the master weights stay float32)"
    )
    offload: bool = setting(
        False,
        "collocated layouts (actor and rollout on one device): the actor's parameters, "
        "gradients and optimizer state move to host memory while the rollout generates and "
        "back before training (synchronous runs; timers offload, onload)",
    )
    ref_offload: bool = setting(
        False,
        "the KL reference copy's weights live in host memory and come to the device only for "
        "its log-prob pass each step (needs algorithm.kl_coef > 0 and no LoRA)",
    )
    max_skipped_steps: int = setting(
        10, "abort after this many consecutive optimizer steps with a non-finite gradient"
    )


@dataclass
class AlgorithmConfig:
    """The advantage estimator and the PPO objective."""

    adv_type: str = setting(
        "gae", "advantage estimator from the registry (tidal.algorithms)", when=PPO_FAMILY
    )
    gamma: float = setting(0.99, "discount")
    clip_ratio_low: float | None = setting(
        None, "PPO clip below 1; null: 0.2, or 3e-4 with algorithm.importance_level=sequence (GSPO)"
    )
    clip_ratio_high: float | None = setting(
        None,
        "PPO clip above 1 (clip-higher when larger than clip_ratio_low); null: 0.2, or 4e-4 "
        "with algorithm.importance_level=sequence (GSPO)",
    )
    policy_loss: str = setting(
        "ppo",
        "ppo (the clipped surrogate) | cispo (every token's log-prob weighted by its clipped, "
        "stop-gradient importance ratio; MiniMax-M1)",
        when=PPO_FAMILY,
    )
    loss_agg: str = setting(
        "token-mean",
        "loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean | ...",
    )
    use_decoupled_loss: bool | None = setting(
        None,
        "the decoupled PPO objective (a trust region around the proximal policy, behaviour "
        "weights); null: on exactly when rollout.max_staleness > 0, as plain PPO on stale "
        "samples clips around the behaviour policy, versions behind the weights",
    )
    prox_logp_method: str = setting(
        "recompute",
        "proximal log-probs: recompute | loglinear | metrics (language: both, compared)",
    )
    behav_weight_cap: float | None = setting(5.0, "cap on the behaviour importance weight")
    cap_mode: str = setting("mask", "above the cap: mask the token or clamp the weight")
    kl_clamp: float | None = setting(
        10.0, "bound on each per-token KL estimate (to the reference), so no token dominates"
    )


# PPO's clip range, and GSPO's for a sequence-level ratio (its paper's 3e-4 / 4e-4)
CLIP_DEFAULTS = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}


def resolve_algorithm(cfg, importance_level: str = "token") -> None:
    """Defaults that follow other keys, decided once when a config is built (and recorded as
    decided: a saved config keeps the written null)."""
    algorithm = cfg.algorithm
    if algorithm.use_decoupled_loss is None:
        decide(cfg, "algorithm.use_decoupled_loss", cfg.rollout.max_staleness > 0)
    low, high = CLIP_DEFAULTS.get(importance_level, CLIP_DEFAULTS["token"])
    if algorithm.clip_ratio_low is None:
        decide(cfg, "algorithm.clip_ratio_low", low)
    if algorithm.clip_ratio_high is None:
        decide(cfg, "algorithm.clip_ratio_high", high)


@dataclass
class SFTSchedule:
    """The warm start's learning-rate schedule, the same keys in both halves' ``sft``."""

    lr_schedule: str = setting("constant", "constant | linear | cosine, over sft.steps")
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up")


def validate_sft_schedule(sft) -> None:
    one_of(sft.lr_schedule, LR_SCHEDULES, "sft.lr_schedule")
    require(
        0 <= sft.warmup_steps < sft.steps,
        "sft.warmup_steps",
        f"must be >= 0 and < sft.steps ({sft.steps}), got {sft.warmup_steps}",
    )


def one_of(value, allowed, key: str) -> None:
    require(value in allowed, key, f"expected one of {', '.join(map(str, allowed))}, got {value!r}")


def validate_ref_offload(actor: ActorConfig, algorithm: AlgorithmConfig, lora_rank: int) -> None:
    """``actor.ref_offload`` needs a reference copy of its own: a KL penalty, and no LoRA (whose
    reference is the trained model with its adapters off: the same weights)."""
    if not actor.ref_offload:
        return
    require(
        algorithm.kl_coef > 0,
        "actor.ref_offload",
        "there is no KL reference to offload: algorithm.kl_coef is 0",
    )
    require(
        lora_rank == 0,
        "actor.ref_offload",
        "under model.lora the reference is the trained model with its adapters disabled (no "
        "copy to offload); remove the key",
    )


def validate_common(
    cluster: ClusterConfig, runner: RunnerConfig, actor: ActorConfig, algorithm: AlgorithmConfig
) -> None:
    """The rules of the shared sections, the same in both halves (the names they take from a
    registry, e.g. ``cluster.backend`` and ``algorithm.adv_type``, are checked by
    tidal.runners.preflight)."""
    one_of(algorithm.cap_mode, ("mask", "clamp"), "algorithm.cap_mode")
    one_of(cluster.device, ("auto", "cpu", "cuda"), "cluster.device")
    require(
        algorithm.kl_clamp is None or algorithm.kl_clamp > 0,
        "algorithm.kl_clamp",
        f"must be > 0 (or null: no bound), got {algorithm.kl_clamp}",
    )
    require(
        algorithm.behav_weight_cap is None or algorithm.behav_weight_cap > 0,
        "algorithm.behav_weight_cap",
        f"must be > 0, got {algorithm.behav_weight_cap}",
    )
    require(
        cluster.torch_threads >= 1,
        "cluster.torch_threads",
        f"must be >= 1, got {cluster.torch_threads}",
    )
    require(
        cluster.connect_timeout_s > 0,
        "cluster.connect_timeout_s",
        f"must be > 0, got {cluster.connect_timeout_s}",
    )
    for entry in cluster.same_process_entries():
        require(
            "actor" not in [n.strip() for n in str(entry).split(",")],
            "cluster.same_process",
            f"{entry!r}: the actor joins torch.distributed, which is one per process; "
            "share processes between the other groups (e.g. 'env,rollout')",
        )
    require(runner.max_steps >= 1, "runner.max_steps", f"must be >= 1, got {runner.max_steps}")
    require(runner.timeout_s > 0, "runner.timeout_s", f"must be > 0, got {runner.timeout_s}")
    for key in ("eval_interval", "save_interval", "keep_checkpoints", "max_restarts"):
        value = getattr(runner, key)
        require(value >= 0, f"runner.{key}", f"must be >= 0, got {value}")
    require(
        runner.max_minutes is None or runner.max_minutes > 0,
        "runner.max_minutes",
        f"must be > 0, got {runner.max_minutes}",
    )
    for name in runner.loggers or []:
        one_of(name, LOGGERS, "runner.loggers")
    require(
        runner.experiment and "/" not in runner.experiment,
        "runner.experiment",
        f"must be a folder name, got {runner.experiment!r}",
    )
    require(actor.lr > 0, "actor.lr", f"must be > 0, got {actor.lr}")
    for key, value in vars(actor.fsdp).items():
        require(
            value is None or actor.strategy == "fsdp2",
            f"actor.fsdp.{key}",
            f"is an FSDP2 option; set actor.strategy=fsdp2 (got {actor.strategy!r}) or remove it",
        )
    one_of(actor.lr_schedule, LR_SCHEDULES, "actor.lr_schedule")
    one_of(actor.optimizer, OPTIMIZERS, "actor.optimizer")
    require(
        actor.warmup_steps >= 0, "actor.warmup_steps", f"must be >= 0, got {actor.warmup_steps}"
    )
    require(
        actor.weight_decay >= 0, "actor.weight_decay", f"must be >= 0, got {actor.weight_decay}"
    )
    require(actor.adam_eps > 0, "actor.adam_eps", f"must be > 0, got {actor.adam_eps}")
    require(
        actor.max_grad_norm is None or actor.max_grad_norm > 0,
        "actor.max_grad_norm",
        f"must be > 0 (or null for no clipping), got {actor.max_grad_norm}",
    )
    require(
        actor.max_skipped_steps >= 1,
        "actor.max_skipped_steps",
        f"must be >= 1, got {actor.max_skipped_steps}",
    )
    require(
        0 <= algorithm.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {algorithm.gamma}"
    )
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(algorithm, key)
        require(value > 0, f"algorithm.{key}", f"must be > 0, got {value}")
