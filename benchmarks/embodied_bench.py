"""Embodied benchmarks, each measured side by side in one run:

collection  env steps/s of tidal's rollout collection in isolation (``generate_rollouts``
            alone; local and ray; pipeline stages 1 and 2) against a hand-written loop
            (gymnasium's vector env and two MLPs in one process: benchmarks/hand_loop.py),
            their rounds alternating; the ratio is the median of the pairs'.
train       what a training run pays: real training steps (``tidal train``'s loop, run
            folder, loggers), each step's ``time/generate_rollouts`` from metrics.jsonl
            against a hand-loop round run just before it; median over the steps after the
            first. Printed beside ``collection``'s ratios when both run.
scaleout    HalfCheetah-v5, 32 envs: tidal on ray with 2 env ranks feeding one rollout
            rank (or one each) against the hand loop on SyncVectorEnv and on AsyncVectorEnv
            (a process per env), and against the hand loop split over two pinned processes
            that never talk (what the two cores give it), alternating round by round.
pipeline    an env that costs about as much per step as policy inference: 2 pipeline
            stages against 1, beside the ideal speedup.
solve       wall time to solve CartPole-v1 (deterministic eval >= 475) with tidal's demo
            config against the single-file PPO with the published defaults.

  python benchmarks/embodied_bench.py [collection train scaleout pipeline solve] [--seeds 3]
      [--envs 32 128] [--backends local ray] [--stages 1 2] [--rounds 20] [--steps 12]
      [--no-channel-actor] [--scaleout-configs NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import single_file_ppo  # noqa: E402
from hand_loop import HandLoop, SplitHandLoop, make_hand_loop  # noqa: E402

from tidal.config import EmbodiedConfig, load_config  # noqa: E402
from tidal.envs import register_env  # noqa: E402
from tidal.envs.gym_adapter import GymnasiumVectorEnv  # noqa: E402
from tidal.runners import EmbodiedRunner  # noqa: E402
from tidal.workers.rollout_worker import make_policy  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "embodied"
RUN_DIR = "/tmp/tidal-bench-runs"
RAY_WARMUP_S = 30.0


@register_env("costly_cartpole")
class CostlyCartPole(GymnasiumVectorEnv):
    """CartPole whose every vector step also costs ``step_cost_s`` per env, spent outside the
    GIL like a simulator's native code (sleep)."""

    def __init__(self, num_envs, step_cost_s=0.0, **kwargs):
        super().__init__(num_envs, **kwargs)
        self.cost = step_cost_s * num_envs

    def step(self, actions):
        time.sleep(self.cost)
        return super().step(actions)


class ChannelActorRunner(EmbodiedRunner):
    """The runner with no channel bound to its reader: on ray every item goes through the
    channel actor (the path before the ZeroMQ fast path), for comparison."""

    def channel_readers(self):
        return dict.fromkeys(super().channel_readers())


@contextmanager
def tidal_runner(
    overrides: list[str],
    via_channel_actor: bool = False,
    warmup_s: float = 0.0,
    config: str = "cartpole_ppo.yaml",
):
    """A CartPole demo runner with these overrides, after one ``generate_rollouts`` and then
    ``warmup_s`` seconds more of them (a fresh Ray cluster spends its first seconds starting
    idle worker processes, which compete for this machine's two cores)."""
    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / config,
        [f"runner.run_dir={RUN_DIR}", "runner.progress=false", *overrides],
    )
    runner = (ChannelActorRunner if via_channel_actor else EmbodiedRunner)(cfg)
    try:
        runner.sync_weights()
        warm_until = time.perf_counter() + warmup_s
        runner.generate_rollouts()
        while time.perf_counter() < warm_until:
            runner.generate_rollouts()
        yield runner
    finally:
        runner.close()


def tidal_collection(overrides: list[str], rounds: int) -> float:
    """Env steps/s over ``rounds`` calls of ``generate_rollouts``."""
    with tidal_runner(overrides) as runner:
        start, before = time.perf_counter(), runner.env_steps
        for _ in range(rounds):
            runner.generate_rollouts()
        return (runner.env_steps - before) / (time.perf_counter() - start)


def paired_ratio(baseline_s: list[float], measured_s: list[float]) -> float:
    """The median over paired rounds of baseline time / measured time (> 1: faster)."""
    return statistics.median(b / m for b, m in zip(baseline_s, measured_s))


