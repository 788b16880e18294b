"""Optional dependencies. ``pip install tidal`` is the core: the runtime with its local backend,
the algorithms, the config, gymnasium's classic-control envs, checkpoints and ``metrics.jsonl``.
The rest comes in the extras of ``pyproject.toml`` (``ray``, ``embodied``, ``llm``, ``trackers``,
``agents``, ``all``).

Code that uses an extra imports it inside ``needs_extra``, so that a missing package fails
naming the extra that brings it; config checks ask ``missing_extra`` first (nothing is imported)
so that the error names the config key as well.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager


class MissingExtraError(ModuleNotFoundError):
    """A feature's package is not installed; the message names the extra that installs it."""


def _message(extra: str, feature: str, package: str) -> str:
    return (
        f"{feature} needs the {extra!r} extra ({package} is not installed): "
        f"pip install 'tidal[{extra}]'"
    )


@contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """``with needs_extra("ray", "the ray backend"): import ray``: a package missing inside the
    block raises ``MissingExtraError`` naming ``feature`` and ``extra``."""
    try:
        yield
    except MissingExtraError:
        raise  # already names its extra (a nested block)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "tidal":
            raise  # not a missing package but a bug of tidal's own
        raise MissingExtraError(_message(extra, feature, exc.name), name=exc.name) from exc


def installed(package: str) -> bool:
    """Whether ``package`` (a top-level import name) can be imported; imports nothing."""
    return importlib.util.find_spec(package) is not None


def missing_extra(extra: str, feature: str, *packages: str) -> str | None:
    """Why ``feature`` cannot run (the first of ``packages``, top-level import names, that is not
    installed, and the extra to install), or None when all are there. Imports nothing."""
    for package in packages:
        if not installed(package):
            return _message(extra, feature, package)
    return None
