"""The embodied runs the end-to-end tests share: a run from an example config, its metrics."""

import json
from pathlib import Path

from tidal.config import EmbodiedConfig, load_config
from tidal.runners import EmbodiedRunner

EXAMPLES = Path(__file__).parent.parent / "examples" / "embodied"
REQUIRED_KEYS = {
    "step",
    "env_steps",
    "time/step",
    "rollout/return_mean",
    "train/policy_loss",
    "train/value_loss",
    "train/entropy",
    "train/approx_kl",
    "train/clip_frac",
    "train/grad_norm",
}


def run(config, tmp_path, *overrides):
    cfg = load_config(
        EmbodiedConfig, config, [f"runner.run_dir={tmp_path}", "runner.progress=false", *overrides]
    )
    runner = EmbodiedRunner(cfg)
    try:
        return runner.run()
    finally:
        runner.close()


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TINY = [
    "env.total_num_envs=4",
    "env.pipeline_stage_num=2",
    "env.num_action_chunks=3",
    "env.eval_num_envs=2",
    "rollout.num_steps=8",
    "actor.global_batch_size=16",
    "actor.micro_batch_size=8",
    "runner.max_steps=2",
    "runner.eval_interval=1",
    "runner.save_interval=1",
    "runner.target_value=null",
]


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and k != "env_steps_per_s"}