def paired_rounds(hand_round: Callable, tidal_round: Callable, pairs: int) -> dict:
    """Seconds per round of each, alternating round by round, and the median of the per-pair
    ratios (hand time / tidal time): this machine's speed drifts by tens of percent from one
    minute to the next, so both sides of each ratio are measured under the same conditions."""
    hand, tidal = [], []
    for _ in range(pairs):
        for fn, times in ((hand_round, hand), (tidal_round, tidal)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {"hand_s": hand, "tidal_s": tidal, "ratio": paired_ratio(hand, tidal)}


def bench_collection(
    rounds: int, envs: int, backends=("local", "ray"), stages=(1, 2), channel_actor: bool = True
) -> dict:
    """For each configuration, ``rounds`` rounds of tidal's collection (one
    ``generate_rollouts``: every env ``4096 / envs`` chunk steps) alternate with rounds of the
    hand loop. On ray, ``ray_stages*`` is the runner as it is (bound channels: ZeroMQ point to
    point) and ``ray_channel_actor_stages*`` sends every item through the channel actor."""
    steps = 4096 // envs
    configs = {}  # name: (overrides, via the channel actor, warm-up seconds)
    for name, overrides in collection_configs(envs, backends, stages).items():
        ray = name.startswith("ray")
        configs[name] = (overrides, False, RAY_WARMUP_S if ray else 0.0)
        if name.startswith("ray_stages") and channel_actor:
            configs[name.replace("ray", "ray_channel_actor")] = (overrides, True, RAY_WARMUP_S)
    hand_round = make_hand_loop(envs, steps)
    out = {}
    for name, (overrides, via_actor, warmup_s) in configs.items():
        with tidal_runner(overrides, via_actor, warmup_s) as r:
            pair = paired_rounds(hand_round, r.generate_rollouts, rounds)
        rate = lambda seconds: envs * steps / statistics.median(seconds)  # noqa: E731
        out[name] = {
            "steps_per_s": rate(pair["tidal_s"]),
            "hand_loop_steps_per_s": rate(pair["hand_s"]),
            "ratio": pair["ratio"],
            # the fixed cost tidal adds to each chunk step, beyond the hand loop's
            "overhead_us_per_chunk_step": (
                statistics.median(t - h for h, t in zip(pair["hand_s"], pair["tidal_s"]))
                / steps
                * 1e6
            ),
            "rounds_s": {"hand": pair["hand_s"], "tidal": pair["tidal_s"]},
        }
        print("collection", name, envs, _brief(out[name]), flush=True)
    return out


def collection_configs(envs: int, backends, stages) -> dict[str, list[str]]:
    """The overrides of each configuration both collection modes measure (4,096 env steps per
    round; ``ray``: the ranks in three processes)."""
    base = [
        f"env.total_num_envs={envs}",
        f"rollout.num_steps={4096 // envs}",
        "actor.global_batch_size=512",
        "actor.micro_batch_size=512",
        "env.eval_num_envs=8",
    ]
    layouts = {
        "local": ["cluster.backend=local"],
        "ray": [
            "cluster.backend=ray",
            "cluster.devices_per_node=3",
            "cluster.placement={env: '0', rollout: '1', actor: '2'}",
        ],
        # what `cluster.backend=ray` alone runs: everything placed on 0, so with one pipeline
        # stage env and rollout share a process (cluster.same_process unset), the actor apart
        "ray_default": ["cluster.backend=ray"],
        # env and rollout in one process (cluster.same_process), the actor in another
        "ray_same_process": [
            "cluster.backend=ray",
            "cluster.devices_per_node=2",
            "cluster.placement={'env,rollout': '0', actor: '1'}",
            "cluster.same_process=['env,rollout']",
        ],
    }
    return {
        f"{backend}_stages{n}": [*base, *layouts[backend], f"env.pipeline_stage_num={n}"]
        for n in stages
        for backend in backends
    }


class PairedTrainRunner(EmbodiedRunner):
    """The runner ``tidal train`` runs, with one round of the hand loop before each training
    step (outside the step's timers): each step's ``time/generate_rollouts`` pairs with the
    hand loop's round just before it."""

    hand_round: Callable[[], dict]
    hand_s: list[float]

    def train_step(self, step: int) -> dict:
        start = time.perf_counter()
        self.hand_round()
        self.hand_s.append(time.perf_counter() - start)
        return super().train_step(step)


def train_run(overrides: list[str], hand_round: Callable, steps: int) -> dict:
    """``steps`` training steps as ``tidal train`` runs them (``run_with_restarts``, the run
    folder, its loggers); each step's ``time/generate_rollouts`` from ``metrics.jsonl``
    beside the hand loop's round before it."""
    from tidal.runners.loop import run_with_restarts

    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / "cartpole_ppo.yaml",
        [
            f"runner.run_dir={RUN_DIR}",
            "runner.progress=false",
            f"runner.max_steps={steps}",
            "runner.eval_interval=0",
            "runner.save_interval=0",
            "runner.target_value=null",
            *overrides,
        ],
    )
    hand_s: list[float] = []

    def make_runner(cfg, run_dir=None):
        runner = PairedTrainRunner(cfg, run_dir)
        runner.hand_round, runner.hand_s = hand_round, hand_s
        return runner

    summary = run_with_restarts(make_runner, cfg)
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    tidal_s = [row["time/generate_rollouts"] for row in rows if "time/generate_rollouts" in row]
    return {"hand_s": hand_s, "tidal_s": tidal_s, "run_dir": summary["run_dir"]}


