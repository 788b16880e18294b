"""The embodied sizes that must divide over the ranks of each worker group: envs over env,
rollout and reward ranks and pipeline stages, the PPO family's batches over actor ranks, GRPO's
groups within one actor rank. Pure rules on a config and the ranks per group
(``cluster.placement``); the preflight calls them once the placement is known."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.config.loader import require
from tidal.config.offpolicy import ON_POLICY

if TYPE_CHECKING:
    from tidal.config.embodied import EmbodiedActorConfig, EmbodiedConfig


def validate_layout(cfg: EmbodiedConfig, worlds: dict[str, int]) -> None:
    """The sizes that must divide over the ranks of each group (``worlds``: ranks per component,
    from ``cluster.placement``)."""
    env, act = cfg.env, cfg.actor
    stages = env.pipeline_stage_num
    require(
        env.total_num_envs % (worlds["env"] * stages) == 0,
        "env.total_num_envs",
        f"{env.total_num_envs} must divide evenly over {worlds['env']} env ranks x {stages} pipeline stages",
    )
    per_stage = env.total_num_envs // stages
    require(
        per_stage % worlds["rollout"] == 0,
        "env.total_num_envs",
        f"each pipeline stage's {per_stage} envs must divide evenly over {worlds['rollout']} rollout ranks",
    )
    require(
        env.total_num_envs % worlds["actor"] == 0,
        "env.total_num_envs",
        f"{env.total_num_envs} must divide evenly over {worlds['actor']} actor ranks",
    )
    require(
        env.eval_num_envs % worlds["env"] == 0 and env.eval_num_envs % worlds["rollout"] == 0,
        "env.eval_num_envs",
        f"{env.eval_num_envs} must divide evenly over {worlds['env']} env and {worlds['rollout']} rollout ranks",
    )
    if cfg.reward.enabled:
        require(
            per_stage % worlds["reward"] == 0,
            "env.total_num_envs",
            f"each pipeline stage's {per_stage} envs must divide evenly over {worlds['reward']} reward ranks",
        )
    if cfg.algorithm.name not in ON_POLICY:  # the PPO batch sizes below
        return
    samples = env.total_num_envs * cfg.rollout.num_steps
    require(
        samples % act.global_batch_size == 0,
        "actor.global_batch_size",
        f"the {samples} samples of a step (total_num_envs x num_steps) must divide into batches of {act.global_batch_size}",
    )
    ranks, batch = worlds["actor"], act.global_batch_size
    if batch % ranks:  # the batches that split over the ranks and divide the step's samples
        fits = [b for b in range(ranks, samples + 1, ranks) if samples % b == 0]
        nearest = min(fits, key=lambda b: abs(b - batch))
        require(
            False,
            "actor.global_batch_size",
            f"{batch} does not split over {ranks} actor ranks: e.g. actor.global_batch_size={nearest}",
        )
    share, micro = batch // ranks, rank_micro_batch(act, ranks)
    if share % micro:
        divisor = max(d for d in range(1, micro + 1) if share % d == 0)
        require(
            False,
            "actor.micro_batch_size",
            f"{micro} does not divide a rank's share of actor.global_batch_size ({share} = "
            f"{batch} / {ranks} actor ranks): e.g. actor.micro_batch_size={divisor}",
        )


def rank_micro_batch(act: EmbodiedActorConfig, actor_ranks: int) -> int:
    """The micro-batch an actor rank computes: ``actor.micro_batch_size``, or the rank's share
    of ``actor.global_batch_size`` where that is smaller (more ranks need no new batch sizes)."""
    return min(act.micro_batch_size, act.global_batch_size // actor_ranks)


def validate_groups(cfg: EmbodiedConfig, actor_ranks: int) -> None:
    """An estimator that scores groups of episodes (``spec.needs_groups``): whole episodes in
    groups of 2 or more that stay on one actor rank."""
    env, adv_type = cfg.env, cfg.algorithm.adv_type
    require(
        env.group_size > 1, "env.group_size", f"adv_type {adv_type} needs groups of 2 or more envs"
    )
    require(
        not env.auto_reset,
        "env.auto_reset",
        f"adv_type {adv_type} scores whole episodes: set it to false",
    )
    per_actor = env.total_num_envs // actor_ranks
    require(
        per_actor % env.group_size == 0,
        "env.group_size",
        f"groups of {env.group_size} must not straddle actor ranks ({per_actor} envs each)",
    )
