"""Policies behind one interface (``EmbodiedPolicy``), built by name from config."""

from tidal.models.policy import (
    EmbodiedPolicy,
    MLPActorCritic,
    PolicyStep,
    RunningNorm,
    build_policy,
    register_policy,
)

__all__ = ["EmbodiedPolicy", "MLPActorCritic", "PolicyStep", "RunningNorm", "build_policy", "register_policy"]
