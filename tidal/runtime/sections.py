"""The part of a run's config one worker class reads (``Worker.config_sections``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigSections:
    """The named sections of a config object, and nothing else: reading a section the worker
    did not declare fails naming it, so what a worker depends on is written in one place (and
    a rank is not shipped sections it never reads)."""

    def __init__(self, owner: str, config: Any, names: Iterable[str]):
        names = tuple(names)
        unknown = [n for n in names if not hasattr(config, n)]
        if unknown:
            raise AttributeError(
                f"{owner} declares config sections {unknown} that "
                f"{type(config).__name__} does not have"
            )
        # set through __dict__: pickling (ray) and attribute reads never reach __getattr__
        self.__dict__.update({n: getattr(config, n) for n in names})
        self.__dict__["_owner"] = owner

    def _names(self) -> tuple[str, ...]:  # not a property: a section may be called anything
        return tuple(k for k in self.__dict__ if k != "_owner")

    def __getattr__(self, name: str) -> Any:  # only called for what __dict__ lacks
        if name.startswith("__"):  # protocol lookups (pickle, copy) must see a plain miss
            raise AttributeError(name)
        owner = self.__dict__.get("_owner", "this worker")
        raise AttributeError(
            f"{owner} did not declare the config section {name!r} "
            f"(its config_sections: {', '.join(self._names())})"
        )

    def __repr__(self) -> str:
        return f"ConfigSections({self.__dict__.get('_owner')}: {', '.join(self._names())})"
