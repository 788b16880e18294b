"""The names users bring from other frameworks, and what tidal calls them.

A key tidal does not know whose last part is one of these names gets an error that names
tidal's key (docs/config.md shows the table). Nothing is renamed silently: a name that means
something close but not the same in tidal (a coefficient on another scale, a count of
minibatches rather than their size) is better read once than trained with.
"""

from __future__ import annotations

# name -> (framework, tidal's key or keys, how it differs); keys are checked against the half
ALIASES: dict[str, tuple[str, str, str]] = {
    # TRL (GRPOConfig, PPOConfig)
    "num_generations": ("TRL", "rollout.group_size", ""),
    "beta": ("TRL", "algorithm.kl_coef", ""),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "epsilon": ("TRL", "algorithm.clip_ratio_low", "and clip_ratio_high"),
    "epsilon_high": ("TRL", "algorithm.clip_ratio_high", ""),
    "per_device_train_batch_size": ("TRL", "rollout.batch_size", "prompts per step"),
    "learning_rate": ("TRL/CleanRL", "actor.lr", ""),
    "num_train_epochs": ("TRL", "runner.max_steps", "tidal counts training steps"),
    # CleanRL (ppo.py, sac_continuous_action.py)
    "ent_coef": ("CleanRL", "algorithm.entropy_bonus", ""),
    "total_timesteps": ("CleanRL", "runner.max_env_steps", ""),
    "num_envs": ("CleanRL", "env.total_num_envs", ""),
    "anneal_lr": ("CleanRL", "actor.lr_schedule", "anneal_lr=True is actor.lr_schedule=linear"),
    "clip_vloss": (
        "CleanRL",
        "algorithm.value_clip",
        "a distance (CleanRL's clip_coef, e.g. 0.2), null for none",
    ),
    "clip_coef": ("CleanRL", "algorithm.clip_ratio_low", "and clip_ratio_high"),
    "norm_adv": ("CleanRL", "algorithm.normalize_advantages", ""),
    "num_minibatches": (
        "CleanRL",
        "actor.global_batch_size",
        "a minibatch's size: (total_num_envs x num_steps) / num_minibatches",
    ),
    "buffer_size": ("CleanRL", "replay.capacity", ""),
    "learning_starts": ("CleanRL", "replay.warmup_steps", ""),
    "policy_frequency": ("CleanRL", "algorithm.policy_delay", ""),
    "q_lr": ("CleanRL", "algorithm.critic_lr", ""),
    "autotune": ("CleanRL", "algorithm.alpha", "null tunes it; a number fixes it"),
    # verl (ppo_trainer.yaml)
    "adv_estimator": ("verl", "algorithm.adv_type", ""),
    "entropy_coeff": ("verl", "algorithm.entropy_bonus", ""),
    "kl_loss_coef": ("verl", "algorithm.kl_coef", "with algorithm.kl_in=loss"),
    "use_kl_loss": ("verl", "algorithm.kl_in", "use_kl_loss=True is algorithm.kl_in=loss"),
    "kl_loss_type": ("verl", "algorithm.kl_kind", ""),
    "clip_ratio": ("verl", "algorithm.clip_ratio_low", "and clip_ratio_high"),
    "ppo_mini_batch_size": (
        "verl",
        "actor.ppo_minibatches",
        "a count: rollout.batch_size / ppo_mini_batch_size",
    ),
    "ppo_epochs": ("verl", "algorithm.update_epochs", ""),
    "train_batch_size": ("verl", "rollout.batch_size", ""),
    "response_length": ("verl", "rollout.max_new_tokens", ""),
    "max_response_length": ("verl", "rollout.max_new_tokens", ""),
    "total_training_steps": ("verl", "runner.max_steps", ""),
    "total_epochs": ("verl", "runner.max_steps", "tidal counts training steps"),
    "n": ("verl", "rollout.group_size", "rollout.n is samples per prompt"),
    "ppo_micro_batch_size_per_gpu": ("verl", "actor.max_tokens_per_mb", "tokens, not sequences"),
    # RLinf
    "component_placement": ("RLinf", "cluster.placement", ""),
    "group_name": ("RLinf", "cluster.placement", "groups are named by their component"),
}


def alias_hint(key: str, known: dict[str, str]) -> str | None:
    """What tidal calls ``key``'s last part if another framework's user would type it
    (``known``: the half's keys), else None."""
    name = key.rpartition(".")[2]
    if name not in ALIASES:
        return None
    framework, target, note = ALIASES[name]
    where = "" if target in known else " (in the other half; this one has no such setting)"
    return f"{framework}'s {name} is tidal's {target}{where}" + (f" ({note})" if note else "")


def alias_table() -> str:
    """The table of docs/config.md: another framework's name, and tidal's."""
    rows = ["| framework | their name | tidal's key | note |", "| --- | --- | --- | --- |"]
    for name, (framework, target, note) in ALIASES.items():
        rows.append(f"| {framework} | `{name}` | `{target}` | {note} |")
    return "\n".join(rows)
