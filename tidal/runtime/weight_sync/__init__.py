"""Weight transports (``rollout.weight_sync``): how a trainer's weights reach the ranks that
generate with them. One module per transport, registered by name:

- ``channel``: the state dict pickled through a channel (on ray, ZeroMQ into each receiver's
  process): simple, fine for small models, and the one an asynchronous embodied run needs (its
  rollout takes a waiting update between chunk steps).
- ``collective``: a ``torch.distributed`` group of its own (its own TCPStore, never the
  trainer's DDP group) between the sending rank and every receiver; NCCL on GPU, gloo on CPU;
  broadcast in buckets of ``rollout.weight_sync_bucket_mb`` in the rollout's dtype.
- ``disk``: a safetensors file the receivers read (for engines that only reload).

A link is opened once per run (and again after a restart) by the driver with
``open_weight_link``; each end is made on its rank by ``WeightLinks.weight_end``. A sender
hands its end an iterator of ``(name, tensor)`` (``weight_tensors``: a sharded trainer yields
gathered tensors one at a time); a receiver gets a ``WeightsUpdate`` to check and load.
"""

from tidal.runtime.errors import WeightSyncError, WeightUpdateAborted
from tidal.runtime.weight_sync import channel, collective, disk  # noqa: F401 (they register)
from tidal.runtime.weight_sync.base import (
    WEIGHT_TRANSPORTS,
    LinkSpec,
    NamedTensors,
    WeightLinks,
    WeightTransport,
    open_weight_link,
)
from tidal.runtime.weight_sync.validation import (
    WeightsRejected,
    check_weights,
    first_non_finite,
    load_checked,
)

__all__ = [
    "WEIGHT_TRANSPORTS",
    "LinkSpec",
    "NamedTensors",
    "WeightLinks",
    "WeightSyncError",
    "WeightTransport",
    "WeightUpdateAborted",
    "WeightsRejected",
    "check_weights",
    "first_non_finite",
    "load_checked",
    "open_weight_link",
]
