"""Loading a structured config from YAML files and ``key.sub=value`` overrides, with clear errors.

Files merge left to right (a later file's keys win; a preset is a partial file), then the
overrides. Every mistake is a ``ConfigError`` whose message starts with the full key (or the
file and line) and says how to fix it: unknown keys (with what tidal calls a name another
framework uses), moved keys, wrong types, Hydra's override spellings.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tidal.config.aliases import alias_hint
from tidal.config.schema import (
    DECIDED,
    HALVES,
    conditions,
    declared_default,
    field_help,
    inapplicable,
    section_keys,
    written_form,
)

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value breaks a rule; the message starts with the full key."""


def require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as a mapping, or a ``ConfigError`` naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        hint = "YAML indents with spaces, not tabs" if "\t" in text else "check the indentation"
        raise ConfigError(f"{where}: not valid YAML: {problem}; {hint}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections at the top level "
            f"(e.g. 'runner:'), got {type(data).__name__}"
        )
    return data


def config_paths(path: str | Path | Iterable[str | Path] | None) -> list[Path]:
    if path is None:
        return []
    if isinstance(path, (str, Path)):
        return [Path(path)]
    return [Path(p) for p in path]


def flat_items(data: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """``(dotted key, value)`` of every key of a nested mapping, sections included."""
    for key, value in data.items():
        yield f"{prefix}{key}", value
        if isinstance(value, dict):
            yield from flat_items(value, f"{prefix}{key}.")


def override_value(overrides: list[str] | None, key: str) -> str | None:
    """The value a ``key=value`` override sets (the last one wins), or None."""
    found = None
    for item in overrides or []:
        name, _, value = item.partition("=")
        if name.strip() == key:
            found = value.strip()
    return found


def file_value(paths, key: str) -> Any:
    """The value the files set for ``section.key`` (the last file that sets it), or None."""
    found = None
    section, _, name = key.partition(".")
    for path in config_paths(paths):
        value = (read_yaml(path).get(section) or {}).get(name)
        found = value if value is not None else found
    return found


def load_config(
    schema: type[T],
    path: str | Path | Iterable[str | Path] | None = None,
    overrides: list[str] | None = None,
) -> T:
    """Defaults of ``schema`` ← each YAML file, left to right ← the overrides, type-checked,
    as a dataclass. A file's ``decided:`` section (what a run decided for null/auto keys, in
    its saved config.yaml) is not read: those keys are decided afresh."""
    keys = field_help(schema)
    moved = getattr(schema, "MOVED_KEYS", {})
    layers, given = [OmegaConf.structured(schema)], []
    for file in config_paths(path):
        data = read_yaml(file)
        data.pop(DECIDED, None)
        _check_keys(flat_items(data), schema, moved, f"{file}: ")
        given += [(key, str(file)) for key, _ in flat_items(data)]
        layers.append(_guarded(lambda data=data: OmegaConf.create(data), keys, f"{file}: "))
    overrides = list(overrides or [])
    for item in overrides:
        check_override_spelling(item)
    pairs = (tuple(part.strip() for part in i.partition("=")[::2]) for i in overrides)
    _check_keys(pairs, schema, moved, "override ")
    given += [(item.partition("=")[0].strip(), "") for item in overrides]
    if overrides:
        layers.append(_guarded(lambda: OmegaConf.from_dotlist(overrides), keys, "override "))
    merged = _guarded(lambda: OmegaConf.merge(*layers), keys)
    cfg = _guarded(lambda: OmegaConf.to_object(merged), keys)
    _check_applies(cfg, schema, given)
    return cfg


def _check_applies(cfg, schema: type, given: list[tuple[str, str]]) -> None:
    """A key given (or a section given) that does not apply to this config (e.g.
    ``algorithm.tau`` with ``algorithm.name: ppo``) is refused naming why, unless it holds its
    default (a printed or saved config lists every key)."""
    when = conditions(schema)
    named = {}  # the values each deciding key is known to take (another: preflight names it)
    for rule in when.values():
        for decider, values in rule.items():
            named.setdefault(decider, set()).update(values)
    for decider, values in named.items():
        try:
            if schema_value(cfg, decider) not in values:
                return  # an unknown value: preflight names it, not the keys it would rule out
        except AttributeError:  # a half without the deciding key
            continue
    for key, where in given:
        parts = key.split(".")
        for ruled in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
            why = inapplicable(cfg, when.get(ruled, {}))
            if why is not None and schema_value(cfg, ruled) != declared_default(schema, ruled):
                source = f" (in {where})" if where else ""
                raise ConfigError(f"{key}: {why}{source}; remove it")


def check_override_spelling(item: str) -> None:
    """``key.sub=value``; Hydra's ``+key=``, ``++key=``, ``~key`` and argparse's ``--key=v`` get
    told how tidal spells them."""
    name, eq, value = item.partition("=")
    bare = name.lstrip("+~-").strip()
    spelled = f"{bare}={value or 'VALUE'}"
    if name.startswith("~"):
        raise ConfigError(
            f"override {item!r}: tidal removes no keys; give it null ({bare}=null) or its "
            "default, or leave it out of the file"
        )
    if name.startswith("+"):
        raise ConfigError(
            f"override {item!r}: tidal spells an override key.sub=value, without '+' (every "
            f"key exists in the schema): {spelled}"
        )
    if name.startswith("-"):
        raise ConfigError(
            f"override {item!r}: tidal spells an override key.sub=value, without dashes: {spelled}"
        )
    if not eq:
        raise ConfigError(f"override {item!r}: expected key.sub=value, e.g. {spelled}")


def _check_keys(given: Iterable[tuple[str, Any]], schema, moved: dict[str, str], where: str):
    """Each ``(key, value)`` names a key of the schema (or one that moved), and a section is
    given a mapping of its keys."""
    known, sections = field_help(schema), set(section_keys(schema))
    for key, value in given:
        if key in sections and value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"{key}: is a section, not a value (got {value!r}); set its keys, e.g. "
                f"{key}.{next(k for k in known if k.startswith(key + '.')).rpartition('.')[2]}=..."
            )
        if key in moved:
            raise ConfigError(f"{key}: this key moved; use {moved[key]} ({where.strip()})")
        if key not in known and key.rpartition(".")[0] in {"", *sections}:
            _unknown_key(key, known, where)


