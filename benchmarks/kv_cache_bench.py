"""The engine's KV cache against transformers' ``DynamicCache`` on SmolLM2-135M-Instruct: one
decode step's time over a cache of ``--contexts`` positions at ``--batch`` rows, the cache
growing through ``--steps`` steps. ``DynamicCache`` concatenates each step's keys and values to
the cache (a copy of the whole cache every token); ``GrowingCache`` writes the step's column
into a buffer with room. Both run in this process, alternating, best of ``--repeats``.

    python benchmarks/kv_cache_bench.py [--batch 64] [--contexts 128 512 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tidal.inference.kv_cache import GrowingCache, cache_key
from tidal.models.gguf import model_folder


def step_ms(model, layers, make_cache, steps: int) -> float:
    """Mean milliseconds of a decode step, ``steps`` steps from a copy of ``layers``."""
    key = cache_key(model)
    cache = make_cache([(k.clone(), v.clone()) for k, v in layers])
    token = torch.randint(3, 1000, (layers[0][0].shape[0], 1))
    start = time.perf_counter()
    for _ in range(steps):
        cache = getattr(model(input_ids=token, use_cache=True, **{key: cache}), key)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/kv_cache_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_folder(args.model)).eval()
    result: dict = {"batch": args.batch, "steps": args.steps, "threads": args.threads}
    with torch.no_grad():
        for context in args.contexts:
            prefix = torch.randint(3, 1000, (args.batch, context))
            out = model(input_ids=prefix, use_cache=True, logits_to_keep=1)
            layers = [(k, v) for k, v, *_ in getattr(out, cache_key(model))]
            best = {"dynamic": float("inf"), "growing": float("inf")}
            for _ in range(args.repeats):
                for name, make in (("dynamic", DynamicCache), ("growing", GrowingCache)):
                    best[name] = min(best[name], step_ms(model, layers, make, args.steps))
            result[f"context_{context}"] = {
                "dynamic_step_ms": round(best["dynamic"], 1),
                "growing_step_ms": round(best["growing"], 1),
                "speedup": round(best["dynamic"] / best["growing"], 2),
            }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
