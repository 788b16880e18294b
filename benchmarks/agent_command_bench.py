"""One plain-``openai`` tool agent trained three ways, side by side in one run: in tidal's
process (``in_process_agent``), as a command per episode (``rollout.agent.command`` with the
default ``max_processes``) and as a persistent command (``rollout.agent.persistent``). Each is a
real ``tidal train`` run (``LLMRunner``, local backend) of ``--steps`` GRPO steps at
``--group`` samples per prompt and ``--batch`` prompts a step, with ``rollout.agent.timeout_s``
``--timeout``; it reports the median step time, the episodes that failed or timed out, and each
command mode's step time as a multiple of the in-process one. Writes JSON.

    python benchmarks/agent_command_bench.py --out benchmarks/results/agent_command.json

The model is the tests' tiny tool-calling chat model (``tests/agent_models.py``: a few seconds of
overfitting), so the agents' own cost (process start, ``import openai``, HTTP) is what differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_models import QUESTION, save_tool_model, tool_loop  # noqa: E402

AGENTS = ROOT / "tests" / "agent_scripts"


def in_process_factory(ctx):
    """rollout.workflow for the in-process mode: the same tool loop on the recording client."""
    from tidal.runners.llm.workflows import in_process_agent

    async def agent(client, data):
        return float(await tool_loop(client, data["prompt"]) == data["answer"])

    return in_process_agent(ctx, agent)


MODES = {
    "in_process": [f"rollout.workflow={Path(__file__).stem}:in_process_factory"],
    "command": [f"rollout.agent.command=[{sys.executable}, {AGENTS / 'tool_agent.py'}]"],
    "persistent": [
        f"rollout.agent.command=[{sys.executable}, {AGENTS / 'persistent_tool_agent.py'}]",
        "rollout.agent.persistent=true",
    ],
}


def train(mode: str, model: Path, data: Path, run_dir: Path, args) -> dict:
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.runners.llm.train import LLMRunner

    overrides = [
        f"model.path={model}",
        f"data.path={data}",
        f"runner.run_dir={run_dir}",
        f"runner.experiment={mode}",
        "runner.progress=false",
        f"runner.max_steps={args.steps}",
        "runner.eval_interval=0",
        "runner.save_interval=0",
        f"rollout.batch_size={args.batch}",
        f"rollout.group_size={args.group}",
        "rollout.max_new_tokens=40",
        "rollout.agent_mode=concat",
        f"rollout.agent.timeout_s={args.timeout}",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
        *MODES[mode],
    ]
    t0 = time.perf_counter()
    runner = LLMRunner(load_config(LLMConfig, None, overrides))
    try:
        summary = runner.run()
    finally:
        runner.close()
    wall = time.perf_counter() - t0
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["step"] >= 1]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "step_s_median": statistics.median(r["time/step"] for r in steps),
        "step_s_after_first": statistics.median(r["time/step"] for r in steps[1:] or steps),
        "agent_errors": steps[-1].get("rollout/agent_errors", 0),
        "reward_mean_last": steps[-1]["rollout/reward_mean"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--timeout", type=float, default=20.0, help="rollout.agent.timeout_s")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default="benchmarks/results/agent_command.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_tool_model(tmp / "tools")
        data = tmp / "questions.jsonl"
        data.write_text(json.dumps({"prompt": QUESTION, "answer": "7"}) + "\n")
        results = {}
        for mode in args.modes.split(","):
            results[mode] = train(mode, model, data, tmp / "runs", args)
            print(mode, json.dumps(results[mode]), flush=True)
    base = results.get("in_process", {}).get("step_s_after_first")
    for mode, r in results.items():
        if base and mode != "in_process":
            r["step_time_vs_in_process"] = r["step_s_after_first"] / base
            print(f"{mode}: {r['step_time_vs_in_process']:.2f}x the in-process step time")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