def bench_train(steps: int, envs: int, backends=("local", "ray"), stages=(1, 2)) -> dict:
    """What a training run pays for collection: ``steps`` real training steps per
    configuration, each step's ``time/generate_rollouts`` (the batch ready on the actor)
    against a round of the hand loop run just before it; the median of the per-step ratios
    over the steps after the first."""
    num_steps = 4096 // envs
    hand_round = make_hand_loop(envs, num_steps)
    out = {}
    for name, overrides in collection_configs(envs, backends, stages).items():
        run = train_run(overrides, hand_round, steps)
        hand, tidal = run["hand_s"][1:], run["tidal_s"][1:]
        rate = lambda seconds: envs * num_steps / statistics.median(seconds)  # noqa: E731
        out[name] = {
            "steps_per_s": rate(tidal),
            "hand_loop_steps_per_s": rate(hand),
            "ratio": paired_ratio(hand, tidal),
            "first_step_s": run["tidal_s"][0],
            "rounds_s": {"hand": run["hand_s"], "tidal": run["tidal_s"]},
        }
        print("train", name, envs, _brief(out[name]), flush=True)
    return out


def _brief(row: dict) -> dict:
    return {
        k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "rounds_s"
    }


def side_by_side(result: dict) -> str:
    """A table of the ratios of every configuration the modes measured, one row each."""
    modes = [m for m in ("collection", "train") if m in result]
    lines = ["config  envs  " + "  ".join(f"{m:>10}" for m in modes)]
    keys = {(envs, name) for m in modes for envs, rows in result[m].items() for name in rows}
    for envs, name in sorted(keys):
        cells = [result[m].get(envs, {}).get(name, {}).get("ratio") for m in modes]
        text = "  ".join(f"{c:10.2f}" if c is not None else f"{'-':>10}" for c in cells)
        lines.append(f"{name:<28}{envs:>5}  {text}")
    return "\n".join(lines)


SCALEOUT_ENVS, SCALEOUT_STEPS = 32, 64  # HalfCheetah-v5: 2,048 env steps per round
SCALEOUT_BASE = [
    f"env.total_num_envs={SCALEOUT_ENVS}",
    f"rollout.num_steps={SCALEOUT_STEPS}",
    "model.obs_norm=false",  # the hand loop's network: a 64x64 actor and critic, nothing else
    "actor.global_batch_size=2048",
    "actor.micro_batch_size=2048",
    "env.eval_num_envs=2",
    "cluster.backend=ray",
]
# name: overrides. Two env ranks feed one rollout rank; the actor only waits meanwhile.
SCALEOUT_CONFIGS = {
    "ray_2env_pinned_stages2": [
        "cluster.devices_per_node=2",
        "cluster.pin_cpus=true",
        "cluster.placement={env: '0-1', rollout: '0', actor: '1'}",
        "env.pipeline_stage_num=2",
    ],
    "ray_2env_stages2": [
        "cluster.devices_per_node=3",
        "cluster.placement={env: '0-1', rollout: '2', actor: '2'}",
        "env.pipeline_stage_num=2",
    ],
    "ray_2env_stages1": [
        "cluster.devices_per_node=3",
        "cluster.placement={env: '0-1', rollout: '2', actor: '2'}",
        "env.pipeline_stage_num=1",
    ],
    # each env rank with a rollout rank of its own on its core: two pairs that never wait on
    # each other, where one rollout rank makes both env ranks wait for the slower one
    "ray_2env_2rollout_pinned": [
        "cluster.devices_per_node=2",
        "cluster.pin_cpus=true",
        "cluster.placement={env: '0-1', rollout: '0-1', actor: '1'}",
        "env.pipeline_stage_num=1",
    ],
    "ray_2env_2rollout": [
        "cluster.devices_per_node=2",
        "cluster.placement={env: '0-1', rollout: '0-1', actor: '1'}",
        "env.pipeline_stage_num=1",
    ],
    # the same pairs, each env rank and its rollout rank in one process (cluster.same_process):
    # an action reaches its env rank in memory instead of as a message
    "ray_2env_2rollout_same_process_pinned": [
        "cluster.devices_per_node=2",
        "cluster.pin_cpus=true",
        "cluster.placement={'env,rollout': '0-1', actor: '1'}",
        "cluster.same_process=['env,rollout']",
        "env.pipeline_stage_num=1",
    ],
    "ray_2env_2rollout_same_process": [
        "cluster.devices_per_node=2",
        "cluster.placement={'env,rollout': '0-1', actor: '1'}",
        "cluster.same_process=['env,rollout']",
        "env.pipeline_stage_num=1",
    ],
}


