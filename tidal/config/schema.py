"""The vocabulary of a config: fields with a one-line help, keys that moved, the printed form.

Every config field is declared with ``setting(default, "help")`` so ``tidal config FILE``
can print the resolved config with a comment per key, and a test can check that no field
lacks one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import yaml


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory=None) -> Any:
    """A dataclass field with a one-line help text (``factory`` for mutable defaults)."""
    meta = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, help: str = "") -> Any:
    """A nested config section (a dataclass built with its own defaults)."""
    return dataclasses.field(
        default_factory=cls, metadata={"help": help or (cls.__doc__ or "").strip()}
    )


def field_help(cfg_cls: type) -> dict[str, str]:
    """``{"section.key": help}`` for every field of a config class, nested sections included."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg_cls):
        out[f.name] = f.metadata.get("help", "")
        kind = f.type if isinstance(f.type, type) else None
        if kind is None and f.default_factory is not dataclasses.MISSING:
            probe = f.default_factory()
            kind = type(probe) if dataclasses.is_dataclass(probe) else None
        if kind is not None and dataclasses.is_dataclass(kind):
            out.update({f"{f.name}.{k}": v for k, v in field_help(kind).items()})
    return out


def describe(cfg: Any, indent: int = 0) -> str:
    """The config as YAML with each key's help as a trailing comment."""
    lines = []
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        value, help_text = getattr(cfg, f.name), f.metadata.get("help", "")
        comment = f"  # {help_text}" if help_text else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:{comment}")
            lines.append(describe(value, indent + 1))
        else:
            rendered = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
            rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {rendered}{comment}")
    return "\n".join(lines)


def flat_keys(data: Mapping, prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        full = f"{prefix}{key}"
        yield full
        if isinstance(value, Mapping):
            yield from flat_keys(value, f"{full}.")
