"""The runtime: clusters, placement, worker groups, handles, channels and routing.

It knows nothing of RL. Two backends behind one API: ``local`` (threads of this process)
and ``ray`` (Ray actors on many nodes). Each name is imported on first use, so a module that
needs one piece (a config asking ``tidal.runtime.backends`` for a backend) loads no torch.
"""

import importlib

_EXPORTS = {
    "tidal.runtime.backends": ("Backend", "ChannelTransport", "backend_names", "register_backend"),
    "tidal.runtime.batch": ("batch_size", "merge_batches", "split_batch"),
    "tidal.runtime.channel": ("AsyncWork", "Channel"),
    "tidal.runtime.cluster": ("Cluster",),
    "tidal.runtime.comm": ("CommMapper", "Outbox", "async_recv_batch", "recv_batch", "send_batch"),
    "tidal.runtime.defaults": ("DEFAULT_TIMEOUT_S",),
    "tidal.runtime.errors": (
        "ChannelTimeoutError",
        "PlacementError",
        "WeightSyncError",
        "WorkerError",
        "WorkerTimeoutError",
    ),
    "tidal.runtime.handle": ("Handle", "wait_all", "wait_any"),
    "tidal.runtime.placement": ("ComponentPlacement", "parse_devices"),
    "tidal.runtime.sections": ("ConfigSections",),
    "tidal.runtime.weights": (
        "WeightsUpdate",
        "async_recv_weights",
        "recv_weights",
        "send_weights",
    ),
    "tidal.runtime.worker": ("Worker", "WorkerGroup"),
}
_HOMES = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(home), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
