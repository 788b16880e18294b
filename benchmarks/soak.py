"""Soak: tidal runs long, and nothing grows that should not.

Two runs side by side on one Ray session for ``--minutes``: an asynchronous language run
(tidal's engine, eta = 2, on a tiny arithmetic model) and a SAC run (Pendulum), each
``tidal train`` in a process of its own joined to the session this script starts. Every
``--interval`` seconds it samples every process of the session (this script, the two runs,
Ray's own processes, every rank): RSS, open file descriptors, and Ray's object-store use, and
the size of each run's ``train.log`` and ``metrics.jsonl``. It writes them as JSON and reports
the growth of each after the warm-up (``--warmup``, default 10 minutes or a third of the run):
the target is at most 10% per process and in total, and every step logged exactly once.

    python benchmarks/soak.py --minutes 60            # the hour (BENCHMARKS.md)
    python benchmarks/soak.py --minutes 5 --interval 15
    python benchmarks/soak.py --plot benchmarks/results/soak/soak.json   # the plot again
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TARGET_GROWTH = 0.10


def language_command(out: Path, model: Path, address: str, minutes: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.cli",
        "train",
        "runner.task=llm",
        f"model.path={model}",
        f"runner.run_dir={out}",
        "runner.experiment=soak-llm",
        "runner.progress=false",
        "runner.max_steps=1000000",
        f"runner.max_minutes={minutes}",
        "runner.eval_interval=0",
        "runner.save_interval=200",
        "rollout.max_staleness=2",
        "rollout.batch_size=8",
        "rollout.group_size=4",
        "rollout.max_concurrent_rollouts=16",
        "cluster.backend=ray",
        f"cluster.address={address}",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
    ]


def sac_command(out: Path, address: str, minutes: float, capacity: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.cli",
        "train",
        str(ROOT / "examples" / "embodied" / "pendulum_sac.yaml"),
        f"runner.run_dir={out}",
        "runner.experiment=soak-sac",
        "runner.progress=false",
        "runner.max_steps=100000000",
        "runner.max_env_steps=null",
        f"runner.max_minutes={minutes}",
        "runner.target_value=null",
        "runner.save_interval=2000",
        f"replay.capacity={capacity}",
        "cluster.backend=ray",
        f"cluster.address={address}",
        "cluster.devices_per_node=2",
    ]


def tiny_language_model(path: Path) -> Path:
    """The tests' arithmetic model: SFT of a tiny Qwen-style model for 20 steps (seconds)."""
    if (path / "config.json").exists():
        return path
    from tidal.config import load_config
    from tidal.config.llm import LLMConfig
    from tidal.runners.llm.sft import run_sft

    overrides = [f"model.path={path}", "model.hidden=32", "model.layers=1", "sft.steps=20"]
    run_sft(load_config(LLMConfig, None, overrides))
    return path


def object_store(address: str) -> dict | None:
    """Ray's object stores across the session: bytes used and objects held (what ``ray memory
    --stats-only`` prints, read from the raylet's reply)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    try:
        stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    except Exception:  # noqa: BLE001 - a sample missed, not a failed soak
        return None
    return {"bytes": stats.object_store_bytes_used, "objects": stats.num_local_objects}


def label(proc: psutil.Process) -> str:
    """What a process is: a rank (its Ray title), a run's driver, Ray's own or this script."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if proc.pid == os.getpid():
        return "soak"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    if "tidal.cli" in cmd:
        return "driver:" + next((a.split("=")[1] for a in cmd if "experiment=" in a), "?")
    name = Path(cmd[0]).name if cmd else proc.name()
    return next((Path(a).name for a in cmd[1:3] if "ray" in a), name)


def sample(address: str, runs: dict[str, Path], start: float, running: list[str]) -> dict:
    procs = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                procs[proc.pid] = {
                    "label": label(proc),
                    "rss": proc.memory_info().rss,
                    "fds": proc.num_fds(),
                }
        except psutil.Error:
            continue
    files = {}
    for name, out in runs.items():
        for f in ("train.log", "metrics.jsonl"):
            path = out / f"soak-{name}" / f
            files[f"{name}/{f}"] = path.stat().st_size if path.exists() else 0
    return {
        "t": time.monotonic() - start,
        "running": running,
        "processes": procs,
        "rss_total": sum(p["rss"] for p in procs.values()),
        "fds_total": sum(p["fds"] for p in procs.values()),
        "object_store": object_store(address),
        "files": files,
    }


def growth(samples: list[dict], warmup_s: float) -> dict:
    """Relative growth from the first sample after the warm-up to the last taken while every
    run still ran, in total and for each process alive at both (its worst). A sample in which
    a run had begun to close (fewer processes than at the first) is not the last: its drop
    would hide growth (more processes, a leak, still count)."""
    every = max(len(s["running"]) for s in samples)
    after = [s for s in samples if s["t"] >= warmup_s and len(s["running"]) == every]
    after = [s for s in after if len(s["processes"]) >= len(after[0]["processes"])] if after else []
    if len(after) < 2:
        return {"error": f"fewer than 2 samples after the {warmup_s:g} s warm-up"}
    first, last = after[0], after[-1]

    def rel(a, b):
        return None if a in (None, 0) or b is None else (b - a) / a

    per_process = {}
    for pid, p in first["processes"].items():
        q = last["processes"].get(pid)
        if q is not None:
            key = f"{p['label']} ({pid})"
            per_process[key] = {"rss": rel(p["rss"], q["rss"]), "fds": rel(p["fds"], q["fds"])}
    worst_rss = max(per_process.items(), key=lambda kv: kv[1]["rss"] or 0, default=(None, {}))
    return {
        "from_s": first["t"],
        "to_s": last["t"],
        "rss_total": rel(first["rss_total"], last["rss_total"]),
        "fds_total": rel(first["fds_total"], last["fds_total"]),
        "object_store": [first["object_store"], last["object_store"]],
        "worst_process_rss": {"process": worst_rss[0], **worst_rss[1]},
        "per_process": per_process,
    }


