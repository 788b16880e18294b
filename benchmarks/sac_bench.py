"""SAC's speed as a user pays it: env steps/s after the warm-up, side by side in one run, rounds
alternating, for

cleanrl     CleanRL's own ``sac_continuous_action.py`` (a fetched copy, not rewritten: pass its
            folder with ``cleanrl_utils`` beside it, and a Python that has its dependencies:
            gymnasium 0.29, stable-baselines3, tyro, tensorboard);
local       ``tidal train examples/embodied/halfcheetah_sac.yaml`` on the local backend;
ray         the same on ray, collection (env + rollout) and updates in separate processes on
            their own cores.

Every run takes one update per env step (``utd_ratio`` 1) on batches of 256 with 256x256
networks; the actor and the temperature are updated at every critic update (CleanRL updates
them twice every second step: the same work). The rate is the env steps between the first
record after ``--warmup + 200`` steps and the last, over the wall time between them, so start-up
and the fast random warm-up are left out. CleanRL runs on the CPU with torch's default thread
count, tidal with its default ``cluster.torch_threads`` (1); a mode ``NAME@T`` runs with T torch
threads per process (``cleanrl@1``: ``OMP_NUM_THREADS=1``, CleanRL's script unchanged). On a
loaded machine two OpenMP threads per process lose more to each other than they gain: compare
equal thread counts there.

  python benchmarks/sac_bench.py --cleanrl-dir DIR --cleanrl-python PY [--env HalfCheetah-v4]
      [--steps 4000] [--warmup 1000] [--rounds 2] [--modes cleanrl local local@2 ray] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "embodied" / "halfcheetah_sac.yaml"
TIDAL = [sys.executable, "-m", "tidal.cli", "train", str(CONFIG)]
RAY_OVERRIDES = [
    "cluster.backend=ray",
    "cluster.devices_per_node=2",
    "cluster.pin_cpus=true",
    "cluster.placement={'env,rollout': '0', actor: '1'}",
    "cluster.same_process=[]",  # env and rollout in processes of their own, as measured
]


def rate(points: list[tuple[int, float]], after: int) -> float:
    """Env steps/s between the first ``(env_steps, wall_s)`` point past ``after`` and the last."""
    late = [p for p in points if p[0] > after]
    if len(late) < 2:
        raise RuntimeError(f"too few records past {after} env steps: {points[-3:]}")
    (s0, t0), (s1, t1) = late[0], late[-1]
    return (s1 - s0) / (t1 - t0)


def run_cleanrl(args, workdir: Path, threads: int | None) -> list[tuple[int, float]]:
    cmd = [
        args.cleanrl_python,
        str(Path(args.cleanrl_dir) / "sac_continuous_action.py"),
        f"--env-id={args.env}",
        f"--total-timesteps={args.steps}",
        f"--learning-starts={args.warmup}",
        "--seed=1",
        "--no-cuda",
    ]
    env = {**os.environ, "PYTHONPATH": str(args.cleanrl_dir)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run(cmd, cwd=workdir, env=env, check=True, capture_output=True, timeout=3600)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = workdir.glob("runs/*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    # logged every 100 steps after learning starts, stamped with the wall time
    return [(e.step, e.wall_time) for e in acc.Scalars("losses/qf_loss")]


def run_tidal(args, workdir: Path, ray: bool, threads: int | None) -> list[tuple[int, float]]:
    overrides = [
        f"env.id={args.env}",
        f"runner.max_env_steps={args.steps}",
        f"replay.warmup_steps={args.warmup}",
        "runner.eval_interval=0",
        "runner.save_interval=0",
        "runner.target_value=null",
        "runner.seed=1",
        "algorithm.policy_delay=1",
        f"runner.run_dir={workdir}",
    ]
    if threads:
        overrides.append(f"cluster.torch_threads={threads}")
    cmd = TIDAL + overrides + (RAY_OVERRIDES if ray else [])
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=3600)
    (metrics,) = workdir.glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["env_steps"], r["time/elapsed"]) for r in records if "env_steps" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cleanrl-dir", help="folder holding sac_continuous_action.py and cleanrl_utils"
    )
    ap.add_argument("--cleanrl-python", default=sys.executable)
    ap.add_argument("--env", default="HalfCheetah-v4")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["cleanrl", "local", "ray"])
    ap.add_argument("--out", default="benchmarks/results/sac_bench.json")
    args = ap.parse_args()
    if any(m.startswith("cleanrl") for m in args.modes) and not args.cleanrl_dir:
        ap.error("--cleanrl-dir is needed for the cleanrl mode")

    def runner(mode: str):
        name, _, threads = mode.partition("@")
        count = int(threads) if threads else None
        if name == "cleanrl":
            return lambda d: run_cleanrl(args, d, count)
        if name not in ("local", "ray"):
            ap.error(
                f"--modes: {mode!r} is not cleanrl, local or ray (each with an optional @THREADS)"
            )
        return lambda d: run_tidal(args, d, name == "ray", count)

    runners = {mode: runner(mode) for mode in args.modes}
    rates: dict[str, list[float]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.time()
                points = runners[mode](Path(tmp))
                rates[mode].append(rate(points, args.warmup + 200))
            load = os.getloadavg()[0]
            print(
                f"round {r + 1} {mode:8s} {rates[mode][-1]:6.1f} env steps/s "
                f"(run {time.time() - start:.0f} s, load {load:.1f})",
                flush=True,
            )
    result = {
        "env": args.env,
        "steps": args.steps,
        "warmup": args.warmup,
        "rates": rates,
        "median": {m: statistics.median(v) for m, v in rates.items()},
    }
    base_mode = next((m for m in rates if m.startswith("cleanrl")), None)
    if base_mode:
        base = result["median"][base_mode]
        result["vs_cleanrl"] = {m: v / base for m, v in result["median"].items()}
        print(f"vs {base_mode}:", {m: round(v, 2) for m, v in result["vs_cleanrl"].items()})
    if "local" in rates and "ray" in rates:
        result["ray_vs_local"] = result["median"]["ray"] / result["median"]["local"]
        print(f"ray / local: {result['ray_vs_local']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("medians:", {m: round(v, 1) for m, v in result["median"].items()}, "->", args.out)


if __name__ == "__main__":
    main()
