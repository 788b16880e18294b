"""Behaviour cloning: the loss, a small training loop over demonstrations, and success
evaluation in an env (what ``tidal sft`` reports before RL starts from the saved folder)."""

from __future__ import annotations

import numpy as np
import torch

from tidal.envs import ChunkedEnv, VectorEnvAdapter, episode_metrics
from tidal.envs.demos import Demonstrations
from tidal.models.policy import EmbodiedPolicy


def bc_loss(
    policy: EmbodiedPolicy, batch: dict[str, torch.Tensor], action_error: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's imitation loss on the expert's actions (``EmbodiedPolicy.imitation_loss``:
    the negative log-likelihood, for token policies the cross-entropy of every action token;
    flow matching's regression for ``flow``). ``batch``: ``obs`` ``[N, D]`` raw
    observations, ``actions`` ``[N, C, A]`` expert actions as the env takes them.
    ``action_error`` adds the mean distance of the policy's mode action (one more forward)."""
    for key in ("obs", "actions"):
        if key not in batch:
            raise ValueError(f"bc_loss: the batch has no {key!r} (it has {', '.join(batch)})")
    inputs = policy.prepare(batch["obs"])
    loss, metrics = policy.imitation_loss(inputs, policy.policy_actions(batch["actions"]))
    if action_error:
        with torch.no_grad():
            mode = policy.act(inputs, deterministic=True).actions
        metrics["bc/action_error"] = float(
            np.abs(policy.env_actions(mode) - batch["actions"].numpy()).mean()
        )
    return loss, metrics


def train_bc(
    policy: EmbodiedPolicy,
    demos: Demonstrations,
    engine,
    steps: int,
    batch_size: int = 256,
    seed: int = 0,
    num_action_chunks: int = 1,
    log_every: int = 50,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps on random minibatches through ``engine`` (a
    ``tidal.engine.TrainEngine`` over ``policy``: the one optimizer-step implementation); the
    observation normaliser (if any) is fitted to the demonstrations first. Returns the logged
    metrics."""
    if engine.model is not policy:
        raise ValueError("train_bc: the engine must train this policy")
    obs = torch.from_numpy(demos.obs)
    actions = torch.from_numpy(demos.action_chunks(num_action_chunks))
    if policy.obs_norm is not None:
        policy.obs_norm.update(obs)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(1, steps + 1):
        rows = torch.randint(len(obs), (min(batch_size, len(obs)),), generator=generator)
        logging = step == 1 or step % log_every == 0 or step == steps

        def loss_fn(module, batch, logging=logging):
            return bc_loss(module, batch, action_error=logging)

        batch = {"obs": policy.augment(obs[rows], generator), "actions": actions[rows]}
        metrics = engine.train_batch([batch], loss_fn)
        engine.end_step()
        if logging:
            history.append(
                {"step": step, **{k if "/" in k else f"bc/{k}": v[-1] for k, v in metrics.items()}}
            )
    policy.eval()
    return history


@torch.no_grad()
def evaluate_success(
    policy: EmbodiedPolicy,
    env: VectorEnvAdapter,
    seeds: list[int],
    deterministic: bool = True,
    prefix: str = "eval",
) -> dict[str, float]:
    """One episode per seed, in this process, in rounds of one episode per env copy: round ``r``
    gives copy ``i`` the seed ``seeds[r * copies + i]`` (so ``len(seeds)`` is a multiple of the
    copies, and 500 episodes need not hold 500 envs in memory). The metrics a training run's
    evaluation through its workers reports, under the same names (``tidal.envs.episode_metrics``:
    return mean and spread, episodes, success rates)."""
    copies = env.num_envs
    if len(seeds) % copies:
        raise ValueError(f"evaluate_success: {len(seeds)} seeds for rounds of {copies} env copies")
    stats: dict[str, list] = {"returns": [], "successes": [], "tasks": []}
    was_training = policy.training
    policy.eval()
    try:
        for first in range(0, len(seeds), copies):
            chunked = ChunkedEnv(env, auto_reset=False, seeds=seeds[first : first + copies])
            obs = chunked.reset().obs
            while not chunked.all_reported():
                step = policy.act(policy.prepare(obs), deterministic=deterministic)
                obs = chunked.step(policy.env_actions(step.actions)).obs
            round_stats = chunked.stats.drain()
            for key, values in stats.items():
                values.extend(round_stats[key])
    finally:
        policy.train(was_training)
    return episode_metrics(stats["returns"], stats["successes"], stats["tasks"], prefix)