def steps_logged_once(metrics: Path) -> dict:
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    steps = [s for s in steps if s >= 1]  # step 0 is the evaluation before training
    return {"steps": len(steps), "once": steps == list(range(1, len(steps) + 1))}


def plot(report: dict, path: Path) -> Path:
    """Memory (all processes and the largest few), open files, and log sizes over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t"] / 60 for s in samples]
    by_label: dict[str, list[float]] = {}
    for i, s in enumerate(samples):
        for proc in s["processes"].values():
            series = by_label.setdefault(proc["label"], [0.0] * len(samples))
            series[i] += proc["rss"] / 2**20
    largest = sorted(by_label, key=lambda k: -max(by_label[k]))[:5]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(minutes, [s["rss_total"] / 2**20 for s in samples], label="all processes")
    for name in largest:
        axes[0].plot(minutes, by_label[name], label=name, lw=1)
    axes[0].set(title="resident memory (MiB)", xlabel="minutes", ylim=(0, None))
    axes[0].legend(fontsize=7)
    axes[1].plot(minutes, [s["fds_total"] for s in samples])
    axes[1].set(title="open file descriptors, all processes", xlabel="minutes", ylim=(0, None))
    for name in samples[-1]["files"]:
        axes[2].plot(minutes, [s["files"][name] / 2**20 for s in samples], label=name)
    axes[2].set(title="log and metrics size (MiB)", xlabel="minutes")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.axvline(report["warmup_min"], color="grey", ls=":", lw=1)
    fig.suptitle(
        f"tidal soak: language (eta 2) and SAC on one Ray session, {report['minutes']:g} min"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plot", type=Path, default=None, help="only plot this soak.json")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=None, help="minutes (default min(10, 1/3))")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    p.add_argument("--sac-capacity", type=int, default=20000, help="replay.capacity of SAC")
    args = p.parse_args()
    if args.plot is not None:
        print(f"wrote {plot(json.loads(args.plot.read_text()), args.plot.with_suffix('.png'))}")
        return 0
    warmup_min = args.warmup if args.warmup is not None else min(10.0, args.minutes / 3)
    args.out.mkdir(parents=True, exist_ok=True)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, _system_config={"worker_niceness": 0})
    address = ray.get_runtime_context().gcs_address
    model = tiny_language_model(args.out / "arith-model")
    runs = {"llm": args.out / "llm", "sac": args.out / "sac"}
    commands = {
        "llm": language_command(runs["llm"], model, address, args.minutes),
        "sac": sac_command(runs["sac"], address, args.minutes, args.sac_capacity),
    }
    for out in runs.values():  # a fresh folder: the runs' steps are counted from 0
        subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = {name: open(args.out / f"{name}.stderr", "w") for name in commands}
    children = {
        name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=logs[name], text=True)
        for name, cmd in commands.items()
    }
    start, samples = time.monotonic(), []
    deadline = start + args.minutes * 60 + 600  # the runs stop themselves; 10 min for set-up
    while any(c.poll() is None for c in children.values()) and time.monotonic() < deadline:
        running = [name for name, c in children.items() if c.poll() is None]
        samples.append(sample(address, runs, start, running))
        s = samples[-1]
        print(
            f"{s['t']:7.0f} s  rss {s['rss_total'] / 2**20:8.1f} MiB  fds {s['fds_total']:5d}  "
            f"object store {s['object_store']}  "
            f"processes {len(s['processes'])}",
            flush=True,
        )
        wait_until = time.monotonic() + args.interval
        while time.monotonic() < wait_until and any(c.poll() is None for c in children.values()):
            time.sleep(1)
    results = {}
    for name, child in children.items():
        if child.poll() is None:
            child.kill()
        out, _ = child.communicate(timeout=60)
        run_dir = runs[name] / f"soak-{name}"
        results[name] = {
            "exit": child.returncode,
            "command": " ".join(commands[name]),
            **(steps_logged_once(run_dir / "metrics.jsonl") if run_dir.exists() else {}),
        }
    report = {
        "minutes": args.minutes,
        "interval_s": args.interval,
        "warmup_min": warmup_min,
        "target_growth": TARGET_GROWTH,
        "runs": results,
        "growth": growth(samples, warmup_min * 60),
        "samples": samples,
        "load_average": os.getloadavg(),
    }
    path = args.out / "soak.json"
    path.write_text(json.dumps(report, indent=1))
    g = report["growth"]
    print(
        json.dumps(
            {k: v for k, v in report.items() if k != "samples"}
            | {"growth": {k: v for k, v in g.items() if k != "per_process"}},
            indent=1,
        )
    )
    print(f"wrote {path} and {plot(report, path.with_suffix('.png'))}")
    ray.shutdown()
    ok = all(r["exit"] == 0 and r.get("once") for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
