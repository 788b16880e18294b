"""The soak benchmark's five-minute version (benchmarks/soak.py; the hour is in BENCHMARKS.md):
an asynchronous language run and a SAC run side by side on one Ray session, every step logged
once, and nothing growing after the warm-up beyond the target."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak.py"


# Not a RAY_MODULES test: its Ray session is the benchmark's own, in a subprocess, and it runs
# beside the Ray modules' worker (a 5-minute soak at the end of that worker's queue was CI's
# longest tail; sharing the cores slows it, and what it asserts is growth and steps, not speed).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_five_minutes_of_both_halves_log_every_step_once_and_do_not_grow(tmp_path):
    command = [sys.executable, str(SOAK), "--minutes", "5", "--interval", "15", "--warmup", "2"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(SOAK.parent.parent)},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 0
    for name, run in report["runs"].items():
        assert run["exit"] == 0 and run["once"] and run["steps"] > 0, (name, run)
    growth = report["growth"]
    assert growth["rss_total"] <= report["target_growth"], growth
    assert growth["fds_total"] <= report["target_growth"], growth
    first, last = growth["object_store"]
    assert last["bytes"] <= max(first["bytes"] * 1.1, 64 * 2**20), growth
