"""A tethered command dies with the process that started it, even when that one is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tidal.runtime.tether import tethered

# A parent that starts a tethered `sleep` in a session of its own (as tidal starts vLLM), prints
# the tether's pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
from tidal.runtime.tether import tethered
proc = subprocess.Popen(tethered([sys.executable, "-c", "import time; time.sleep(120)"]),
                        start_new_session=True)
print(proc.pid, flush=True)
time.sleep(120)
"""


def gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def session(tether_pid: int) -> list[int]:
    """The tether and its command, once the command has started."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        children = psutil.Process(tether_pid).children()
        if children:
            return [tether_pid, *(c.pid for c in children)]
        time.sleep(0.05)
    raise AssertionError("the tether did not start its command")


def test_a_sigkilled_parent_takes_the_tethered_session_with_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = session(int(parent.stdout.readline()))
        assert not gone(pids, within=1.0)  # alive while the parent is
        parent.kill()
        parent.wait(5)
        assert gone(pids, within=5.0), "the tethered command outlived its parent"
    finally:
        parent.kill()


def test_the_tether_exits_with_the_command_and_waits_for_it_on_sigterm(tmp_path):
    done = subprocess.run(tethered([sys.executable, "-c", "raise SystemExit(7)"]), timeout=30)
    assert done.returncode == 7

    # SIGTERM to the session: the command shuts down (here: writes a file), the tether waits
    script = (
        "import signal, sys, time, pathlib\n"
        "def bye(*_):\n"
        f"    time.sleep(0.5); pathlib.Path({str(tmp_path / 'clean')!r}).touch(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(tethered([sys.executable, "-c", script]), start_new_session=True)
    session(proc.pid)
    time.sleep(0.5)  # the command's handler is installed
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(10) == 0 and (tmp_path / "clean").exists()
