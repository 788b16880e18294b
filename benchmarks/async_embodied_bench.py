"""Asynchronous embodied RL (``rollout.max_staleness`` = eta) against the synchronous loop.

pendulum     Pendulum-v1 (examples/embodied/pendulum_ppo.yaml), eta in --etas (default 0 2):
             does the eval return reach --target (-250) within 300k env steps, and when.
halfcheetah  HalfCheetah-v5 (examples/embodied/halfcheetah_ppo.yaml), eta in --etas
             (default 0 1 2) side by side, --env-steps each (1M in the issue).

For every run: final and best eval return, env steps to the target, wall time, env-steps/s and
the mean time per phase (training steps after the first, which also starts the workers). From
the synchronous run's own timers (collection: sync_weights +
generate_rollouts; training: compute_advantages + train) the ceiling an overlap can reach,
``(t_collect + t_train) / max(t_collect, t_train)``; for each asynchronous run its speed-up
(its env-steps/s over the synchronous run's, both over training steps, evaluations excluded),
that speed-up as a fraction of the ceiling, and ``step_over_actor_time`` (its step time over the actor's own work: 1.0 when
collection is entirely hidden; unlike the speed-up it does not depend on the load staying the
same between runs). Prints a line per run and writes JSON (--out).

  python benchmarks/async_embodied_bench.py pendulum halfcheetah [--etas 0 1 2] [--seeds 0 1 2]
      [--env-steps 1000000] [--extra key=value ...] [--out async_embodied_bench.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tidal.config import EmbodiedConfig, load_config  # noqa: E402
from tidal.runners import EmbodiedRunner  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "embodied"
RUN_DIR = "/tmp/tidal-async-embodied-bench"
COLLECT = ("time/sync_weights", "time/generate_rollouts")
TRAIN = ("time/compute_advantages", "time/train")
TASKS = {
    "pendulum": ("pendulum_ppo.yaml", (0, 2), 300_000),
    "halfcheetah": ("halfcheetah_ppo.yaml", (0, 1, 2), 1_000_000),
}


def run_one(
    config: str, eta: int, env_steps: int, target: float | None, extra: list[str], seed: int
) -> dict:
    """One run with the config's loss (asynchronous runs: decoupled PPO unless ``extra`` sets
    ``algorithm.use_decoupled_loss=false``)."""
    overrides = [
        f"runner.run_dir={RUN_DIR}",
        f"runner.experiment={Path(config).stem}-eta{eta}-seed{seed}",
        f"runner.seed={seed}",
        "runner.progress=false",
        "runner.save_interval=0",
        f"runner.max_env_steps={env_steps}",
        "runner.max_steps=100000",
        f"runner.target_value={'null' if target is None else target}",
        f"rollout.max_staleness={eta}",
        *extra,
    ]
    cfg = load_config(EmbodiedConfig, EXAMPLES / config, overrides)
    start = time.perf_counter()
    runner = EmbodiedRunner(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    return {**summarize(summary["run_dir"], eta, time.perf_counter() - start, target), "seed": seed}


def summarize(run_dir: str, eta: int, wall: float, target: float | None) -> dict:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").open()]
    evals = [(r["env_steps"], r["eval/return_mean"]) for r in rows if r.get("eval/return_mean")]
    phases = sorted({k for r in rows for k in r if k.startswith("time/") and k != "time/elapsed"})
    reached = [s for s, v in evals if target is not None and v >= target]
    # the first training step also starts the workers (its weight sync waits for them: seconds
    # on ray), so rates and phase times leave it out
    steady = rows[1:] if len(rows) > 1 else rows
    return {
        "eta": eta,
        "run_dir": run_dir,
        "steps": len(rows),
        "env_steps": rows[-1]["env_steps"],
        "wall_s": wall,
        # training steps only (evaluations excluded), after the first: what the overlap changes
        "env_steps_per_s": (rows[-1]["env_steps"] - rows[0]["env_steps"])
        / sum(r["time/step"] for r in steady),
        "final_eval_return": evals[-1][1] if evals else None,
        "best_eval_return": max(v for _, v in evals) if evals else None,
        "env_steps_to_target": reached[0] if reached else None,
        "phase_mean_s": {k: float(np.mean([r.get(k, 0.0) for r in steady])) for k in phases},
        "phase_total_s": {k: float(np.sum([r.get(k, 0.0) for r in steady])) for k in phases},
        "staleness_mean": float(np.mean([r.get("staleness/mean", 0.0) for r in rows])),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "eval_curve": evals,
    }


def compare(runs: list[dict]) -> dict:
    """Per seed: the ceiling from its synchronous run, each asynchronous run's speed-up."""
    seeds = sorted({r.get("seed", 0) for r in runs})
    return {f"seed{s}": compare_one([r for r in runs if r.get("seed", 0) == s]) for s in seeds}


