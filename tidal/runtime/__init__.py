"""The runtime: clusters, placement, worker groups, handles, channels and routing.

It knows nothing of RL. Two backends behind one API: ``local`` (threads of this process)
and ``ray`` (Ray actors on many nodes).
"""

from tidal.runtime.backends import Backend, ChannelTransport, backend_names, register_backend
from tidal.runtime.batch import batch_size, merge_batches, split_batch
from tidal.runtime.channel import AsyncWork, Channel
from tidal.runtime.cluster import Cluster
from tidal.runtime.comm import CommMapper, Outbox, async_recv_batch, recv_batch, send_batch
from tidal.runtime.defaults import DEFAULT_TIMEOUT_S
from tidal.runtime.errors import (
    ChannelTimeoutError,
    PlacementError,
    WorkerError,
    WorkerTimeoutError,
)
from tidal.runtime.handle import Handle, wait_all
from tidal.runtime.placement import ComponentPlacement, parse_devices
from tidal.runtime.sections import ConfigSections
from tidal.runtime.weights import WeightsUpdate, async_recv_weights, recv_weights, send_weights
from tidal.runtime.worker import Worker, WorkerGroup

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncWork",
    "Backend",
    "Channel",
    "ChannelTransport",
    "ChannelTimeoutError",
    "Cluster",
    "CommMapper",
    "ComponentPlacement",
    "ConfigSections",
    "Handle",
    "Outbox",
    "PlacementError",
    "WeightsUpdate",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "async_recv_batch",
    "async_recv_weights",
    "backend_names",
    "batch_size",
    "merge_batches",
    "parse_devices",
    "recv_batch",
    "recv_weights",
    "register_backend",
    "send_batch",
    "send_weights",
    "split_batch",
    "wait_all",
]
