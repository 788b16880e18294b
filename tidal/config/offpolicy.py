"""The off-policy keys of the embodied config (``algorithm.name: sac``): the SAC fields of the
``algorithm`` section, the ``replay`` section and their rules between keys."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.loader import require
from tidal.config.schema import setting

ALGORITHM_NAMES = ("ppo", "sac")
ON_POLICY = ("ppo",)  # the algorithms that train on batches of actor.global_batch_size
SAC_POLICIES = ("sac_mlp", "sac_cnn")  # the policies algorithm.name sac trains
# the keys each algorithm family reads (``setting(when=...)``: given to another, refused)
SAC_ONLY = {"algorithm.name": ("sac",)}
PPO_FAMILY = {"algorithm.name": ON_POLICY}


@dataclass
class SACAlgorithmFields:
    """The ``algorithm`` keys only SAC reads (``algorithm.name: sac``)."""

    name: str = setting(
        "ppo", "ppo (on-policy, algorithm.adv_type picks the estimator) | sac (off-policy, replay)"
    )
    tau: float = setting(0.005, "sac: Polyak rate of the target critics", when=SAC_ONLY)
    num_critics: int = setting(
        2, "sac: Q critics in the ensemble (2: clipped double Q)", when=SAC_ONLY
    )
    critic_subset: int | None = setting(
        None,
        "sac: the target takes the min over this many random critics and the actor the mean of "
        "all (RLPD); None: both the min of all",
        when=SAC_ONLY,
    )
    alpha: float | None = setting(
        None, "sac: a fixed entropy temperature; None: tuned", when=SAC_ONLY
    )
    init_alpha: float = setting(1.0, "sac: the tuned temperature's start", when=SAC_ONLY)
    target_entropy: float | None = setting(
        None,
        "sac: the tuned temperature's entropy target; None: -(action dims x chunk)",
        when=SAC_ONLY,
    )
    utd_ratio: float = setting(
        1.0, "sac: critic updates per env step (update-to-data ratio)", when=SAC_ONLY
    )
    policy_delay: int = setting(
        1, "sac: update the actor and alpha every this many critic updates", when=SAC_ONLY
    )
    critic_lr: float | None = setting(
        None, "sac: the critics' learning rate; None: actor.lr", when=SAC_ONLY
    )
    alpha_lr: float | None = setting(
        None, "sac: the temperature's learning rate; None: actor.lr", when=SAC_ONLY
    )
    batch_updates: int = setting(
        32,
        "sac: updates per actor call (the runner polls collection between calls)",
        when=SAC_ONLY,
    )
    image_pad: int = setting(
        0,
        "sac with model.name sac_cnn: DrQ's random shift of every sampled obs and next_obs "
        "image by up to this many pixels (replicated border); 0: off",
        when=SAC_ONLY,
    )


@dataclass
class ReplayConfig:
    """The replay buffer of off-policy algorithms (``algorithm.name: sac``), on the actor rank."""

    capacity: int = setting(1_000_000, "transitions kept (oldest overwritten)")
    batch_size: int = setting(
        256, "transitions per update (online plus demonstrations), over all actor ranks"
    )
    warmup_steps: int = setting(
        5000, "env steps of uniformly random actions before the first update"
    )
    max_lead: int = setting(
        4096, "collection waits while it leads the updates by more than this many env steps"
    )
    demo_path: str | None = setting(
        None, "RLPD: a .pt or .npz of demonstration transitions, sampled beside online data"
    )
    sft_demos: bool = setting(
        False,
        "RLPD: the demonstrations are sft.demos scripted expert episodes per task, collected "
        "at start as tidal sft collects them (env.adapter metaworld or libero)",
    )
    demo_fraction: float = setting(0.5, "RLPD: the share of each batch drawn from the demos")
    save: bool = setting(
        False, "checkpoints hold the buffer (a resume continues with it); false: it refills"
    )


def validate_offpolicy(cfg) -> None:
    """The rules of ``algorithm.name: sac`` (an ``EmbodiedConfig``)."""
    alg, replay = cfg.algorithm, cfg.replay
    require(
        alg.name in ALGORITHM_NAMES,
        "algorithm.name",
        f"expected one of {', '.join(ALGORITHM_NAMES)}, got {alg.name!r}",
    )
    require(
        cfg.model.name not in SAC_POLICIES or alg.name == "sac",
        "model.name",
        f"{cfg.model.name} is trained by algorithm.name=sac only (it has no value head for "
        f"PPO), got algorithm.name={alg.name!r}",
    )
    if alg.name != "sac":  # the PPO family's keys are refused with SAC by their schema
        return
    # SAC's actor keeps its own optimizers on one rank, outside the train engine
    for key, value, default in (
        ("actor.strategy", cfg.actor.strategy, "ddp"),
        ("actor.offload", cfg.actor.offload, False),
        ("model.lora.rank", cfg.model.lora.rank, 0),
    ):
        require(
            value == default, key, f"is not supported with algorithm.name=sac yet (got {value!r})"
        )
    require(alg.utd_ratio > 0, "algorithm.utd_ratio", f"must be > 0, got {alg.utd_ratio}")
    require(0 < alg.tau <= 1, "algorithm.tau", f"must be in (0, 1], got {alg.tau}")
    require(alg.num_critics >= 1, "algorithm.num_critics", f"must be >= 1, got {alg.num_critics}")
    require(
        alg.critic_subset is None or 1 <= alg.critic_subset <= alg.num_critics,
        "algorithm.critic_subset",
        f"must be in [1, num_critics={alg.num_critics}], got {alg.critic_subset}",
    )
    require(
        alg.alpha is None or alg.alpha >= 0, "algorithm.alpha", f"must be >= 0, got {alg.alpha}"
    )
    require(alg.init_alpha > 0, "algorithm.init_alpha", f"must be > 0, got {alg.init_alpha}")
    require(alg.image_pad >= 0, "algorithm.image_pad", f"must be >= 0, got {alg.image_pad}")
    require(
        alg.image_pad == 0 or cfg.model.name == "sac_cnn",
        "algorithm.image_pad",
        f"shifts pixel observations for model.name sac_cnn, got {cfg.model.name!r} (set it to 0)",
    )
    for key in ("policy_delay", "batch_updates"):
        value = getattr(alg, key)
        require(value >= 1, f"algorithm.{key}", f"must be >= 1, got {value}")
    for key in ("critic_lr", "alpha_lr"):
        value = getattr(alg, key)
        require(value is None or value > 0, f"algorithm.{key}", f"must be > 0, got {value}")
    require(replay.batch_size >= 1, "replay.batch_size", f"must be >= 1, got {replay.batch_size}")
    require(
        replay.capacity >= replay.batch_size,
        "replay.capacity",
        f"{replay.capacity} is below replay.batch_size {replay.batch_size}",
    )
    require(
        replay.warmup_steps >= 0, "replay.warmup_steps", f"must be >= 0, got {replay.warmup_steps}"
    )
    segment = cfg.env.total_num_envs * cfg.rollout.num_steps * cfg.env.num_action_chunks
    require(
        replay.max_lead >= segment,
        "replay.max_lead",
        f"{replay.max_lead} is below one collection segment (env.total_num_envs x rollout."
        f"num_steps x env.num_action_chunks = {segment} env steps)",
    )
    require(
        not (replay.sft_demos and replay.demo_path is not None),
        "replay.sft_demos",
        "the demonstrations come from replay.demo_path or from the scripted experts, not both",
    )
    require(
        0 <= replay.demo_fraction < 1,
        "replay.demo_fraction",
        f"must be in [0, 1), got {replay.demo_fraction}",
    )
    require(
        cfg.rollout.max_staleness == 0,
        "rollout.max_staleness",
        "sac is off-policy: its lead is bounded by replay.max_lead; leave this at 0",
    )
    require(cfg.env.auto_reset, "env.auto_reset", "sac collects continuously: set it to true")
    require(not cfg.reward.enabled, "reward.enabled", "sac does not run a reward group yet")
