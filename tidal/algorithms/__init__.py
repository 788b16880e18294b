"""Pure tensor functions every trainer calls: advantages, losses, KL, proximal log-probs.

No I/O, no workers, no config objects. Layout conventions are in each docstring.
"""

from tidal.algorithms.advantages import (
    EstimatorSpec,
    advantage_spec,
    compute_gae,
    episode_scores,
    get_advantage,
    group_normalize,
    list_advantages,
    loss_mask_from_dones,
    masked_whiten,
    reduce_chunk_level,
    register_advantage,
)
from tidal.algorithms.kl import kl_estimate
from tidal.algorithms.losses import (
    aggregate_loss,
    decoupled_ppo_loss,
    ppo_policy_loss,
    reshape_logprobs,
    value_loss,
)
from tidal.algorithms.prox import loglinear_prox_logp, within_staleness

__all__ = [
    "EstimatorSpec",
    "advantage_spec",
    "aggregate_loss",
    "compute_gae",
    "decoupled_ppo_loss",
    "episode_scores",
    "get_advantage",
    "group_normalize",
    "kl_estimate",
    "list_advantages",
    "loglinear_prox_logp",
    "loss_mask_from_dones",
    "masked_whiten",
    "ppo_policy_loss",
    "reduce_chunk_level",
    "register_advantage",
    "reshape_logprobs",
    "value_loss",
    "within_staleness",
]
