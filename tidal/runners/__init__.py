"""The runners, grouped by half: ``tidal.runners.embodied`` and ``tidal.runners.llm``, each with
its ``train``, ``sft`` and ``eval``; beside them what both share: the run loop (``loop``), the run
folder (``run_folder``) and the checks before any worker starts (``preflight``). The embodied
runners share their groups, evaluation and checkpoint state (``embodied.groups``) and the pacer
of asynchronous collection (``embodied.pacer``).

The runner classes are importable from here (``from tidal.runners import EmbodiedRunner``),
imported on first use so that a shared module does not load both halves.
"""

import importlib

_RUNNERS = {
    "EmbodiedRunner": "tidal.runners.embodied.train",
    "LLMRunner": "tidal.runners.llm.train",
}

__all__ = list(_RUNNERS)


def __getattr__(name: str):
    if name in _RUNNERS:
        return getattr(importlib.import_module(_RUNNERS[name]), name)
    raise AttributeError(f"module 'tidal.runners' has no attribute {name!r}")
