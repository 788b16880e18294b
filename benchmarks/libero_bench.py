"""LIBERO collection speed: tidal's, in a training run, against a hand loop over the same envs
(``hand_loop.LiberoHandLoop``: LIBERO's envs and two MLPs, none of tidal's classes).

    python benchmarks/libero_bench.py --envs 4 --steps 35 --rounds 3 [--configs local ray_2env]

Both collect ``--envs`` envs of LIBERO-Object (copy i runs task i % 10) from state, 4-action
chunks, ``--steps`` chunk steps per round. tidal's rate is its env steps over the time its steps
spent collecting (``time/generate_rollouts``), the first step left out (it builds and warms
up); ``env_steps_per_s`` is the whole step's (collection and PPO). Prints one JSON line per
measurement. On two shared cores the numbers move with the load: run them back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hand_loop import LiberoHandLoop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "embodied" / "libero_object_ppo.yaml"
CONFIGS = {
    "local": ["cluster.backend=local"],
    # two env ranks, one per core, each with a rollout rank in its process
    "ray_2env": [
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "cluster.placement={'env,rollout': '0-1', actor: '1'}",
        "cluster.same_process=['env,rollout']",
    ],
}


def hand(envs: int, steps: int, rounds: int) -> dict:
    loop = LiberoHandLoop(envs, steps, "libero_object", chunk=4)
    try:
        start_steps, start = loop.env_steps, time.perf_counter()
        for _ in range(rounds):
            loop()
        elapsed = time.perf_counter() - start
        return {
            "loop": "hand",
            "envs": envs,
            "env_steps_per_s": (loop.env_steps - start_steps) / elapsed,
        }
    finally:
        loop.close()


def tidal(name: str, envs: int, steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            "model.path=null",
            f"runner.run_dir={run_dir}",
            f"runner.max_steps={rounds + 1}",
            "runner.eval_interval=0",
            "runner.save_interval=0",
            f"env.total_num_envs={envs}",
            "env.eval_num_envs=2",
            f"rollout.num_steps={steps}",
            f"actor.global_batch_size={envs * steps}",
            f"actor.micro_batch_size={envs * steps}",
            "algorithm.update_epochs=1",
            *CONFIGS[name],
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "tidal.cli", "train", str(EXAMPLE), *overrides]
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=3600)
        rows = [
            json.loads(x) for x in (Path(run_dir) / "libero_object_ppo" / "metrics.jsonl").open()
        ]
    rows = [r for r in rows if "time/generate_rollouts" in r][1:]
    collected = [b["env_steps"] - a["env_steps"] for a, b in zip(rows, rows[1:])]
    collect_time = sum(r["time/generate_rollouts"] for r in rows[1:])
    return {
        "loop": f"tidal {name}",
        "envs": envs,
        "collect_env_steps_per_s": sum(collected) / collect_time,
        "env_steps_per_s": sum(collected) / sum(r["time/step"] for r in rows[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=["local"], choices=sorted(CONFIGS))
    parser.add_argument("--skip-hand", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the intra-op setting tidal's workers use (cluster.torch_threads)
    if not args.skip_hand:
        print(json.dumps(hand(args.envs, args.steps, args.rounds)), flush=True)
    for name in args.configs:
        print(json.dumps(tidal(name, args.envs, args.steps, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
