"""Behaviour cloning from MetaWorld's scripted experts: success before and after. Writes JSON.

python benchmarks/bc_metaworld.py --env-id reach-v3 --demos 10 --steps 500 --out bc.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch

from tidal.config import ActorConfig
from tidal.engine import TrainEngine
from tidal.envs import make_env
from tidal.envs.demos import collect_metaworld_demos
from tidal.models import build_policy, save_policy
from tidal.models.imitation import evaluate_success, train_bc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="reach-v3")
    p.add_argument("--policy", default="vla")
    p.add_argument("--demos", type=int, default=10, help="demonstrations per task")
    p.add_argument("--noise", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--obs-mode", default="state")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--max-episode-steps", type=int, default=150)
    p.add_argument("--eval-envs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="folder to save the trained policy in")
    p.add_argument("--out", default="bc_metaworld.json")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="Constant")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    adapter = {"obs_mode": args.obs_mode, "image_size": args.image_size}

    start = time.perf_counter()
    demos = collect_metaworld_demos(
        args.env_id,
        args.demos,
        action_noise=args.noise,
        seed=args.seed,
        max_episode_steps=args.max_episode_steps,
        **adapter,
    )
    collect_s = time.perf_counter() - start
    env = make_env(
        "metaworld",
        args.eval_envs,
        env_id=args.env_id,
        max_episode_steps=args.max_episode_steps,
        **adapter,
    )
    kwargs = (
        {"hidden_size": args.hidden_size, "num_layers": args.layers}
        if args.policy == "vla"
        else {"hidden_sizes": (args.hidden_size,) * args.layers}
    )
    policy = build_policy(
        args.policy, env.observation_space, env.action_space, args.chunks, obs_norm=True, **kwargs
    )
    seeds = [10_000 + i for i in range(args.eval_envs)]
    before = evaluate_success(policy, env, seeds)
    start = time.perf_counter()
    engine = TrainEngine(
        policy, ActorConfig(lr=args.lr, optimizer="adamw", max_grad_norm=1.0), args.steps, name="bc"
    )
    history = train_bc(
        policy,
        demos,
        engine,
        args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        num_action_chunks=args.chunks,
        log_every=max(1, args.steps // 10),
    )
    train_s = time.perf_counter() - start
    after = evaluate_success(policy, env, seeds)
    env.close()
    if args.save:
        save_policy(policy, args.save)
    result = {
        "args": vars(args),
        "demo_steps": len(demos.obs),
        "collect_s": round(collect_s, 1),
        "train_s": round(train_s, 1),
        "before": before,
        "after": after,
        "history": history,
        "load_average_1min": os.getloadavg()[0],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
