"""The configured env's spaces and time limit, from one instance made to look (a config error
when it cannot be made); within ``probed_once`` an env section is made only once."""

from __future__ import annotations

import contextlib
import dataclasses
import json

from tidal.config import ConfigError
from tidal.config.embodied import EnvConfig
from tidal.envs import env_make_kwargs, make_env
from tidal.extras import MissingExtraError

_probed: dict[str, tuple] | None = None  # env section -> (spaces, time limit), within probed_once


@contextlib.contextmanager
def probed_once():
    """Within it an env section's env is made once (``tidal train`` checks before building the
    runner, which checks again; a restart builds it anew); elsewhere every probe makes one."""
    global _probed
    outer, _probed = _probed, {}
    try:
        yield
    finally:
        _probed = outer


def env_spaces(env: EnvConfig):
    """The spaces and time limit of the ``env`` section's env, from one instance made here; an
    env that cannot be made is a config error naming env.id (or env.kwargs)."""
    if _probed is None:
        return _made_env_spaces(env)
    key = json.dumps(dataclasses.asdict(env), sort_keys=True, default=repr)
    if key not in _probed:
        _probed[key] = _made_env_spaces(env)
    return _probed[key]


def _made_env_spaces(env: EnvConfig):
    try:
        probe = make_env(env.adapter, 1, **{**env_make_kwargs(env), "vectorization_mode": "sync"})
    except MissingExtraError as exc:
        raise ConfigError(
            f"env.id: cannot make {env.id!r} with the {env.adapter} adapter: {exc}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - gymnasium raises many kinds for a bad id or kwarg
        key = "env.kwargs" if isinstance(exc, TypeError) and env.kwargs else "env.id"
        raise ConfigError(
            f"{key}: cannot make {env.id!r} with kwargs {dict(env.kwargs)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    try:
        return (probe.observation_space, probe.action_space), probe.max_episode_steps
    finally:
        probe.close()
