"""The session proxy's latency overhead against calling the server directly, in the layout of a
training run, and an agent command's process start cost.

Layout (as ``tidal train`` runs an agent workflow):

- the inference server in its own process: ``tidal serve`` (the rollout's
  ``InferenceServerWorker`` is the same ``InferenceServer`` in a Ray actor process; like that
  worker it runs torch on ``--server-threads`` threads, 1 by default);
- the session proxy in the driver's process, on its own event-loop thread (the rollout
  dispatcher's ``tidal-episodes`` loop, where ``ExternalAgentWorkflow`` starts it), generating
  through an ``InferenceClient``;
- the agents in other processes: ``--client-procs`` processes share the ``--sessions``
  ``openai.AsyncOpenAI`` clients (a real run has one process per agent).

Each client makes ``--calls`` sequential chat completions of exactly ``--tokens`` new tokens
(EOS ignored on both paths), either to the server's ``/v1/chat/completions`` (direct) or to its
own recording session ``/sessions/{id}/v1/chat/completions`` (proxy). Two designs, each
``--rounds`` pairs: *alternating* rounds of only direct, then only proxy clients, each round's
median latency paired with the next round's (also the driver's and the server's CPU time per
call); *mixed* rounds of ``--sessions`` direct and ``--sessions`` proxy clients at once, paired
within the round (the same machine load and server batches for both: far less noisy on a busy
machine). The overhead is the median of the paired ratios, their spread printed beside it. Then the wall time of starting
``python`` bare, with ``openai`` and with the Agents SDK imported. Writes JSON.

    python benchmarks/agents_bench.py --out benchmarks/results/agents_bench.json

The model is a random Qwen2 built from a config (``--hidden``, ``--layers``; the ChatML byte
tokenizer of ``tidal.inference.tiny``): sized so that one decode step of 32 sequences takes
about what a GPU server's step takes on a real model (tens of milliseconds), i.e. generation is
the bulk of a call as it is in deployment, not HTTP handling.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MESSAGES = [{"role": "user", "content": "count from one to ten please"}]


# -- the agents' processes ----------------------------------------------------------------


async def _client_calls(base_url: str, key: str, calls: int, tokens: int, direct: bool) -> list:
    import openai

    extra = {"ignore_eos": True} if direct else None  # the proxy's sessions stop at no id
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
        model = (await c.models.list()).data[0].id
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            answer = await c.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=tokens, extra_body=extra
            )
            out.append(time.perf_counter() - t)
            if answer.usage.completion_tokens != tokens:
                raise RuntimeError(
                    f"{base_url}: {answer.usage.completion_tokens} tokens, not {tokens}"
                )
        return out


def client_main() -> None:
    """One agents' process: read its job, say ready, wait for go, run, print latencies."""
    job = json.loads(sys.stdin.readline())
    import openai  # noqa: F401 (imported before the clock starts)

    print("ready", flush=True)
    sys.stdin.readline()

    async def run():
        lat = await asyncio.gather(
            *(
                _client_calls(url, key, job["calls"], job["tokens"], kind == "direct")
                for url, key, kind in job["targets"]
            )
        )
        out = {"direct": [], "proxy": []}
        for (*_, kind), xs in zip(job["targets"], lat):
            out[kind] += xs
        return out

    print(json.dumps(asyncio.run(run())), flush=True)


