"""Inference benchmark: output tokens/s on prompts with mixed (long-tailed) output lengths.

Continuous batching (tidal's engine, every request submitted at once) against static
batching (``model.generate`` on fixed batches, each running until its longest request is
done) and against one request at a time (the engine, sequentially), measured in one run.

    python benchmarks/inference_bench.py [--requests 64] [--hidden 256] [--layers 4] [--vllm]

``--vllm`` adds the same workload over HTTP to a tidal server and to a vLLM server (from
``.venv-vllm``) on the same model, both driven by tidal's client (tokens/s, end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tidal.inference import GenerationConfig, GenerationEngine
from tidal.inference.tiny import save_tiny_model


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
        length = 128 if rng.random() < 0.2 else rng.randint(8, 24)  # a long tail of long answers
        out.append((prompt, length))
    return out


def run_engine(engine: GenerationEngine, jobs, concurrent: bool) -> float:
    done = threading.Semaphore(0)
    start = time.perf_counter()
    if concurrent:
        for i, (prompt, n) in enumerate(jobs):
            engine.submit(
                prompt, GenerationConfig(max_new_tokens=n, seed=i), lambda r: done.release()
            )
        for _ in jobs:
            done.acquire()
    else:
        for i, (prompt, n) in enumerate(jobs):
            engine.submit(
                prompt, GenerationConfig(max_new_tokens=n, seed=i), lambda r: done.release()
            )
            done.acquire()
    return sum(n for _, n in jobs) / (time.perf_counter() - start)


def run_static(model, jobs, batch_size: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(jobs), batch_size):
        chunk = jobs[b : b + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = (
            torch.arange(width)[None, :]
            >= torch.tensor([width - len(p) for p, _ in chunk])[:, None]
        ).long()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(n for _, n in chunk),
                min_new_tokens=max(n for _, n in chunk),
                do_sample=True,
                pad_token_id=0,
            )
    return sum(n for _, n in jobs) / (time.perf_counter() - start)


def run_http(address: str, jobs, protocol=None) -> float:
    """Every request at once through tidal's client; output tokens per second."""
    from tidal.inference import InferenceClient, ModelRequest

    async def go() -> float:
        client = InferenceClient([address], protocol=protocol)
        try:
            start = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    client.agenerate(
                        ModelRequest(prompt, GenerationConfig(max_new_tokens=n, seed=i))
                    )
                    for i, (prompt, n) in enumerate(jobs)
                )
            )
            return sum(o.output_len for o in outs) / (time.perf_counter() - start)
        finally:
            await client.aclose()

    return asyncio.run(go())


def compare_with_vllm(path: Path, jobs) -> dict:
    from tidal.inference import InferenceServer
    from tidal.inference.vllm import VLLMProtocol, VLLMServer

    server = InferenceServer(GenerationEngine(path, max_batch_size=len(jobs))).start()
    try:
        run_http(server.address, jobs[:4])  # warm-up
        tidal_http = run_http(server.address, jobs)
    finally:
        server.stop()
    with VLLMServer(path, max_model_len=512) as vllm:
        run_http(vllm.address, jobs[:4], VLLMProtocol())  # warm-up (vLLM's first batches are slow)
        run_http(vllm.address, jobs[:4], VLLMProtocol())
        vllm_http = run_http(vllm.address, jobs, VLLMProtocol())
    return {
        "tidal_http_tok_s": tidal_http,
        "vllm_http_tok_s": vllm_http,
        "ratio_tidal_vs_vllm": tidal_http / vllm_http,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/inference_bench.json")
    parser.add_argument("--vllm", action="store_true", help="also compare with vLLM over HTTP")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            Path(tmp) / "m", hidden=args.hidden, layers=args.layers, heads=4, max_positions=512
        )
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        jobs = workload(args.requests, model.config.vocab_size)
        engine = GenerationEngine(path, max_batch_size=args.requests)
        run_engine(engine, jobs[:4], True)  # warm-up
        continuous = run_engine(engine, jobs, True)
        static = run_static(model, jobs, batch_size=16)
        one_at_a_time = run_engine(engine, jobs[: max(8, args.requests // 4)], False)
        engine.close()
        versus_vllm = compare_with_vllm(path, jobs) if args.vllm else {}
    params = sum(p.numel() for p in model.parameters())
    result = {
        "requests": args.requests,
        "params": params,
        "output_tokens": sum(n for _, n in jobs),
        "continuous_tok_s": continuous,
        "static_batch16_tok_s": static,
        "one_at_a_time_tok_s": one_at_a_time,
        "ratio_continuous_vs_static": continuous / static,
        "ratio_continuous_vs_one_at_a_time": continuous / one_at_a_time,
        **versus_vllm,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
