"""Loading a structured config from YAML and ``key.sub=value`` overrides, with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tidal.config.schema import flat_keys

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value breaks a rule; the message starts with the full key."""


def require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as a mapping, or a ``ConfigError`` saying what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        hint = " (YAML indents with spaces, not tabs)" if "\t" in text else ""
        first = str(exc).replace("\n", " ")
        raise ConfigError(f"{path}: not valid YAML{hint}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}"
        )
    return data


def override_value(overrides: list[str] | None, key: str) -> str | None:
    """The value a ``key=value`` override sets, or None."""
    for item in overrides or []:
        name, _, value = item.partition("=")
        if name.strip() == key:
            return value.strip()
    return None


def load_config(
    schema: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    """Defaults of ``schema`` ← the YAML file ← the overrides, type-checked, as a dataclass."""
    layers = [OmegaConf.structured(schema)]
    moved = getattr(schema, "MOVED_KEYS", {})
    if path is not None:
        data = read_yaml(path)
        _check_moved(moved, flat_keys(data), f"{path}: ")
        layers.append(_guarded(lambda: OmegaConf.create(data)))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
    _check_moved(moved, (item.partition("=")[0].strip() for item in overrides or []), "override ")
    if overrides:
        layers.append(_guarded(lambda: OmegaConf.from_dotlist(list(overrides))))
    merged = _guarded(lambda: OmegaConf.merge(*layers))
    return _guarded(lambda: OmegaConf.to_object(merged))


def _check_moved(moved: dict[str, str], keys, where: str) -> None:
    for key in keys:
        if key in moved:
            raise ConfigError(f"{key}: this key moved; use {moved[key]} ({where.strip()})")


def _guarded(fn):
    try:
        return fn()
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        message = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {message}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
