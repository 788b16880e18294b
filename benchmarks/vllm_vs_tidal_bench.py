"""Rollout engines compared: tidal's inference server against a vLLM server (``make vllm``) on
the same model and workload, both over HTTP and driven by tidal's client, as a run drives them.

Two workloads: ``mixed`` (every request at once, long-tailed output lengths: the inference
benchmark's) and ``grpo`` (prompts of ``--group`` samples each, ``n`` per request, as GRPO asks).
Output tokens per second, the best of ``--repeats`` runs after a warm-up.

    python benchmarks/vllm_vs_tidal_bench.py [--hidden 512] [--layers 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_bench import workload  # noqa: E402

from tidal.inference import (  # noqa: E402
    GenerationConfig,
    GenerationEngine,
    InferenceClient,
    InferenceServer,
    ModelRequest,
)
from tidal.inference.tiny import save_tiny_model  # noqa: E402
from tidal.inference.vllm import VLLMProtocol, VLLMServer  # noqa: E402


def grpo_workload(prompts: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(prompts)
    ]


async def _tokens_per_s(address: str, protocol, requests, eos: int | None = None) -> float:
    """``requests``: (prompt, max_new_tokens, n, seed) all at once, each sample ending at ``eos``
    (if given) or its cap; output tokens per second."""
    stop = [] if eos is None else [eos]
    client = InferenceClient([address], protocol=protocol)
    try:
        start = time.perf_counter()
        groups = await asyncio.gather(
            *(
                client.agenerate_n(
                    ModelRequest(
                        p, GenerationConfig(max_new_tokens=m, seed=s, stop_token_ids=stop)
                    ),
                    n,
                )
                for p, m, n, s in requests
            )
        )
        return sum(o.output_len for g in groups for o in g) / (time.perf_counter() - start)
    finally:
        await client.aclose()


def best_of(address: str, protocol, requests, repeats: int, eos: int | None = None) -> float:
    asyncio.run(_tokens_per_s(address, protocol, requests[:8], eos))  # warm-up
    return max(asyncio.run(_tokens_per_s(address, protocol, requests, eos)) for _ in range(repeats))


def measure(address: str, protocol, workloads: dict, repeats: int) -> dict:
    return {name: best_of(address, protocol, reqs, repeats) for name, reqs in workloads.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="mixed: requests")
    parser.add_argument("--prompts", type=int, default=16, help="grpo: prompts")
    parser.add_argument("--group", type=int, default=8, help="grpo: samples per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="grpo: new tokens per sample")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="tidal's torch threads (vLLM's CPU server takes 1)"
    )
    parser.add_argument("--out", default="benchmarks/results/vllm_vs_tidal_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            Path(tmp) / "m", hidden=args.hidden, layers=args.layers, heads=8, max_positions=512
        )
        vocab = AutoConfig.from_pretrained(path).vocab_size
        workloads = {
            "mixed": [(p, n, 1, i) for i, (p, n) in enumerate(workload(args.requests, vocab))],
            "grpo": [
                (p, args.tokens, args.group, i)
                for i, p in enumerate(grpo_workload(args.prompts, vocab))
            ],
        }
        batch = max(args.requests, args.prompts * args.group)
        server = InferenceServer(GenerationEngine(path, max_batch_size=batch)).start()
        try:
            tidal = measure(server.address, None, workloads, args.repeats)
        finally:
            server.stop()
        with VLLMServer(path, max_model_len=512) as vllm_server:
            vllm = measure(vllm_server.address, VLLMProtocol(), workloads, args.repeats)
    result = {
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": 8},
        "tidal_torch_threads": args.threads,
        "workloads": {
            "mixed": f"{args.requests} requests, 8-128 new tokens (20% long)",
            "grpo": f"{args.prompts} prompts x {args.group} samples x {args.tokens} tokens",
        },
        **{
            name: {
                "tidal_tok_s": round(tidal[name], 1),
                "vllm_tok_s": round(vllm[name], 1),
                "ratio_tidal_vs_vllm": round(tidal[name] / vllm[name], 2),
            }
            for name in workloads
        },
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
