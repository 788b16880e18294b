"""The policy a ``model`` config section describes (the embodied half's ``model``; any object with
its fields): loaded from a saved folder, or built by name from the registry."""

from __future__ import annotations

import dataclasses

import gymnasium as gym

from tidal.models.policy import EmbodiedPolicy, build_policy, policy_arguments
from tidal.models.saving import load_policy


def build_from_config(
    model,
    observation_space: gym.Space,
    action_space: gym.Space,
    num_action_chunks: int,
    weights: bool = True,
) -> EmbodiedPolicy:
    """Loaded from ``model.path`` when set (``weights=False``: without reading its weights; the
    shared fields the policy names in ``run_settings`` from this config), else built by name
    with the shared fields it takes and ``model.kwargs``."""
    shared = {
        "hidden_sizes": tuple(model.hidden_sizes),
        "activation": model.activation,
        "critic": model.critic,
        "obs_norm": model.obs_norm,
        "init_log_std": model.init_log_std,
        "squash": model.squash,
        "flow": dataclasses.asdict(model.flow),
    }
    if model.path is not None:
        policy = load_policy(model.path, weights, run_settings=shared)
        spec = policy.build_spec
        if (spec["observation_space"], spec["action_space"]) != (observation_space, action_space):
            raise ValueError(
                f"model.path: {model.path!r} was saved for observations {spec['observation_space']} "
                f"and actions {spec['action_space']}; this env has {observation_space} and "
                f"{action_space} (env.obs_mode, env.image_size, env.adapter_kwargs)"
            )
        return policy
    takes = policy_arguments(model.name)
    kwargs = {k: v for k, v in shared.items() if k in takes}
    return build_policy(
        model.name,
        observation_space,
        action_space,
        num_action_chunks,
        **kwargs,
        **dict(model.kwargs),
    )
