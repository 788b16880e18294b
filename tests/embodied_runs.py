"""The embodied runs the end-to-end tests share: a run from an example config, its metrics, and
a resume held to the uninterrupted run."""

import json
import shutil
from pathlib import Path

import torch

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


def assert_resume_is_exact(tmp_path, config, overrides, resume_at: int, max_steps: int):
    """Run ``max_steps`` straight (saving at ``resume_at``); resume a copy of that checkpoint in
    a new folder and run to ``max_steps`` again: every row after it and the final weights match
    bitwise (only timings differ)."""
    from safetensors.torch import load_file

    overrides = [
        *overrides,
        f"runner.max_steps={max_steps}",
        f"runner.save_interval={resume_at}",
        "runner.keep_checkpoints=0",
    ]
    straight = Path(run(config, tmp_path, *overrides, "runner.experiment=straight")["run_dir"])
    checkpoint = tmp_path / "resumed" / "checkpoints" / f"step_{resume_at:06d}"
    shutil.copytree(straight / "checkpoints" / checkpoint.name, checkpoint)
    resumed = Path(run(config, tmp_path, *overrides, f"runner.resume_from={checkpoint}")["run_dir"])
    assert resumed == tmp_path / "resumed"
    expected = [without_timings(r) for r in read_metrics(straight) if r["step"] > resume_at]
    assert [without_timings(r) for r in read_metrics(resumed)] == expected
    final = f"checkpoints/step_{max_steps:06d}/model.safetensors"
    weights, resumed_weights = load_file(straight / final), load_file(resumed / final)
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