def halfcheetah_runner(overrides: list[str]):
    return tidal_runner(
        [*SCALEOUT_BASE, *overrides], warmup_s=RAY_WARMUP_S, config="halfcheetah_ppo.yaml"
    )


def bench_scaleout(
    rounds: int, names: list[str] | None = None, steps_per_round: int = SCALEOUT_STEPS
) -> dict:
    """Env scale-out on HalfCheetah-v5, 32 envs: tidal on ray with 2 env ranks feeding one
    rollout rank (or one each), against the hand loop in one process with ``SyncVectorEnv`` and
    with ``AsyncVectorEnv`` (its default: a process per env), and against the hand loop split
    over two pinned processes that never talk (``SplitHandLoop``: what the two cores give a hand
    loop at the moment; shared hosts vary), the four alternating round by round; the ratios are
    medians of the per-round ratios."""
    steps = SCALEOUT_ENVS * steps_per_round
    loops: dict = {}
    out = {}
    try:
        loops["sync"] = HandLoop(SCALEOUT_ENVS, steps_per_round, "HalfCheetah-v5", "sync")
        loops["split"] = SplitHandLoop(SCALEOUT_ENVS, steps_per_round, "HalfCheetah-v5")
        loops["async"] = HandLoop(SCALEOUT_ENVS, steps_per_round, "HalfCheetah-v5", "async")
        for name in names or list(SCALEOUT_CONFIGS):
            overrides = [*SCALEOUT_CONFIGS[name], f"rollout.num_steps={steps_per_round}"]
            with halfcheetah_runner(overrides) as runner:
                # tidal right after the one-process loop and right before the split one
                order = {
                    "sync": loops["sync"],
                    "tidal": runner.generate_rollouts,
                    "split": loops["split"],
                    "async": loops["async"],
                }
                times = {key: [] for key in order}
                for _ in range(rounds):
                    for key, fn in order.items():
                        start = time.perf_counter()
                        fn()
                        times[key].append(time.perf_counter() - start)
            out[name] = {
                **{f"{k}_steps_per_s": steps / statistics.median(v) for k, v in times.items()},
                **{f"vs_{k}": paired_ratio(times[k], times["tidal"]) for k in loops},
                # what the two cores gave the hand loop in this run
                "split_vs_sync": paired_ratio(times["sync"], times["split"]),
                "rounds_s": times,
            }
            print("scaleout", name, _brief(out[name]), flush=True)
    finally:
        for loop in loops.values():
            loop.close()
    return out


