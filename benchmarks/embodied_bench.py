"""Embodied benchmarks, each measured side by side in one run:

collection  env steps/s of tidal's rollout collection (local and ray; pipeline stages 1
            and 2) against a hand-written loop (gymnasium's vector env and two MLPs in one
            process), their rounds alternating; the ratio is the median of the pairs'.
pipeline    an env that costs about as much per step as policy inference: 2 pipeline
            stages against 1, beside the ideal speedup.
solve       wall time to solve CartPole-v1 (deterministic eval >= 475) with tidal's demo
            config against the single-file PPO with the published defaults.

  python benchmarks/embodied_bench.py [collection pipeline solve] [--seeds 3] [--envs 32 128]
      [--backends local ray] [--stages 1 2] [--rounds 20]
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
def tidal_runner(overrides: list[str], via_channel_actor: bool = False, warmup_s: float = 0.0):
    """A CartPole demo runner with these overrides, after one ``generate_rollouts`` and then
    ``warmup_s`` seconds more of them (a fresh Ray cluster spends its first seconds starting
    idle worker processes, which compete for this machine's two cores)."""
    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / "cartpole_ppo.yaml",
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


def make_hand_loop(num_envs: int, num_steps: int, hidden=(64, 64)) -> Callable[[], dict]:
    """The loop a user writes by hand, CleanRL style, with none of tidal's classes: gymnasium's
    ``SyncVectorEnv`` (its own autoreset), an actor and a critic MLP, a categorical policy, the
    samples kept per step and stacked per round. Returns one round (``num_steps`` steps)."""
    env_fns = [lambda: gym.make("CartPole-v1") for _ in range(num_envs)]
    envs = gym.vector.SyncVectorEnv(env_fns)

    def mlp(out: int) -> torch.nn.Sequential:
        sizes, layers = (4, *hidden), []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], out))

    actor, critic = mlp(2), mlp(1)
    obs = torch.as_tensor(envs.reset(seed=0)[0])

    def one_round():
        nonlocal obs
        store = {k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "dones")}
        for _ in range(num_steps):
            with torch.no_grad():
                dist = torch.distributions.Categorical(logits=actor(obs))
                action = dist.sample()
                logprob, value = dist.log_prob(action), critic(obs).squeeze(-1)
            next_obs, reward, term, trunc, _ = envs.step(action.numpy())
            for k, v in zip(store, (obs, action, logprob, value, reward, term | trunc)):
                store[k].append(v)
            obs = torch.as_tensor(next_obs)
        return {k: torch.stack([torch.as_tensor(x) for x in v], 1) for k, v in store.items()}

    one_round()
    return one_round


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
    ratios = [h / t for h, t in zip(hand, tidal)]
    return {"hand_s": hand, "tidal_s": tidal, "ratio": statistics.median(ratios)}


def bench_collection(rounds: int, envs: int, backends=("local", "ray"), stages=(1, 2)) -> dict:
    """For each configuration, ``rounds`` rounds of tidal's collection (one
    ``generate_rollouts``: every env ``4096 / envs`` chunk steps) alternate with rounds of the
    hand loop. On ray, ``ray_stages*`` is the runner as it is (bound channels: ZeroMQ point to
    point) and ``ray_channel_actor_stages*`` sends every item through the channel actor."""
    steps = 4096 // envs
    base = [
        f"env.total_num_envs={envs}",
        f"rollout.num_steps={steps}",
        "actor.global_batch_size=512",
        "actor.micro_batch_size=512",
        "env.eval_num_envs=8",
    ]
    ray_base = base + [
        "cluster.backend=ray",
        "cluster.devices_per_node=3",
        "cluster.placement={env: '0', rollout: '1', actor: '2'}",
    ]
    configs = {}  # name: (overrides, via the channel actor, warm-up seconds)
    for n in stages:
        if "local" in backends:
            configs[f"local_stages{n}"] = (base + ["cluster.backend=local"], False, 0.0)
        if "ray" in backends:
            configs[f"ray_stages{n}"] = (ray_base, False, RAY_WARMUP_S)
            configs[f"ray_channel_actor_stages{n}"] = (ray_base, True, RAY_WARMUP_S)
    hand_round = make_hand_loop(envs, steps)
    out = {}
    for name, (overrides, via_actor, warmup_s) in configs.items():
        n = int(name[-1])
        with tidal_runner([*overrides, f"env.pipeline_stage_num={n}"], via_actor, warmup_s) as r:
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
        print(name, envs, {k: v for k, v in out[name].items() if k != "rounds_s"}, flush=True)
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
    parser.add_argument("which", nargs="*", default=["collection", "pipeline", "solve"])
    parser.add_argument(
        "--rounds", type=int, default=20, help="rounds per configuration (collection: pairs)"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--envs", type=int, nargs="+", default=[32, 128], help="collection: env counts"
    )
    parser.add_argument(
        "--backends", nargs="+", default=["local", "ray"], help="collection: backends to run"
    )
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[1, 2], help="collection: pipeline stages"
    )
    parser.add_argument("--out", default="benchmarks/results/embodied_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(
        1
    )  # the same intra-op setting tidal's workers use (cluster.torch_threads)
    result = {}
    if "collection" in args.which:
        result["collection"] = {
            envs: bench_collection(args.rounds, envs, args.backends, args.stages)
            for envs in args.envs
        }
        print("collection (env steps/s):", json.dumps(result["collection"], indent=2), flush=True)
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