def _run_clients(targets: list[tuple[str, str, str]], args) -> dict[str, list[float]]:
    """The round's clients (url, key, direct or proxy) in ``args.client_procs`` processes,
    started together; their latencies by kind."""
    procs = []
    parts = [targets[i :: args.client_procs] for i in range(args.client_procs)]
    for part in parts:
        p = subprocess.Popen(
            [sys.executable, __file__, "--client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        job = {"targets": part, "calls": args.calls, "tokens": args.tokens}
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        procs.append(p)
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("an agents' process did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    latencies = {"direct": [], "proxy": []}
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"an agents' process failed ({p.returncode})")
        for kind, xs in json.loads(out.splitlines()[-1]).items():
            latencies[kind] += xs
    return latencies


# -- the server's process -----------------------------------------------------------------


def _start_server(folder: Path, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "tidal.cli", "serve", "--model", str(folder), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # "tidal: serving MODEL on http://host:port"
    if " on http" not in line:
        proc.kill()
        raise RuntimeError(f"tidal serve did not start: {line!r}")
    return proc, line.rsplit(" on ", 1)[1].strip()


def _make_model(args) -> Path:
    from tidal.inference.tiny import save_tiny_chat_model

    folder = Path(tempfile.mkdtemp()) / "chat"
    return save_tiny_chat_model(
        folder, hidden=args.hidden, layers=args.layers, heads=args.heads, max_positions=1024
    )


# -- the driver's process (the proxy) -------------------------------------------------------


class ProxyThread:
    """A ``SessionProxy`` on its own event-loop thread, as the rollout dispatcher runs it."""

    def __init__(self, server_address: str, folder: Path, tokens: int, profile: str | None):
        from tidal.inference import GenerationConfig, InferenceClient
        from tidal.inference.sessions import SessionProxy
        from tidal.models.llm import load_tokenizer

        self.loop = asyncio.new_event_loop()
        self.profile, self.profiler = profile, cProfile.Profile() if profile else None
        run = self.loop.run_forever
        target = run if self.profiler is None else lambda: self.profiler.runcall(run)
        self.thread = threading.Thread(target=target, name="tidal-episodes", daemon=True)
        self.thread.start()
        self.inference = InferenceClient([server_address])
        gconfig = GenerationConfig(max_new_tokens=tokens, stop_token_ids=[])  # exact lengths
        self.proxy = SessionProxy(self.inference, load_tokenizer(str(folder)), gconfig)
        self.call(self.proxy.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def open(self, n: int) -> list:
        async def opened():
            return [self.proxy.open() for _ in range(n)]

        return self.call(opened())

    def close(self, sessions) -> None:
        async def ended():
            for s in sessions:
                await self.proxy.end(s.id)
                self.proxy.forget(s.id)

        self.call(ended())

    def stop(self) -> None:
        self.call(self.proxy.stop())
        self.call(self.inference.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if self.profiler is not None:
            self.profiler.dump_stats(self.profile)


def _cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), all its threads."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _round(proxy: ProxyThread, server_address: str, args, kind: str) -> dict[str, list[float]]:
    """``--sessions`` clients of ``kind`` (direct, proxy), or of both at once (mixed)."""
    targets = [(server_address + "/v1", "none", "direct")] * args.sessions
    if kind == "direct":
        return _run_clients(targets, args)
    sessions = proxy.open(args.sessions)
    mine = [(s.base_url, s.api_key, "proxy") for s in sessions]
    try:  # mixed: direct and proxy clients alternate, so each process holds both
        both = [t for pair in zip(targets, mine) for t in pair]
        return _run_clients(mine if kind == "proxy" else both, args)
    finally:
        proxy.close(sessions)


def _start_cost(code: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _alternating(proxy, server, address, args) -> dict:
    """Rounds of only direct, then only proxy clients, paired in order."""
    rounds = []
    for i in range(args.rounds):
        for kind in ("direct", "proxy"):
            cpu = _cpu_s(), _cpu_s(server.pid)
            lat = _round(proxy, address, args, kind)[kind]
            r = {
                "kind": kind,
                "median_s": statistics.median(lat),
                "driver_cpu_ms_per_call": (_cpu_s() - cpu[0]) / len(lat) * 1e3,
                "server_cpu_ms_per_call": (_cpu_s(server.pid) - cpu[1]) / len(lat) * 1e3,
            }
            rounds.append(r)
            print(
                f"alternating {i} {kind:6s} median {r['median_s']:.3f} s, CPU per call: "
                f"driver {r['driver_cpu_ms_per_call']:.1f} ms, "
                f"server {r['server_cpu_ms_per_call']:.1f} ms",
                flush=True,
            )
    out = {"pairs": [(d["median_s"], p["median_s"]) for d, p in zip(rounds[0::2], rounds[1::2])]}
    for key in ("driver_cpu_ms_per_call", "server_cpu_ms_per_call"):
        out[key] = {
            kind: statistics.median(r[key] for r in rounds if r["kind"] == kind)
            for kind in ("direct", "proxy")
        }
    return out


def _mixed(proxy, address, args) -> dict:
    """Rounds of ``--sessions`` direct and ``--sessions`` proxy clients at once (the same
    machine load and server batches for both), paired within the round."""
    pairs = []
    for i in range(args.rounds):
        lat = _round(proxy, address, args, "mixed")
        pairs.append((statistics.median(lat["direct"]), statistics.median(lat["proxy"])))
        print(f"mixed {i}: direct {pairs[-1][0]:.3f} s, proxy {pairs[-1][1]:.3f} s", flush=True)
    return {"pairs": pairs}


def _overheads(result: dict) -> dict:
    ratios = [p / d - 1 for d, p in result["pairs"]]
    return {
        **result,
        "paired_overhead": ratios,
        "overhead_median": statistics.median(ratios),
        "overhead_min": min(ratios),
        "overhead_max": max(ratios),
    }


def _print_side_by_side(name: str, result: dict) -> None:
    print(f"{name:12s} {'direct':>8s} {'proxy':>8s} {'overhead':>9s}")
    for (d, q), r in zip(result["pairs"], result["paired_overhead"]):
        print(f"{'  pair':12s} {d:8.3f} {q:8.3f} {r:+9.1%}")
    print(
        f"  overhead: median {result['overhead_median']:+.1%} "
        f"(pairs {result['overhead_min']:+.1%} .. {result['overhead_max']:+.1%})"
    )
    for key in ("driver_cpu_ms_per_call", "server_cpu_ms_per_call"):
        if key in result:
            print(f"  {key}: direct {result[key]['direct']:.1f}, proxy {result[key]['proxy']:.1f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="paired rounds of each mode")
    p.add_argument(
        "--mode",
        default="both",
        choices=("alternating", "mixed", "both"),
        help="alternating: direct rounds, then proxy rounds; mixed: both kinds in one round",
    )
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--start-runs", type=int, default=3)
    p.add_argument("--profile", default=None, help="cProfile the proxy's thread into this file")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.client:
        return client_main()
    load_at_start = os.getloadavg()
    folder = _make_model(args)
    server, address = _start_server(folder, args.server_threads)
    proxy, summary = None, {}
    try:
        proxy = ProxyThread(address, folder, args.tokens, args.profile)
        _round(proxy, address, args, "mixed")  # warm-up
        if args.mode in ("alternating", "both"):
            summary["alternating"] = _overheads(_alternating(proxy, server, address, args))
        if args.mode in ("mixed", "both"):
            summary["mixed"] = _overheads(_mixed(proxy, address, args))
    finally:
        if proxy is not None:
            proxy.stop()
        server.terminate()
        server.wait(timeout=30)
    for name, result in summary.items():
        _print_side_by_side(name, result)
    if args.start_runs:
        summary["process_start_s"] = {
            "python": _start_cost("pass", args.start_runs),
            "python+openai": _start_cost("import openai", args.start_runs),
            "python+agents_sdk": _start_cost("import agents", args.start_runs),
        }
    summary["args"] = vars(args)
    summary["load_average"] = {"start": load_at_start, "end": os.getloadavg()}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
