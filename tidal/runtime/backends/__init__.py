"""Runtime backends, registered by name: ``local`` (threads of this process) and ``ray``.

Each is imported when ``backend_class`` first asks for it, so naming one (a config) costs
nothing."""

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