def _unknown_key(key: str, known: dict[str, str], where: str = ""):
    section, _, name = key.rpartition(".")
    hint = alias_hint(key, known) or _other_half_hint(key, known)
    if hint is None:
        siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(name, siblings, n=3, cutoff=0.6)
        hint = (
            f"did you mean {' or '.join(f'{section}.{c}'.lstrip('.') for c in close)}?"
            if close
            else f"{section or 'the top level'} has: {', '.join(siblings)}"
        )
    place = where.strip().rstrip(":")
    source = f" (in {place})" if place not in ("", "override") else ""
    raise ConfigError(f"{key}: no such key{source}; {hint}")


def _other_half_hint(key: str, known: dict[str, str]) -> str | None:
    """Where ``key`` is a key of the other half: which half, and how a config picks it."""
    for task, root in HALVES.items():
        keys = field_help(root)
        if key in keys and keys.keys() != known.keys():
            return f"it is a key of the {task} half: set runner.task: {task} (or drop the key)"
    return None


def _guarded(fn, known: dict[str, str], where: str = ""):
    try:
        return fn()
    except OmegaConfBaseException as exc:
        raise ConfigError(explain(exc, known, where)) from None


def explain(exc: OmegaConfBaseException, known: dict[str, str], where: str = "") -> str:
    """OmegaConf's error as tidal's: the key, the rule, the value, the fix."""
    key = getattr(exc, "full_key", None) or ""
    message = str(exc).splitlines()[0]
    value = getattr(exc, "value", None)
    got = f" (got {value!r})" if value is not None else ""
    if "not in" in message and message.startswith("Key"):
        try:
            _unknown_key(key, known, where)
        except ConfigError as error:
            return str(error)
    if "ListConfig" in message:
        return f"{key}: expects a list{got}; use [a,b] (e.g. {key}=[{value or 'a'}])"
    if "valid bool" in message:
        return f"{key}: expects true or false{got}"
    if "could not be converted to" in message:
        kind = message.rsplit(" ", 1)[-1].lower()
        kind = {"float": "a number", "integer": "a whole number"}.get(kind, f"a {kind}")
        return f"{key}: expects {kind}{got}"
    if "is not Optional" in message and ":" in key:  # YAML's {a:b} is the key "a:b", no value
        section = key[: key.index(":")].rpartition(".")[0]
        name, _, rest = key[len(section) + 1 :].partition(":")
        return (
            f"{section}: YAML reads {name + ':' + rest!r} as one key without a value; in a "
            f"mapping a colon needs a space after it ({{{name}: {rest}}})"
        )
    if "Incompatible value 'None'" in message or "is not Optional" in message:
        return f"{key}: cannot be null (got an empty value); give it a value, e.g. {key}=1"
    if "Dict[" in message or "is not a subclass of" in message or "DictConfig" in message:
        what = "a section" if "subclass" in message else "a mapping"
        key = key or _merge_key(message, known)
        return f"{key}: expects {what}{got}; write {{name: value, ...}} (e.g. {key}={{a: '0'}})"
    return f"{key or 'config'}: {message}"


def _merge_key(message: str, known: dict[str, str]) -> str:
    match = re.search(r"subclass of (\w+)", message)
    return match.group(1) if match else "config"


def schema_value(cfg: Any, key: str) -> Any:
    """The value at dotted ``key`` (an AttributeError where the config has no such key)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def to_yaml(cfg: Any) -> str:
    """The config as a run saves it: what was written (null/auto kept), then a ``decided:``
    section with what the run decided for those keys (the loader does not read it back)."""
    written, decided = written_form(cfg)
    text = OmegaConf.to_yaml(OmegaConf.create(written))
    if decided:
        text += f"# what tidal decided for the null/auto keys above (not read back: a re-run decides afresh)\n{DECIDED}:\n"
        text += "".join(f"  {k}: {yaml_scalar(v)}\n" for k, v in decided.items())
    return text


def yaml_scalar(value: Any) -> str:
    rendered = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return rendered.removesuffix("\n...").removesuffix("...").strip()
