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


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory=None,
    when: dict[str, tuple[str, ...]] | None = None,
) -> Any:
    """A dataclass field with a one-line help text (``factory`` for mutable defaults).

    ``when``: the key applies only where another key holds one of these values (e.g.
    ``{"algorithm.name": ("sac",)}``); given elsewhere it is refused naming why, and
    ``tidal config`` leaves it out. A root that has no such other key (the other half) takes it.
    """
    meta = {"help": help, "when": when or {}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, help: str = "", when: dict[str, tuple[str, ...]] | None = None) -> Any:
    """A nested config section (a dataclass built with its own defaults); ``when`` as for
    ``setting``."""
    meta = {"help": help or (cls.__doc__ or "").strip(), "when": when or {}}
    return dataclasses.field(default_factory=cls, metadata=meta)


def conditions(cfg_cls: type) -> dict[str, dict[str, tuple[str, ...]]]:
    """``{"section.key": when}`` of every field (nested too) that applies only conditionally."""
    out = {}
    for f in dataclasses.fields(cfg_cls):
        if f.metadata.get("when"):
            out[f.name] = f.metadata["when"]
        kind = _section_type(f)
        if kind is not None:
            out.update({f"{f.name}.{k}": v for k, v in conditions(kind).items()})
    return out


def declared_default(cfg_cls: type, key: str) -> Any:
    """The default a config class declares for dotted ``key`` (a section: its defaults)."""
    name, _, rest = key.partition(".")
    f = next(f for f in dataclasses.fields(cfg_cls) if f.name == name)
    if rest:
        return declared_default(_section_type(f), rest)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def inapplicable(root: Any, when: dict[str, tuple[str, ...]]) -> str | None:
    """Why a field with condition ``when`` does not apply to the config ``root`` (None: it does)."""
    for key, values in when.items():
        try:
            actual = _owner(root, key)
        except AttributeError:  # a half without the key: nothing rules it out
            continue
        if actual not in values:
            return f"applies only with {key}={' | '.join(values)} (got {key}={actual})"
    return None


def field_help(cfg_cls: type) -> dict[str, str]:
    """``{"section.key": help}`` for every field of a config class, nested sections included."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg_cls):
        out[f.name] = f.metadata.get("help", "")
        kind = _section_type(f)
        if kind is not None:
            out.update({f"{f.name}.{k}": v for k, v in field_help(kind).items()})
    return out


HALVES: dict[str, type] = {}  # runner.task -> its root config class (each registers itself)


def half(task: str):
    """Class decorator: the root config of the half ``runner.task: task`` names."""

    def register(cls: type) -> type:
        HALVES[task] = cls
        return cls

    return register


DECIDED = "decided"  # the saved config's section of decided values; the loader skips it


def decide(cfg: Any, key: str, value: Any) -> None:
    """Set ``key`` (written null or auto: tidal decides) on the root config ``cfg`` and record
    the decision apart, so that what is saved and printed keeps what was written and a re-run
    with other keys decides afresh."""
    section, _, name = key.rpartition(".")
    owner = _owner(cfg, section)
    decisions = cfg.__dict__.setdefault("_decided", {})
    written = decisions[key][0] if key in decisions else getattr(owner, name)
    setattr(owner, name, value)
    decisions[key] = (written, value)


def decisions(cfg: Any) -> dict[str, tuple[Any, Any]]:
    """``{key: (written, decided)}`` of the keys tidal decided for this config."""
    return dict(cfg.__dict__.get("_decided", {}))


def written_form(cfg: Any) -> tuple[dict, dict]:
    """The config as a plain mapping with every decided key back at its written value, and the
    decided values by key."""
    tree = dataclasses.asdict(cfg)
    decided = {}
    for key, (written, value) in decisions(cfg).items():
        *path, name = key.split(".")
        node = tree
        for part in path:
            node = node[part]
        node[name] = written
        decided[key] = value
    return tree, decided


def section_keys(cfg_cls: type) -> list[str]:
    """The dotted keys of every nested section (dataclass) of a config class."""
    out = []
    for f in dataclasses.fields(cfg_cls):
        kind = _section_type(f)
        if kind is not None:
            out += [f.name, *(f"{f.name}.{k}" for k in section_keys(kind))]
    return out


def _section_type(f: dataclasses.Field) -> type | None:
    kind = f.type if isinstance(f.type, type) else None
    if kind is None and f.default_factory is not dataclasses.MISSING:
        probe = f.default_factory()
        kind = type(probe) if dataclasses.is_dataclass(probe) else None
    return kind if kind is not None and dataclasses.is_dataclass(kind) else None


def describe(cfg: Any) -> str:
    """The config as YAML with each key's help as a trailing comment, each decided value beside
    its written null/auto, and without the sections that do not apply and hold only defaults:
    valid YAML that loads back to the same config."""
    skip = getattr(cfg, "inapplicable_sections", lambda: ())()
    shown = [f for f in dataclasses.fields(cfg) if f.name not in skip or _changed(cfg, f)]
    return _describe(cfg, shown, decisions(cfg), "", 0, cfg)


def _changed(cfg: Any, f: dataclasses.Field) -> bool:
    return getattr(cfg, f.name) != f.default_factory()


def _describe(cfg: Any, shown, decided: dict, prefix: str, indent: int, root: Any) -> str:
    lines, pad = [], "  " * indent
    for f in shown:
        if inapplicable(root, f.metadata.get("when", {})):
            continue  # at its default: a key that applies elsewhere is refused when given
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        help_text = " ".join(f.metadata.get("help", "").split())
        if key in decided:
            value = decided[key][0]
            help_text = f"decided: {yaml_value(decided[key][1])}; {help_text}"
        comment = f"  # {help_text}" if help_text else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:{comment}")
            fields = dataclasses.fields(value)
            lines.append(_describe(value, fields, decided, f"{key}.", indent + 1, root))
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
        for key, (written, _) in decisions(cfg).items():  # the declared default, not a decision
            owner, _, name = key.rpartition(".")
            setattr(_owner(cfg, owner), name, written)
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if not dataclasses.is_dataclass(value):
                raise TypeError(f"{cfg_cls.__name__}.{f.name}: top-level keys must be sections")
            out += [f"### `{f.name}`", "", " ".join(f.metadata.get("help", "").split()), ""]
            out += ["| key | type | default | help |", "| --- | --- | --- | --- |"]
            out += _markdown_rows(value, f"{f.name}.")
            out.append("")
    return "\n".join(out)


def _owner(cfg: Any, section: str) -> Any:
    """The object at dotted ``section`` of ``cfg`` (a section, or a key's value)."""
    for part in filter(None, section.split(".")):
        cfg = getattr(cfg, part)
    return cfg


def _markdown_rows(cfg: Any, prefix: str) -> list[str]:
    rows = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = "(section)" if dataclasses.is_dataclass(value) else f"`{yaml_value(value)}`"
        only = "; ".join(f"{k}={' | '.join(v)}" for k, v in f.metadata.get("when", {}).items())
        help_text = f.metadata.get("help", "") + (f" (only with {only})" if only else "")
        cells = [f"`{key}`", f"`{kind}`", default, help_text]
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
