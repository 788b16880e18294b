"""Runtime backends, registered by name: ``local`` (threads of this process) and ``ray``."""

from tidal.runtime.backends import local, ray  # noqa: F401  (importing registers them)
from tidal.runtime.backends.base import (
    Backend,
    BackendOptions,
    ChannelTransport,
    RankHandle,
    backend_class,
    backend_names,
    register_backend,
)

__all__ = [
    "Backend",
    "BackendOptions",
    "ChannelTransport",
    "RankHandle",
    "backend_class",
    "backend_names",
    "register_backend",
]
