"""Why plain PPO on stale samples learns badly (issue 31): for each training step of a Pendulum
run, before the update, how far the trainer's policy already is from the behaviour policy on
the samples it is about to train on (mean |log-ratio|, fraction outside PPO's clip range), and
after it, how far the update moved the policy on them (mean |log pi_after - log pi_before|).

Plain PPO clips around the behaviour policy; on samples eta versions old the trainer's policy
has already left that range for some of them, and there the surrogate is unclipped in the
direction back towards the behaviour policy. Decoupled PPO clips around the trainer's policy.

  python benchmarks/stale_ppo_probe.py [--steps 40] [--out stale_ppo_probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tidal.algorithms import reshape_logprobs  # noqa: E402
from tidal.config import EmbodiedConfig, load_config  # noqa: E402
from tidal.runners import EmbodiedRunner  # noqa: E402
from tidal.workers.embodied_actor import EmbodiedActor  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "embodied" / "pendulum_ppo.yaml"
CASES = {
    "eta0": ["rollout.max_staleness=0"],
    "eta2-plain": ["rollout.max_staleness=2", "algorithm.use_decoupled_loss=false"],
    "eta2-decoupled": ["rollout.max_staleness=2"],
}


def per_sample(actor: EmbodiedActor, logp: torch.Tensor) -> torch.Tensor:
    """Log-probs at the loss's level, one number per sample (mean over the rest)."""
    x = reshape_logprobs(logp, actor.cfg.algorithm.logprob_type)
    return x.reshape(x.shape[0], -1).mean(-1)


def probe(overrides: list[str], steps: int, seed: int) -> list[dict]:
    rows, original = [], EmbodiedActor.run_training

    def run_training(self):
        before = per_sample(self, self._logprobs_under(self.model))
        behave = per_sample(self, self.batch["old_logprobs"])
        lag = self.engine.step - self.batch["versions"]
        stale = lag > 0
        log_ratio = (before - behave)[stale]
        metrics = original(self)
        after = per_sample(self, self._logprobs_under(self.model))
        rows.append(
            {
                "step": self.engine.step,  # after this update: as metrics.jsonl numbers it
                "stale_fraction": float(stale.float().mean()),
                "stale_abs_log_ratio": float(log_ratio.abs().mean()) if stale.any() else 0.0,
                "stale_outside_clip": float((log_ratio.exp() - 1).abs().gt(0.2).float().mean())
                if stale.any()
                else 0.0,
                "update_move": float((after - before).abs().mean()),
            }
        )
        return metrics

    EmbodiedActor.run_training = run_training
    try:
        cfg = load_config(
            EmbodiedConfig,
            CONFIG,
            [
                "runner.run_dir=/tmp/tidal-stale-ppo-probe",
                "runner.progress=false",
                "runner.save_interval=0",
                "runner.eval_interval=0",
                "runner.target_value=null",
                f"runner.max_steps={steps}",
                f"runner.seed={seed}",
                *overrides,
            ],
        )
        runner = EmbodiedRunner(cfg)
        try:
            runner.run()
        finally:
            runner.close()
    finally:
        EmbodiedActor.run_training = original
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="stale_ppo_probe.json")
    args = parser.parse_args()
    report = {}
    for name, overrides in CASES.items():
        rows = probe(overrides, args.steps, args.seed)[2:]  # after the first versions fill in
        summary = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "step"}
        summary["update_move_max"] = max(r["update_move"] for r in rows)
        report[name] = {"summary": summary, "steps": rows}
        print(name, json.dumps({k: round(v, 3) for k, v in summary.items()}), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
