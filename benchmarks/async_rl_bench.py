"""Asynchronous (max_staleness η, 4 unless ``--staleness``; decoupled PPO) against synchronous (0) RL on the same task,
the same number of training steps, from the same warm-started model, in one run.

    tidal sft examples/llm/reverse_grpo.yaml
    python benchmarks/async_rl_bench.py --config examples/llm/reverse_grpo.yaml \
        --model runs/models/reverse [--steps 30] [--staleness 4] [--pause-mode in_place] [--async-prox loglinear] [key=value ...]

Reports training tokens/s of each and the final held-out accuracy of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from tidal.config import load_config
from tidal.config.llm import LLMConfig
from tidal.runners.llm.train import LLMRunner

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm" / "reverse_grpo.yaml"


def run(
    config: str, model: str, steps: int, staleness: int, decoupled: bool, extra: list[str]
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        local_model = Path(tmp) / "model"
        shutil.copytree(model, local_model)
        cfg = load_config(
            LLMConfig,
            config,
            [
                f"model.path={local_model}",
                f"runner.run_dir={tmp}",
                "runner.progress=false",
                f"runner.max_steps={steps}",
                f"runner.eval_interval={steps}",
                "runner.max_minutes=null",
                f"rollout.max_staleness={staleness}",
                f"algorithm.use_decoupled_loss={str(decoupled).lower()}",
                *extra,
            ],
        )
        runner = LLMRunner(cfg)
        try:
            summary = runner.run()
            rows = [
                json.loads(x)
                for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
            ]
        finally:
            runner.close()
    steps_rows = [r for r in rows if r["step"] >= 1]
    train_tokens = sum(r["train/tokens"] for r in steps_rows)
    wall = sum(r["time/step"] for r in steps_rows)
    return {
        "max_staleness": staleness,
        "decoupled": decoupled,
        "overrides": extra,
        "train_tokens": train_tokens,
        "wall_s": wall,
        "generated_tokens_per_s": sum(
            r["rollout/generated_tokens_per_s"] * r["time/step"] for r in steps_rows
        )
        / wall,
        "time_prepare_s": sum(r["time/prepare_batch"] for r in steps_rows),
        "time_train_s": sum(r["time/train"] for r in steps_rows),
        "time_update_weights_s": sum(r["time/update_weights"] for r in steps_rows),
        "train_tokens_per_s": train_tokens / wall,
        "final_accuracy": summary["evals"][-1][1]["eval/accuracy"],
        "initial_accuracy": summary["evals"][0][1]["eval/accuracy"],
        "mean_staleness": sum(r["staleness/mean"] for r in steps_rows) / len(steps_rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(EXAMPLE))
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--staleness", type=int, default=4, help="the asynchronous run's rollout.max_staleness"
    )
    parser.add_argument(
        "--pause-mode", default="in_place", help="the asynchronous run's rollout.pause_mode"
    )
    parser.add_argument(
        "--async-prox",
        default="recompute",
        help="the asynchronous run's algorithm.prox_logp_method",
    )
    parser.add_argument("--out", default="benchmarks/results/async_rl_bench.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sync = run(args.config, args.model, args.steps, 0, False, args.overrides)
    print("sync:", json.dumps(sync), flush=True)
    asyn = run(
        args.config,
        args.model,
        args.steps,
        args.staleness,
        True,
        [
            f"rollout.pause_mode={args.pause_mode}",
            f"algorithm.prox_logp_method={args.async_prox}",
            *args.overrides,
        ],
    )
    print("async:", json.dumps(asyn), flush=True)
    result = {
        "sync": sync,
        "async": asyn,
        "tokens_per_s_ratio": asyn["train_tokens_per_s"] / sync["train_tokens_per_s"],
        "accuracy_gap_points": 100 * (asyn["final_accuracy"] - sync["final_accuracy"]),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