def compare_one(runs: list[dict]) -> dict:
    """The ceiling from the synchronous run's timers; each asynchronous run's speed-up."""
    sync = next((r for r in runs if r["eta"] == 0), None)
    if sync is None:
        return {}
    t_collect = sum(sync["phase_total_s"].get(k, 0.0) for k in COLLECT)
    t_train = sum(sync["phase_total_s"].get(k, 0.0) for k in TRAIN)
    ceiling = (t_collect + t_train) / max(t_collect, t_train)
    out = {"t_collect_s": t_collect, "t_train_s": t_train, "ceiling": ceiling, "speedups": {}}
    for r in runs:
        if r["eta"] == 0:
            continue
        speedup = r["env_steps_per_s"] / sync["env_steps_per_s"]
        totals = r["phase_total_s"]
        actor_busy = sum(totals.get(k, 0.0) for k in (*TRAIN, "time/update_weights"))
        out["speedups"][r["eta"]] = {
            "speedup": speedup,
            "of_ceiling": speedup / ceiling,
            # within the run itself (immune to load changing between runs): 1.0 means the
            # steps took only as long as the actor's own work, collection entirely hidden
            "step_over_actor_time": totals["time/step"] / actor_busy,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", default=["pendulum"], choices=sorted(TASKS))
    parser.add_argument("--etas", type=int, nargs="*")
    parser.add_argument("--env-steps", type=int, help="per run (default: the task's)")
    parser.add_argument("--target", type=float, default=-250.0, help="pendulum eval target")
    parser.add_argument("--extra", nargs="*", default=[], help="more config overrides")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="runner.seed of each run")
    parser.add_argument("--out", default="async_embodied_bench.json")
    parser.add_argument(
        "--sync-run", nargs=2, metavar=("RUN_DIR", "WALL_S"), help="reuse a finished eta=0 run"
    )
    args = parser.parse_args()
    report = {}
    for task in args.tasks:
        config, etas, steps = TASKS[task]
        target = args.target if task == "pendulum" else None
        runs = []
        if args.sync_run:
            runs.append(summarize(args.sync_run[0], 0, float(args.sync_run[1]), target))
        for seed, eta in ((s, e) for s in args.seeds for e in (args.etas or etas)):
            r = run_one(config, eta, args.env_steps or steps, target, args.extra, seed)
            runs.append(r)
            print(
                f"{task} eta={eta} seed={seed}: env_steps {r['env_steps']} wall {r['wall_s']:.0f}s "
                f"{r['env_steps_per_s']:.0f} steps/s final eval {r['final_eval_return']} "
                f"best {r['best_eval_return']} to target {r['env_steps_to_target']} "
                f"staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f} "
                f"phases { ({k[5:]: round(v, 3) for k, v in r['phase_mean_s'].items()}) }",
                flush=True,
            )
        report[task] = {"runs": runs, "comparison": compare(runs)}
        print(task, json.dumps(report[task]["comparison"], indent=1), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