def bench_pipeline(rounds: int) -> dict:
    envs, steps, hidden = 256, 32, [512, 512, 512]
    cfg = load_config(EmbodiedConfig, None, [f"model.hidden_sizes={hidden}"])
    space = gym.spaces.Box(-np.inf, np.inf, (4,))
    policy = make_policy(cfg, space, gym.spaces.Discrete(2)).eval()
    x = torch.randn(envs // 2, 4)
    with torch.no_grad():
        policy.act(policy.prepare(x))
        start = time.perf_counter()
        for _ in range(50):
            policy.act(policy.prepare(x))
    infer_half = (time.perf_counter() - start) / 50
    per_env_cost = infer_half / (
        envs // 2
    )  # the env step of a stage costs what its inference costs
    base = [
        f"env.total_num_envs={envs}",
        f"rollout.num_steps={steps}",
        "env.adapter=costly_cartpole",
        f"env.adapter_kwargs={{step_cost_s: {per_env_cost}}}",
        f"model.hidden_sizes={hidden}",
        f"actor.global_batch_size={envs * steps}",
        f"actor.micro_batch_size={envs * steps}",
    ]
    one = tidal_collection(base + ["env.pipeline_stage_num=1"], rounds)
    two = tidal_collection(base + ["env.pipeline_stage_num=2"], rounds)
    return {
        "inference_s_per_stage_batch": infer_half,
        "env_s_per_stage_batch": per_env_cost * (envs // 2),
        "stages1_steps_per_s": one,
        "stages2_steps_per_s": two,
        "speedup": two / one,
        "ideal_speedup": 2.0,
    }


def bench_solve(seeds: int) -> dict:
    import torch._dynamo  # noqa: F401  both sides build an Adam, which imports it lazily: not timed

    rows = []
    for seed in range(1, seeds + 1):
        cfg = load_config(
            EmbodiedConfig,
            EXAMPLES / "cartpole_ppo.yaml",
            [
                f"runner.run_dir={RUN_DIR}",
                "runner.progress=false",
                f"runner.seed={seed}",
                f"runner.seed={seed}",
            ],
        )
        start = time.perf_counter()
        runner = EmbodiedRunner(cfg)
        try:
            summary = runner.run()
        finally:
            runner.close()
        tidal_time = time.perf_counter() - start  # includes starting the workers
        base = single_file_ppo.train(seed=seed)
        rows.append(
            {
                "seed": seed,
                "tidal_wall_s": tidal_time,
                "tidal_env_steps": summary["solved_at_env_steps"],
                "baseline_wall_s": base["wall_time"],
                "baseline_env_steps": base["env_steps"],
                "baseline_solved": base["solved"],
            }
        )
        print(rows[-1], flush=True)
    ratio = statistics.median(r["tidal_wall_s"] for r in rows) / statistics.median(
        r["baseline_wall_s"] for r in rows
    )
    return {"runs": rows, "median_time_ratio_tidal_over_baseline": ratio}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "which",
        nargs="*",
        default=["collection", "pipeline", "solve"],
        help="collection (isolated), train (in training runs), scaleout, pipeline, solve",
    )
    parser.add_argument(
        "--rounds", type=int, default=20, help="rounds per configuration (collection: pairs)"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--envs", type=int, nargs="+", default=[32, 128], help="collection: env counts"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["local", "ray"],
        choices=["local", "ray", "ray_default", "ray_same_process"],
        help="collection, train: layouts to run (ray_same_process: env and rollout in one process)",
    )
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[1, 2], help="collection: pipeline stages"
    )
    parser.add_argument(
        "--steps", type=int, default=12, help="train: training steps per configuration"
    )
    parser.add_argument(
        "--no-channel-actor",
        action="store_true",
        help="collection: skip the ray runs through the channel actor",
    )
    parser.add_argument(
        "--scaleout-configs",
        nargs="+",
        choices=list(SCALEOUT_CONFIGS),
        help="scaleout: the tidal layouts to run (default: all)",
    )
    parser.add_argument(
        "--scaleout-steps",
        type=int,
        default=SCALEOUT_STEPS,
        help="scaleout: chunk steps per round (the HalfCheetah example collects 256)",
    )
    parser.add_argument("--out", default="benchmarks/results/embodied_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(
        1
    )  # the same intra-op setting tidal's workers use (cluster.torch_threads)
    result = {}
    if "collection" in args.which:
        result["collection"] = {
            envs: bench_collection(
                args.rounds, envs, args.backends, args.stages, not args.no_channel_actor
            )
            for envs in args.envs
        }
    if "train" in args.which:
        result["train"] = {
            envs: bench_train(args.steps, envs, args.backends, args.stages) for envs in args.envs
        }
    if "collection" in args.which or "train" in args.which:
        print("ratios to the hand loop, side by side:\n" + side_by_side(result), flush=True)
    if "scaleout" in args.which:
        result["scaleout"] = bench_scaleout(args.rounds, args.scaleout_configs, args.scaleout_steps)
    if "pipeline" in args.which:
        result["pipeline"] = bench_pipeline(args.rounds)
        print("pipeline:", json.dumps(result["pipeline"], indent=2), flush=True)
    if "solve" in args.which:
        result["solve"] = bench_solve(args.seeds)
        print("solve:", json.dumps(result["solve"], indent=2), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
