"""The SAC runs and transitions the SAC tests share."""

import json
from pathlib import Path

import torch

from tidal.config import EmbodiedConfig, load_config
from tidal.runners.embodied.offpolicy import OffPolicyRunner

EXAMPLES = Path(__file__).parent.parent / "examples" / "embodied"
PENDULUM = EXAMPLES / "pendulum_sac.yaml"
TINY = [
    "model.hidden_sizes=[32,32]",
    "replay.warmup_steps=64",
    "replay.batch_size=32",
    "runner.eval_interval=0",
    "runner.save_interval=0",
    "runner.target_value=null",
    "env.eval_num_envs=2",
]


def load(*overrides, path=PENDULUM):
    return load_config(EmbodiedConfig, path, list(overrides))


def run(tmp_path, *overrides, inspect=lambda runner: None, path=PENDULUM):
    """A run's summary, and what ``inspect`` finds in the runner before it closes."""
    cfg = load(f"runner.run_dir={tmp_path}", "runner.progress=false", *overrides, path=path)
    runner = OffPolicyRunner(cfg)
    try:
        return runner.run(), inspect(runner)
    finally:
        runner.close()


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def transitions(n, start=0):
    return {
        "obs": torch.arange(start, start + n, dtype=torch.float32)[:, None].repeat(1, 3),
        "actions": torch.zeros(n, 1, 1),
        "rewards": torch.arange(start, start + n, dtype=torch.float32),
        "terminations": torch.zeros(n, dtype=torch.bool),
        "truncations": torch.zeros(n, dtype=torch.bool),
        "next_obs": torch.zeros(n, 3),
        "steps": torch.ones(n, dtype=torch.int64),
    }
