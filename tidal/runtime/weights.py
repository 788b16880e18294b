"""Moving model weights from rank 0 of one group to every rank of another, with a version."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from tidal.runtime.channel import Channel
from tidal.runtime.comm import CommMapper


@dataclass
class WeightsUpdate:
    version: int
    state_dict: dict[str, torch.Tensor]
    # the tensors are the receiver's own (a collective's staging buffers, not reused by the next
    # update): a loader may adopt them in place of copying. Never a channel's: on the local
    # backend those are the sender's tensors.
    owned: bool = False


def send_weights(
    channel: Channel,
    state_dict: dict[str, torch.Tensor],
    version: int,
    dst_world_size: int,
    tag: Hashable = "weights",
    timeout: float | None = None,
) -> None:
    """Pickled once: on ray, sent by ZeroMQ to each receiving rank when the channel is bound to
    them (the tensors' buffers travel without a copy into the pickle), else one object-store
    write; on local, one shared reference. The version travels with the tensors."""
    # a pickled CUDA tensor would need CUDA on the receiving end: the wire carries host tensors
    update = WeightsUpdate(version, {k: v.detach().cpu() for k, v in state_dict.items()})
    keys = [CommMapper.build_channel_key(0, dst, tag) for dst in range(dst_world_size)]
    channel.put_shared(update, keys, timeout=timeout)


def recv_weights(
    channel: Channel, dst_rank: int, tag: Hashable = "weights", timeout: float | None = None
) -> WeightsUpdate:
    """The next update for this rank. Copy the tensors (``load_state_dict`` does) before
    changing them: on the local backend every receiver shares the sender's tensors."""
    return channel.get(key=CommMapper.build_channel_key(0, dst_rank, tag), timeout=timeout)


async def async_recv_weights(
    channel: Channel, dst_rank: int, tag: Hashable = "weights", timeout: float | None = None
) -> WeightsUpdate:
    return await channel.get(
        key=CommMapper.build_channel_key(0, dst_rank, tag), async_op=True, timeout=timeout
    )
