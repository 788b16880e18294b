"""An agent that makes no model call and behaves as its argv says, for the tests of agent slots.

``scripted_agent.py LOG SECONDS [persistent-mode]``: each run (or, persistent, each request)
appends ``start``/``end`` lines with its pid and a time to LOG around a sleep of SECONDS, then
answers ``{"reward": 1}``. Persistent modes: ``exit_on_2`` exits (status 4, a stderr line)
instead of answering its second request; ``hang_on_2`` never answers its second request."""

import json
import os
import sys
import time


def run(log: str, seconds: float) -> None:
    with open(log, "a") as f:
        f.write(f"start {os.getpid()} {time.monotonic()}\n")
    time.sleep(seconds)
    with open(log, "a") as f:
        f.write(f"end {os.getpid()} {time.monotonic()}\n")


def main() -> None:
    log, seconds = sys.argv[1], float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else None
    if not os.environ.get("TIDAL_AGENT_PERSISTENT"):
        sys.stdin.read()
        run(log, seconds)
        print(json.dumps({"reward": 1.0}))
        return
    for served, _ in enumerate(sys.stdin, 1):
        if served == 2 and mode == "exit_on_2":
            print("scripted agent gives up", file=sys.stderr, flush=True)
            sys.exit(4)
        if served == 2 and mode == "hang_on_2":
            time.sleep(3600)
        run(log, seconds)
        print(json.dumps({"reward": 1.0, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
