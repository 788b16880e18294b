"""Per-rank training memory and speed of causal LMs under actor.strategy ddp and fsdp2.

Llama models of ~100M and ~400M parameters are built from a config (nothing is downloaded),
trained a few steps on random tokens by tidal's TrainEngine on 2 ranks on ray (gloo on CPU),
and each rank reports the bytes of parameters, gradients and optimizer state it holds (counted
from its tensors, with gradients present), its peak RSS, and training tokens/s; next to them,
what ``tidal config --memory`` plans for the same model (tidal.memory, on the meta device).

    PYTHONPATH=$PWD python benchmarks/memory_bench.py --sizes 100m --out /tmp/memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from memory_workers import SIZES, MemoryWorker, llama_config  # noqa: E402

from tidal.config.common import ActorConfig  # noqa: E402
from tidal.memory import plan  # noqa: E402
from tidal.runtime import Cluster  # noqa: E402


def planned(size: str, strategy: str, ranks: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(size))
    p = plan(model, ActorConfig(strategy=strategy), ranks)
    return {
        "params": p.param_bytes,
        "grads": p.grad_bytes,
        "optimizer": p.optimizer_bytes,
        "total": p.total_bytes,
        "num_params": p.num_params,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["100m"], choices=sorted(SIZES))
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp2"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--rows", type=int, default=2, help="sequences per rank per micro-batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    cluster = Cluster("ray", devices_per_node=args.ranks, ray_init_kwargs={"num_cpus": 2})
    try:
        for size in args.sizes:
            for strategy in args.strategies:
                # a fresh group per run: peak RSS is per process
                group = MemoryWorker.create_group().launch(
                    cluster, args.ranks, name=f"{strategy}-{size}"
                )
                t0 = time.time()
                ranks = group.run(size, strategy, args.steps, args.rows, args.seq, args.micro).wait(
                    3600
                )
                group.shutdown()
                row = {
                    "size": size,
                    "strategy": strategy,
                    "ranks": args.ranks,
                    "wall_s": round(time.time() - t0, 1),
                    "planned_per_rank": planned(size, strategy, args.ranks),
                    "per_rank": ranks,
                }
                results.append(row)
                print(json.dumps(summary(row)), flush=True)
    finally:
        cluster.shutdown()
    by = {(r["size"], r["strategy"]): r for r in results}
    for size in args.sizes:
        if (size, "ddp") in by and (size, "fsdp2") in by:
            ddp = max(r["state_bytes"] for r in by[size, "ddp"]["per_rank"])
            fsdp = max(r["state_bytes"] for r in by[size, "fsdp2"]["per_rank"])
            print(f"{size}: fsdp2 / ddp per-rank state = {fsdp / ddp:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def summary(row: dict) -> dict:
    ranks = row["per_rank"]
    gib = 1024**3
    return {
        "size": row["size"],
        "strategy": row["strategy"],
        "params": ranks[0]["num_params"],
        "state_gib_per_rank": [round(r["state_bytes"] / gib, 3) for r in ranks],
        "planned_gib_per_rank": round(row["planned_per_rank"]["total"] / gib, 3),
        "peak_rss_gib": [round(r["peak_rss_bytes"] / gib, 2) for r in ranks],
        "rss_after_gib": [round(r["rss_after_bytes"] / gib, 2) for r in ranks],
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in ranks), 1),
        "rss_phases_gib": [
            {
                k: [round(v["rss"] / gib, 2), round(v["peak"] / gib, 2)]
                for k, v in r["rss_phases"].items()
            }
            for r in ranks
        ],
    }


if __name__ == "__main__":
    main()
