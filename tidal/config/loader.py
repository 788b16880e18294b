"""Loading a structured config from YAML and ``key.sub=value`` overrides, with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value breaks a rule; the message starts with the full key."""


def require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults of ``schema`` ← the YAML file ← the overrides, type-checked, as a dataclass."""
    layers = [OmegaConf.structured(schema)]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        layers.append(_guarded(lambda: OmegaConf.create(data)))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
    if overrides:
        layers.append(_guarded(lambda: OmegaConf.from_dotlist(list(overrides))))
    merged = _guarded(lambda: OmegaConf.merge(*layers))
    return _guarded(lambda: OmegaConf.to_object(merged))


def _guarded(fn):
    try:
        return fn()
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        message = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {message}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
