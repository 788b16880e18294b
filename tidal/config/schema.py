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
            lines.append(f"{pad}{f.name}: {yaml_value(value)}{comment}")
    return "\n".join(lines)


def yaml_value(value: Any) -> str:
    """A value as one line of YAML, the way a config file would spell it."""
    rendered = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return rendered.removesuffix("\n...").removesuffix("...").strip()


def markdown_reference(halves: Mapping[str, type], header: str = "") -> str:
    """Every key of every half as markdown: a table per section with type, default and help."""
    out = [header.strip(), ""] if header else []
    for half, cfg_cls in halves.items():
        out += [f"## {half} (`runner.task: {half}`)", ""]
        cfg = cfg_cls()
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if not dataclasses.is_dataclass(value):
                raise TypeError(f"{cfg_cls.__name__}.{f.name}: top-level keys must be sections")
            out += [f"### `{f.name}`", "", " ".join(f.metadata.get("help", "").split()), ""]
            out += ["| key | type | default | help |", "| --- | --- | --- | --- |"]
            out += _markdown_rows(value, f"{f.name}.")
            out.append("")
    return "\n".join(out)


def _markdown_rows(cfg: Any, prefix: str) -> list[str]:
    rows = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = "(section)" if dataclasses.is_dataclass(value) else f"`{yaml_value(value)}`"
        cells = [f"`{key}`", f"`{kind}`", default, f.metadata.get("help", "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if dataclasses.is_dataclass(value):
            rows += _markdown_rows(value, f"{key}.")
    return rows


def flat_keys(data: Mapping, prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        full = f"{prefix}{key}"
        yield full
        if isinstance(value, Mapping):
            yield from flat_keys(value, f"{full}.")
