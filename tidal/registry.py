"""Name → factory registries: envs, policies, reward models and advantage estimators all plug
in by registering a name, never by editing an ``if`` chain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str | None = None):
        self.kind, self.config_key = kind, config_key
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            prefix = f"{self.config_key}: " if self.config_key else ""
            raise ValueError(
                f"{prefix}unknown {self.kind} {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)
