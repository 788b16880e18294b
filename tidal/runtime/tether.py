"""Run a command that dies with the process that started it, even when that process is SIGKILLed.

A server a rank launches in a session of its own (so that closing it kills its children too)
outlives the rank when the rank is killed: no signal reaches the server's session. Started as

    python -m tidal.runtime.tether PARENT_PID -- command ...

in that new session, the tether runs the command in the same session, exits with its status,
and kills the whole session once ``PARENT_PID`` is no longer its parent (the parent died and the
tether was reparented). ``SIGTERM`` to the session reaches the command directly; the tether
ignores it and waits for the command, so the caller still waits for a clean shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5


def tethered(argv: list[str], parent: int | None = None) -> list[str]:
    """``argv`` run under a tether to ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    return [sys.executable, "-m", "tidal.runtime.tether", str(parent), "--", *argv]


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m tidal.runtime.tether PARENT_PID -- command ...", file=sys.stderr)
        return 2
    parent = int(args[0])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the command got it too: wait for it
    if os.getppid() != parent:  # the parent died while this started
        return 137
    child = subprocess.Popen(args[2:], preexec_fn=_default_sigterm)
    while True:
        try:
            code = child.wait(POLL_S)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:
                os.killpg(0, signal.SIGKILL)  # the command, its children, and this tether


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ignored signals are inherited across exec


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
