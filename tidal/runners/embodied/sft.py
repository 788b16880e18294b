"""``tidal sft`` for embodied configs: demonstrations from MetaWorld's scripted experts, behaviour
cloning through the train engine, success in the configured env, and the policy saved as the
folder ``model.path`` names, which ``tidal train`` with the same config then starts from.

Its evaluation uses the envs and seeds of the training run's first evaluation (tidal.envs.seeds,
one env rank), so the two report the same episodes."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from tidal.config import EmbodiedConfig
from tidal.engine import TrainEngine
from tidal.envs import env_make_kwargs, make_env
from tidal.envs.demos import DEMO_SOURCES
from tidal.envs.seeds import evaluation_seeds
from tidal.metrics import MetricLogger
from tidal.models import save_policy
from tidal.models.factory import build_from_config
from tidal.models.imitation import evaluate_success, train_bc
from tidal.runners.preflight import check_embodied_sft
from tidal.runners.run_folder import RunFolder

log = logging.getLogger("tidal.sft")


def run_sft(cfg: EmbodiedConfig) -> dict:
    check_embodied_sft(cfg)
    torch.manual_seed(cfg.runner.seed)
    torch.set_num_threads(cfg.cluster.torch_threads)
    with RunFolder(cfg, "sft") as run:
        return _train(cfg, run.path)


def _train(cfg: EmbodiedConfig, run_dir: Path) -> dict:
    start = time.perf_counter()
    demos = collect_demos(cfg)
    log.info(
        "sft: %d demonstrations (%d steps) in %.1f s",
        demos.num_episodes,
        len(demos.obs),
        time.perf_counter() - start,
    )
    env = make_env(cfg.env.adapter, cfg.env.eval_num_envs, **env_make_kwargs(cfg.env))
    logger = MetricLogger(run_dir, cfg.runner.loggers, config=dataclasses.asdict(cfg))
    try:
        policy = build_from_config(
            dataclasses.replace(cfg.model, path=None),
            env.observation_space,
            env.action_space,
            cfg.env.num_action_chunks,
        )
        history = behaviour_clone(cfg, policy, demos)
        for row in history:
            logger.log(row["step"], row)
        seeds = evaluation_seeds(cfg.runner.seed, cfg.env.eval_num_envs)
        evaluation = evaluate_success(
            policy, env, seeds, deterministic=cfg.rollout.eval_deterministic
        )
        logger.log(cfg.sft.steps, evaluation)
    finally:
        env.close()
        logger.close()
    save_policy(policy, cfg.model.path)
    summary = {
        "model_path": cfg.model.path,
        "run_dir": str(run_dir),
        "demos": demos.num_episodes,
        "demo_steps": len(demos.obs),
        # the script's own success per task, over the episodes it tried (kept or not)
        **{f"script/success_rate/{t}": v for t, v in (demos.script_success or {}).items()},
        "steps": cfg.sft.steps,
        "first_loss": history[0]["bc/loss"],
        "final_loss": history[-1]["bc/loss"],
        **evaluation,
        "wall_time": time.perf_counter() - start,
    }
    log.info(
        "sft: success %.3f after %d steps; policy saved to %s",
        evaluation.get("eval/success_rate", 0.0),
        cfg.sft.steps,
        cfg.model.path,
    )
    return summary


def collect_demos(cfg: EmbodiedConfig):
    """``sft.demos`` noisy expert episodes per task from the env adapter's scripts
    (``DEMO_SOURCES``), observed as the training envs observe. An episode runs until the expert
    succeeds (the collector's horizon, not ``env.max_episode_steps``: a short training horizon
    would leave the expert no successful episode to keep)."""
    kwargs = env_make_kwargs(cfg.env)
    env_id = kwargs.pop("env_id")
    kwargs.pop("max_episode_steps")
    return DEMO_SOURCES.get(cfg.env.adapter)(
        env_id, cfg.sft.demos, action_noise=cfg.sft.action_noise, seed=cfg.runner.seed, **kwargs
    )


def behaviour_clone(cfg: EmbodiedConfig, policy, demos) -> list[dict]:
    """``sft.steps`` optimizer steps through the train engine (``actor``'s optimizer settings,
    ``sft.lr`` and its schedule)."""
    s = cfg.sft
    engine_cfg = dataclasses.replace(
        cfg.actor, lr=s.lr, lr_schedule=s.lr_schedule, warmup_steps=s.warmup_steps
    )
    engine = TrainEngine(policy, engine_cfg, cfg.sft.steps, name="sft")
    return train_bc(
        policy,
        demos,
        engine,
        cfg.sft.steps,
        batch_size=cfg.sft.batch_size,
        seed=cfg.runner.seed,
        num_action_chunks=cfg.env.num_action_chunks,
        log_every=cfg.sft.log_interval,
    )
