"""The session proxy's latency overhead against calling the server directly, and an agent
command's process start cost.

A tiny chat model behind tidal's server; ``--sessions`` concurrent OpenAI clients each make
``--calls`` chat completions of exactly ``--tokens`` tokens, either straight to the server's
``/v1/chat/completions`` or through their own recording session of the proxy (which generates
through ``InferenceClient.agenerate``). Rounds alternate direct / proxy so that the machine's
noise hits both. Then the wall time of starting ``python`` with nothing, with ``openai`` and with
the Agents SDK imported. Writes JSON.

    python benchmarks/agents_bench.py --out benchmarks/results/agents.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

from tidal.inference import GenerationConfig, GenerationEngine, InferenceClient, InferenceServer
from tidal.inference.sessions import SessionProxy
from tidal.inference.tiny import save_tiny_chat_model
from tidal.models.llm import load_tokenizer

MESSAGES = [{"role": "user", "content": "count from one to ten please"}]


async def _client_calls(base_url: str, key: str, calls: int, tokens: int, direct: bool) -> list:
    extra = {"ignore_eos": True} if direct else None
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
        model = (await c.models.list()).data[0].id
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            await c.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=tokens, extra_body=extra
            )
            out.append(time.perf_counter() - t)
        return out


def _round(loop, proxy, server, args, direct: bool) -> list[float]:
    async def sessions():
        return [proxy.open() for _ in range(args.sessions)]

    opened = asyncio.run_coroutine_threadsafe(sessions(), loop).result()
    targets = (
        [(server.address + "/v1", "none")] * args.sessions
        if direct
        else [(s.base_url, s.api_key) for s in opened]
    )

    async def run():
        lat = await asyncio.gather(
            *(_client_calls(u, k, args.calls, args.tokens, direct) for u, k in targets)
        )
        return [x for xs in lat for x in xs]

    latencies = asyncio.run(run())
    for s in opened:
        asyncio.run_coroutine_threadsafe(proxy.end(s.id), loop).result()
        proxy.forget(s.id)
    return latencies


def _start_cost(code: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--start-runs", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = save_tiny_chat_model(Path(tempfile.mkdtemp()) / "chat", hidden=64, layers=2)
    server = InferenceServer(GenerationEngine(folder)).start()
    tok = load_tokenizer(str(folder))
    loop = asyncio.new_event_loop()  # the proxy's loop, as the dispatcher's thread runs it
    threading.Thread(target=loop.run_forever, daemon=True).start()
    inference = InferenceClient([server.address])
    gconfig = GenerationConfig(max_new_tokens=args.tokens, stop_token_ids=[])  # exact lengths
    proxy = SessionProxy(inference, tok, gconfig)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result()
    results = {"direct": [], "proxy": []}
    try:
        _round(loop, proxy, server, args, direct=True)  # warm-up
        for _ in range(args.rounds):
            for kind in ("direct", "proxy"):
                results[kind] += _round(loop, proxy, server, args, kind == "direct")
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result()
        asyncio.run_coroutine_threadsafe(inference.aclose(), loop).result()
        server.stop()
    summary = {
        k: {"mean_s": statistics.mean(v), "median_s": statistics.median(v)}
        for k, v in results.items()
    }
    summary["overhead_mean"] = summary["proxy"]["mean_s"] / summary["direct"]["mean_s"] - 1
    summary["overhead_median"] = summary["proxy"]["median_s"] / summary["direct"]["median_s"] - 1
    summary["process_start_s"] = {
        "python": _start_cost("pass", args.start_runs),
        "python+openai": _start_cost("import openai", args.start_runs),
        "python+agents_sdk": _start_cost("import agents", args.start_runs),
    }
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
