"""``tidal eval`` for embodied configs: a saved policy (``model.path``) or a training checkpoint on
``episodes`` fresh episodes, as the run evaluates (greedy unless ``rollout.eval_deterministic``
is off) and optionally with sampled actions on the same episodes; success rates overall and per
task, and the mean return. The episodes run in rounds on ``env.eval_num_envs`` env copies at
most (the largest divisor of ``episodes`` up to it), never ``episodes`` envs at once: episode
``e`` runs on copy ``e % copies``, and copy ``i`` runs task ``i % len(tasks)`` on a multi-task
env, so a multiple of the task count in both weighs tasks equally (and a LIBERO copy moves on to
its task's next official init state each round).

The episodes' seeds (tidal.envs.seeds) are far from the training envs' seeds and from those of the
training run's evaluations, so a comparison of two policies (e.g. after
``tidal sft`` and after ``tidal train``) runs on the same episodes that neither has seen. Writes
``summary.json`` into a new run folder ``run_dir/<experiment>-eval``."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

import torch

from tidal.checkpoint import checkpoint_weights
from tidal.config.embodied import EmbodiedConfig
from tidal.envs import MultiTaskAdapter, env_make_kwargs, make_env
from tidal.envs.seeds import held_out_seeds
from tidal.models.factory import build_from_config
from tidal.models.imitation import evaluate_success
from tidal.runners.preflight import check_embodied_eval
from tidal.runners.run_folder import RunFolder

log = logging.getLogger("tidal.eval")


def run_eval(
    cfg: EmbodiedConfig,
    checkpoint: str | None = None,
    episodes: int | None = None,
    sampled: bool = False,
) -> dict:
    episodes = cfg.env.eval_num_envs if episodes is None else episodes
    folder = check_embodied_eval(cfg, checkpoint, episodes)
    with RunFolder(cfg, "eval") as run:
        summary = _evaluate(cfg, folder, episodes, sampled)
        (run.path / "summary.json").write_text(json.dumps(summary, indent=2))
    scores = {k: summary[k] for k in ("eval/success_rate", "eval/return_mean") if k in summary}
    log.info(
        "eval on %d episodes: %s", episodes, ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
    )
    return {**summary, "run_dir": str(run.path)}


def copies_per_round(episodes: int, most: int) -> int:
    """The env copies that run ``episodes`` in equal rounds: the largest divisor of ``episodes``
    up to ``most`` (``env.eval_num_envs``, the copies a training run's evaluation holds)."""
    return max(d for d in range(1, min(episodes, max(most, 1)) + 1) if episodes % d == 0)


def unequal_task_weights(task_names: list[str], num_tasks: int) -> str | None:
    """What to warn when ``eval/success_rate`` (a mean over episodes) weighs the env's tasks
    unequally: each round gives every task the copies that run it (``task_names``, one per
    copy), and copies that are no multiple of the task count give some tasks more episodes, or
    none. The per-task rates are exact either way."""
    counts = [Counter(task_names)[t] for t in dict.fromkeys(task_names)]
    if num_tasks < 2 or (len(counts) == num_tasks and len(set(counts)) == 1):
        return None
    return (
        f"{len(task_names)} env copies per round run {len(counts)} of the {num_tasks} tasks, "
        f"{min(counts)} to {max(counts)} copies each: eval/success_rate weighs tasks unequally "
        f"(the per-task rates are exact); ask for a multiple of {num_tasks} episodes with "
        f"env.eval_num_envs a multiple of {num_tasks}"
    )


def _evaluate(cfg: EmbodiedConfig, folder: Path | None, episodes: int, sampled: bool) -> dict:
    torch.set_num_threads(cfg.cluster.torch_threads)
    copies = copies_per_round(episodes, cfg.env.eval_num_envs)
    log.info("%d episodes: %d rounds of %d env copies", episodes, episodes // copies, copies)
    env = make_env(cfg.env.adapter, copies, **env_make_kwargs(cfg.env))
    if isinstance(env, MultiTaskAdapter):
        if warning := unequal_task_weights(env.task_names, len(env.task_list)):
            log.warning(warning)
    try:
        policy = build_from_config(
            cfg.model, env.observation_space, env.action_space, cfg.env.num_action_chunks
        )
        if folder is not None:
            owner = f"policy {cfg.model.name!r}"
            policy.load_state_dict(checkpoint_weights(policy, folder, cfg.model.lora, owner))
        seeds = held_out_seeds(cfg.runner.seed, episodes)
        start = time.perf_counter()
        summary = {
            "model_path": cfg.model.path,
            "checkpoint": None if folder is None else str(folder),
            "episodes": episodes,
            "env_copies": copies,
            **evaluate_success(policy, env, seeds, deterministic=cfg.rollout.eval_deterministic),
        }
        if sampled:
            torch.manual_seed(cfg.runner.seed)
            summary.update(
                evaluate_success(policy, env, seeds, deterministic=False, prefix="eval_sampled")
            )
        summary["wall_time"] = time.perf_counter() - start
    finally:
        env.close()
    return summary
