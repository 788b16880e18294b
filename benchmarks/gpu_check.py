"""The GPU check (issues 27 and 28): on a machine with one CUDA GPU, in about 8 minutes.

1. the tests marked ``gpu`` (models and batches on CUDA, bf16 with fp32 master weights, the
   collective weight link between processes, offload freeing >= 90% of the actor's memory);
2. a short GRPO run of a ~100M-parameter model (built by ``tidal sft``), on CUDA, with the
   collective weight sync: generated tokens/s and the weight-sync time;
3. a short embodied PPO run (CartPole) on CUDA, on the local backend and on ray: env-steps/s;
4. a short SAC run (Pendulum) with the actor and its replay buffer on CUDA: updates/s.

Each part runs on its own (one that fails does not stop the others) and prints one JSON line;
the report names each failure, and the exit status is non-zero when a part failed or without CUDA.
``--device cpu --small`` runs the same parts, small, on a CPU: a dry run of this script.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py [--out gpu_check.json]
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

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
TIDAL = [sys.executable, "-m", "tidal.cli"]


def run(cmd: list[str], timeout: float) -> float:
    start = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    subprocess.run(
        cmd, cwd=ROOT, check=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path}
    )
    return time.perf_counter() - start


def last_metrics(run_dir: Path, experiment: str) -> list[dict]:
    folder = max(run_dir.glob(f"{experiment}*"), key=lambda p: p.stat().st_mtime)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float | None:
    """The mean over the steps after the first (compilation and warm-up), all where only one."""
    values = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def train(args, tmp: Path, example: str, name: str, overrides: list[str], timeout: float):
    """``tidal train`` of an example on the device, its evaluation and checkpoints off:
    the seconds it took and its metric rows."""
    common = [
        f"runner.run_dir={tmp}",
        f"cluster.device={args.device}",
        f"runner.experiment={name}",
        "runner.eval_interval=0",
        "runner.progress=false",
    ]
    seconds = run([*TIDAL, "train", f"examples/{example}", *common, *overrides], timeout)
    return seconds, last_metrics(tmp, name)


def gpu_tests(args, tmp: Path) -> dict:
    return {
        "seconds": run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q"], 240
        )
    }


def grpo(args, tmp: Path) -> dict:
    model = tmp / "lm"
    common = [f"runner.run_dir={tmp}", f"cluster.device={args.device}", f"model.path={model}"]
    size = (
        ["model.hidden=128", "model.layers=2", "model.heads=4"]
        if args.small
        else ["model.hidden=768", "model.layers=14", "model.heads=12"]
    )
    sft_s = run(
        [
            *TIDAL,
            "sft",
            "examples/llm/arith_grpo.yaml",
            *common,
            *size,
            "model.dtype=float32",
            "sft.steps=20",
        ],
        180,
    )
    overrides = [
        f"model.path={model}",
        f"runner.max_steps={args.steps}",
        "runner.save_interval=0",
        "rollout.max_staleness=0",
        "rollout.weight_sync=collective",
    ]
    seconds, rows = train(args, tmp, "llm/arith_grpo.yaml", "gpu-grpo", overrides, 240)
    return {
        "sft_s": sft_s,
        "grpo_s": seconds,
        "generated_tokens_per_s": mean(rows, "rollout/generated_tokens_per_s"),
        "train_tokens_per_s": mean(rows, "train/tokens_per_s"),
        "weight_sync_s": mean(rows, "time/update_weights"),
        "step_s": mean(rows, "time/step"),
    }


def ppo(args, tmp: Path, backend: str = "local") -> dict:
    overrides = [f"cluster.backend={backend}", "runner.max_steps=10", "runner.save_interval=0"]
    name = f"gpu-ppo-{backend}"
    seconds, rows = train(args, tmp, "embodied/cartpole_ppo.yaml", name, overrides, 150)
    return {
        "seconds": seconds,
        "env_steps_per_s": mean(rows, "env_steps_per_s"),
        "weight_sync_s": mean(rows, "time/sync_weights"),
    }


def sac(args, tmp: Path) -> dict:
    overrides = [f"runner.max_env_steps={1500 if args.small else 4000}"]
    seconds, rows = train(args, tmp, "embodied/pendulum_sac.yaml", "gpu-sac", overrides, 150)
    return {
        "seconds": seconds,
        "env_steps": rows[-1].get("env_steps"),
        "updates_per_s": mean(rows[len(rows) // 2 :], "updates_per_s"),
        "env_steps_per_s": mean(rows[len(rows) // 2 :], "env_steps_per_s"),
    }


def ppo_ray(args, tmp: Path) -> dict:
    """The same on ray: env, rollout and actor ranks in processes placed on the GPU node."""
    return ppo(args, tmp, backend="ray")


PARTS = {
    "gpu tests": gpu_tests,
    "grpo": grpo,
    "embodied ppo": ppo,
    "embodied ppo (ray)": ppo_ray,
    "sac": sac,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model (a dry run on a CPU)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is "
            "false): install a CUDA build of torch (make TORCH_SPEC=...) on a GPU machine",
            file=sys.stderr,
        )
        return 2
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    report: dict = {
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "failed": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    for name in args.parts:
        try:
            report[name] = PARTS[name](args, tmp)
        except Exception as error:  # a part that fails in any way is reported, the rest run
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            report["failed"].append(name)
        print(json.dumps({"part": name, **report[name]}), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))  # each part: a cut run keeps it
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
