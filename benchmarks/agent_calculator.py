"""The Agents SDK calculator, SFT then RL, end to end as a user runs it: write the questions and
demonstrations (make_data.py), ``tidal sft`` (a tiny Qwen2 built from the demonstrations),
start the agent service, ``tidal train`` the agent against it. The held-out greedy success rate
before RL is the run's first evaluation (step -1, the warm start), after RL its last.

    python benchmarks/agent_calculator.py --out benchmarks/results/agent_calculator.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "examples" / "llm" / "agents"


def tidal(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tidal.cli", *args], cwd=ROOT, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent service exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the agent service did not listen on {port} in {timeout_s:.0f} s")


def evaluations(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "agent-calculator-bench")
    p.add_argument("--demos", type=int, default=200)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1, help="runner.seed of SFT and RL (not the data)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    data, model, runs = a.work / "data", a.work / "model", a.work / "runs"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(AGENTS / "make_data.py"), str(data), "--demos", str(a.demos)],
        check=True,
    )
    tidal("sft", str(AGENTS / "calculator_sft.yaml"), f"model.path={model}",
          f"data.path={data / 'demos.jsonl'}", f"runner.run_dir={runs}",
          f"runner.seed={a.seed}")  # fmt: skip
    sft_s = time.perf_counter() - start
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, str(AGENTS / "calculator_service.py"), "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_for_port(port, service)
        rl_start = time.perf_counter()
        tidal("train", str(AGENTS / "calculator_rl.yaml"), f"model.path={model}",
              f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
              f"rollout.agent.url=http://127.0.0.1:{port}/", f"runner.max_steps={a.steps}",
              f"runner.run_dir={runs}", f"runner.seed={a.seed}")  # fmt: skip
        rl_s = time.perf_counter() - rl_start
    finally:
        service.terminate()
        service.wait(timeout=30)
    curve = evaluations(runs / "calculator-agent")
    result = {
        "held_out": sum(1 for _ in (data / "eval.jsonl").open()),
        "demonstrations": a.demos,
        "rl_steps": a.steps,
        "seed": a.seed,
        "success_after_sft": curve[0][1],
        "success_after_rl": curve[-1][1],
        "gain_points": round(100 * (curve[-1][1] - curve[0][1]), 1),
        "curve": curve,
        "sft_s": round(sft_s, 1),
        "rl_s": round(rl_s, 1),
    }
    print(json.dumps(result, indent=2))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
