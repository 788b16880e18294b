"""What a flow policy's denoising chain costs in collection: env steps/s of ``tidal train``'s
rollout (``time/generate_rollouts`` per step, MetaWorld MT10, the same envs) with the ``flow``
policy (``model.flow.steps`` Euler steps) against the ``vla`` token policy, runs alternating;
and each policy's own time per chunk step on the same batch (``act`` alone). Writes JSON.

  python benchmarks/flow_cost.py [--rounds 3] [--steps 3] [--flow-steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tidal.config import EmbodiedConfig, load_config
from tidal.models.factory import build_from_config
from tidal.runners import EmbodiedRunner
from tidal.runners.preflight import probe_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "embodied"
CONFIGS = {"vla": "metaworld_mt10_vla.yaml", "flow": "metaworld_mt10_flow.yaml"}


def config(name: str, run_dir: str, steps: int, flow_steps: int) -> EmbodiedConfig:
    overrides = [
        f"runner.run_dir={run_dir}",
        "runner.progress=false",
        f"runner.max_steps={steps}",
        "runner.eval_interval=0",
        "runner.save_interval=0",
        "model.path=null",  # random weights: the cost does not depend on them
    ]
    if name == "flow":
        overrides.append(f"model.flow.steps={flow_steps}")
    return load_config(EmbodiedConfig, EXAMPLES / CONFIGS[name], overrides)


def collection_rate(cfg: EmbodiedConfig) -> float:
    """Median env steps/s of the run's collection, its first step left out."""
    runner = EmbodiedRunner(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
    per_step = cfg.env.total_num_envs * cfg.rollout.num_steps * cfg.env.num_action_chunks
    return statistics.median(per_step / r["time/generate_rollouts"] for r in rows[1:])


@torch.inference_mode()
def act_ms(cfg: EmbodiedConfig, repeats: int = 50) -> float:
    """Median milliseconds of one ``act`` on a batch of the run's envs."""
    (obs_space, action_space), _ = probe_env(cfg)
    policy = build_from_config(cfg.model, obs_space, action_space, cfg.env.num_action_chunks)
    obs = torch.from_numpy(obs_space.sample()[None].repeat(cfg.env.total_num_envs, 0))
    inputs = policy.prepare(obs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        policy.act(inputs)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--flow-steps", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/flow_cost.json")
    args = p.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in CONFIGS:
                cfg = config(name, f"{tmp}/{name}{r}", args.steps, args.flow_steps)
                rates[name].append(collection_rate(cfg))
                print(name, f"{rates[name][-1]:.0f} env steps/s", flush=True)
        ms = {name: act_ms(config(name, tmp, 1, args.flow_steps)) for name in CONFIGS}
    result = {
        "flow_steps": args.flow_steps,
        "env_steps_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "rounds": rates,
        "act_ms": ms,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
