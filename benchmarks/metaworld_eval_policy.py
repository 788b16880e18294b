"""Success of a saved embodied policy folder on many fresh MetaWorld episodes (one per env copy),
for a steadier number than a training run's 32-episode evaluations (±8 points near 70%).

  python benchmarks/metaworld_eval_policy.py POLICY_DIR [--env-id reach-v3] [--envs 64]
      [--seed 2000000] [--obs-mode pixels] [--camera behindGripper] [--instruction-tokens 4]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("policy")
    parser.add_argument("--env-id", default="reach-v3")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=2_000_000, help="env i resets with seed + i")
    parser.add_argument("--obs-mode", default="pixels")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--camera", default="behindGripper")
    parser.add_argument("--instruction-tokens", type=int, default=4)
    parser.add_argument("--max-episode-steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tidal.envs import make_env
    from tidal.models import load_policy
    from tidal.models.imitation import evaluate_success

    env = make_env(
        "metaworld",
        args.envs,
        env_id=args.env_id,
        max_episode_steps=args.max_episode_steps,
        obs_mode=args.obs_mode,
        image_size=args.image_size,
        camera=args.camera,
        instruction_tokens=args.instruction_tokens,
    )
    try:
        seeds = [args.seed + i for i in range(args.envs)]
        result = evaluate_success(load_policy(args.policy), env, seeds)
    finally:
        env.close()
    print(json.dumps({"policy": args.policy, "episodes": args.envs, **result}, indent=2))


if __name__ == "__main__":
    main()
