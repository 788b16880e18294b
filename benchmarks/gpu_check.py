"""The GPU check (issue 27): on a machine with one CUDA GPU, in about 8 minutes.

1. the tests marked ``gpu`` (models and batches on CUDA, bf16 with fp32 master weights, the
   collective weight link between processes, offload freeing >= 90% of the actor's memory);
2. a short GRPO run of a ~100M-parameter model (built by ``tidal sft``), on CUDA, with the
   collective weight sync: generated tokens/s and the weight-sync time;
3. a short embodied PPO run (CartPole) on CUDA: env-steps/s.

It prints one JSON line per part and exits non-zero, saying so, without CUDA or when a part fails.

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

ROOT = Path(__file__).resolve().parent.parent
TIDAL = [sys.executable, "-m", "tidal.cli"]


def run(cmd: list[str], timeout: float) -> float:
    start = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    subprocess.run(
        cmd, cwd=ROOT, check=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    return time.perf_counter() - start


def last_metrics(run_dir: Path, experiment: str) -> list[dict]:
    folder = max(run_dir.glob(f"{experiment}*"), key=lambda p: p.stat().st_mtime)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is "
            "false): install a CUDA build of torch (make TORCH_SPEC=...) on a GPU machine",
            file=sys.stderr,
        )
        return 2
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    tmp = Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    report["gpu_tests_s"] = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q"], 240)
    print(json.dumps({"part": "gpu tests", "seconds": report["gpu_tests_s"]}), flush=True)

    model = tmp / "lm100m"
    common = [f"runner.run_dir={tmp}", "cluster.device=cuda", f"model.path={model}"]
    size = ["model.hidden=768", "model.layers=14", "model.heads=12", "model.dtype=float32"]
    run([*TIDAL, "sft", "examples/llm/arith_grpo.yaml", *common, *size, "sft.steps=20"], 180)
    grpo = [
        *common,
        "runner.experiment=gpu-grpo",
        f"runner.max_steps={args.steps}",
        "runner.eval_interval=0",
        "runner.save_interval=0",
        "rollout.max_staleness=0",
        "rollout.weight_sync=collective",
    ]
    report["grpo_s"] = run([*TIDAL, "train", "examples/llm/arith_grpo.yaml", *grpo], 240)
    rows = last_metrics(tmp, "gpu-grpo")
    report["grpo_generated_tokens_per_s"] = mean(rows, "rollout/generated_tokens_per_s")
    report["grpo_train_tokens_per_s"] = mean(rows, "train/tokens_per_s")
    report["grpo_weight_sync_s"] = mean(rows, "time/update_weights")
    print(json.dumps({"part": "grpo ~100M", **{k: v for k, v in report.items() if "grpo" in k}}))

    ppo = [
        f"runner.run_dir={tmp}",
        "cluster.device=cuda",
        "runner.experiment=gpu-ppo",
        "runner.max_steps=10",
        "runner.eval_interval=0",
        "runner.save_interval=0",
    ]
    report["ppo_s"] = run([*TIDAL, "train", "examples/embodied/cartpole_ppo.yaml", *ppo], 150)
    rows = last_metrics(tmp, "gpu-ppo")
    report["ppo_env_steps_per_s"] = mean(rows, "env_steps_per_s")
    report["ppo_weight_sync_s"] = mean(rows, "time/sync_weights")
    print(json.dumps({"part": "embodied ppo", **{k: v for k, v in report.items() if "ppo" in k}}))
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
