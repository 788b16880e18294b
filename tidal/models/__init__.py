"""Policies behind one interface (``EmbodiedPolicy``), built by name from config: ``mlp``,
``cnn`` (pixels), ``vla`` (token actions), ``flow`` (a flow-matching action expert), ``sac_mlp`` (SAC's squashed Gaussian), ``sac_cnn`` (SAC from pixels, DrQ); saved and loaded as folders."""

from tidal.models.cnn import CNNActorCritic
from tidal.models.flow import FlowMatchingPolicy
from tidal.models.policy import (
    EmbodiedPolicy,
    LeadingNorm,
    MLPActorCritic,
    PolicyStep,
    RunningNorm,
    build_policy,
    register_policy,
)
from tidal.models.sac import QEnsemble, SquashedGaussianPolicy
from tidal.models.sac_cnn import PixelSquashedGaussianPolicy
from tidal.models.saving import load_policy, save_policy
from tidal.models.vla import TokenActionPolicy

__all__ = [
    "CNNActorCritic",
    "EmbodiedPolicy",
    "FlowMatchingPolicy",
    "LeadingNorm",
    "MLPActorCritic",
    "PixelSquashedGaussianPolicy",
    "PolicyStep",
    "QEnsemble",
    "RunningNorm",
    "SquashedGaussianPolicy",
    "TokenActionPolicy",
    "build_policy",
    "load_policy",
    "register_policy",
    "save_policy",
]
