"""Faults on purpose, at named points, for the tests that prove a run survives them.

``TIDAL_FAULTS`` (unset: every point is a no-op) holds a JSON list of faults::

    [{"at": "weights.recv", "when": {"version": 3, "bucket": 0}, "do": "kill",
      "once": "/tmp/run/fault-1"}]

A fault fires at the first point named ``at`` whose arguments match every ``when`` entry:
``kill`` ends this process with SIGKILL (a rank's whole process: every group in it), ``hang``
stops it with SIGSTOP (it answers nothing, as a process stuck in native code). ``once``: a file
the fault creates as it fires (holding the struck process's id); while it exists the fault is
spent (a restarted run passes the same point again). The ray backend forwards the variable to every rank's process.

The points: ``call`` (a rank starts a method: ``group``, ``rank``, ``method``, ``n``: that
method's calls on this rank so far, from 1), ``weights.send`` and ``weights.recv`` (a weight
link's sender has broadcast, or a receiver has received, the header of a bucket and not its
tensor: ``transport``, ``version``, ``bucket``, ``rank``).
"""

from __future__ import annotations

import functools
import json
import os
import signal

ENV = "TIDAL_FAULTS"
ACTIONS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


def fault_point(point: str, **where) -> None:
    """Fire the fault ``TIDAL_FAULTS`` names for this point and these arguments, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for fault in _faults(spec):
        if fault["at"] != point:
            continue
        when = fault.get("when", {})
        if all(k in where and str(where[k]) == str(v) for k, v in when.items()) and _claim(fault):
            os.kill(os.getpid(), ACTIONS[fault.get("do", "kill")])


@functools.lru_cache(maxsize=4)
def _faults(spec: str) -> list[dict]:
    try:
        faults = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV}: not JSON ({exc}): {spec!r}") from None
    for fault in faults:
        if fault.get("do", "kill") not in ACTIONS:
            raise ValueError(f"{ENV}: 'do' must be one of {sorted(ACTIONS)}, got {fault['do']!r}")
    return faults


def _claim(fault: dict) -> bool:
    """True when the fault is not spent (and now is: its ``once`` file made)."""
    once = fault.get("once")
    if once is None:
        return True
    try:
        fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())  # which process it struck
    os.close(fd)
    return True
