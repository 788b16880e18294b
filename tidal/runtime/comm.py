"""Redistributing a batch between worker groups of different sizes.

A global batch is laid out in contiguous blocks: source rank s holds items
``[s * B/S, (s + 1) * B/S)``, destination rank d receives ``[d * B/D, (d + 1) * B/D)``.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import lru_cache
from typing import Any

from tidal.runtime.batch import batch_size, merge_batches, split_batch
from tidal.runtime.channel import Channel
from tidal.runtime.routekey import RouteKey


def _blocks_overlapping(begin: int, end: int, block: int) -> list[tuple[int, int]]:
    """``[(block index, items), ...]`` covering ``[begin, end)`` with blocks of size ``block``."""
    out = []
    while begin < end:
        index = begin // block
        size = min((index + 1) * block, end) - begin
        out.append((index, size))
        begin += size
    return out


class CommMapper:
    @staticmethod
    def _check(batch_size: int, src_world_size: int, dst_world_size: int) -> None:
        for what, world in (("source", src_world_size), ("destination", dst_world_size)):
            if world < 1:
                raise ValueError(f"the {what} group size must be >= 1, got {world}")
            if batch_size % world != 0:
                raise ValueError(
                    f"batch size {batch_size} is not divisible by the {what} group size {world}"
                )

    @staticmethod
    def get_dst_ranks(
        batch_size: int, src_world_size: int, dst_world_size: int, src_rank: int
    ) -> list[tuple[int, int]]:
        """``[(dst_rank, size), ...]`` for the block held by ``src_rank``, in batch order."""
        CommMapper._check(batch_size, src_world_size, dst_world_size)
        if not 0 <= src_rank < src_world_size:
            raise ValueError(f"src_rank {src_rank} is out of range 0-{src_world_size - 1}")
        per_src, per_dst = batch_size // src_world_size, batch_size // dst_world_size
        return _blocks_overlapping(src_rank * per_src, (src_rank + 1) * per_src, per_dst)

    @staticmethod
    def get_src_ranks(
        batch_size: int, src_world_size: int, dst_world_size: int, dst_rank: int
    ) -> list[tuple[int, int]]:
        """``[(src_rank, size), ...]`` that together make up ``dst_rank``'s block, in batch order."""
        CommMapper._check(batch_size, src_world_size, dst_world_size)
        if not 0 <= dst_rank < dst_world_size:
            raise ValueError(f"dst_rank {dst_rank} is out of range 0-{dst_world_size - 1}")
        per_src, per_dst = batch_size // src_world_size, batch_size // dst_world_size
        return _blocks_overlapping(dst_rank * per_dst, (dst_rank + 1) * per_dst, per_src)

    @staticmethod
    def build_channel_key(src_rank: int, dst_rank: int, extra: Hashable = "") -> RouteKey:
        return RouteKey(src_rank, dst_rank, extra)


def send_batch(
    channel: Channel,
    batch: Any,
    src_rank: int,
    src_world_size: int,
    dst_world_size: int,
    tag: Hashable = "",
    async_op: bool = False,
):
    """Split this source rank's share of a batch by the mapper and put each shard on the key of
    the destination rank it belongs to. Returns the put results (``AsyncWork`` if async)."""
    routes = _outgoing_routes(batch_size(batch), src_rank, src_world_size, dst_world_size, tag)
    shards = [batch] if len(routes) == 1 else split_batch(batch, [size for _, size, _ in routes])
    return [
        channel.put(shard, key=key, async_op=async_op) for (_, _, key), shard in zip(routes, shards)
    ]


# Routes are recomputed for every chunk step of every rank: cache them (a handful per run).
@lru_cache(maxsize=4096)
def _outgoing_routes(local_size: int, src_rank: int, src_world_size: int, dst_world_size: int, tag):
    """``(dst_rank, size, channel key)`` of every shard a source rank sends, in order."""
    return tuple(
        (dst, size, CommMapper.build_channel_key(src_rank, dst, tag))
        for dst, size in CommMapper.get_dst_ranks(
            local_size * src_world_size, src_world_size, dst_world_size, src_rank
        )
    )


@lru_cache(maxsize=4096)
def _incoming_routes(
    global_batch_size: int, src_world_size: int, dst_world_size: int, dst_rank: int, tag
):
    """``(src_rank, size, channel key)`` of every shard a destination rank receives, in order."""
    return tuple(
        (src, size, CommMapper.build_channel_key(src, dst_rank, tag))
        for src, size in CommMapper.get_src_ranks(
            global_batch_size, src_world_size, dst_world_size, dst_rank
        )
    )


def _merge_checked(routes: list, shards: list, dst_rank: int, tag) -> Any:
    """Merge received shards after checking each one's size against its route."""
    for (src, expected, _), shard in zip(routes, shards):
        got = batch_size(shard)
        if got != expected:
            raise ValueError(
                f"route {src}->{dst_rank} ({tag!r}): expected a shard of {expected} items, got {got}"
            )
    return merge_batches(shards)


def recv_batch(
    channel: Channel,
    dst_rank: int,
    src_world_size: int,
    dst_world_size: int,
    global_batch_size: int,
    tag: Hashable = "",
    timeout: float | None = None,
) -> Any:
    """Receive the shards that make up this destination rank's block and merge them."""
    routes = _incoming_routes(global_batch_size, src_world_size, dst_world_size, dst_rank, tag)
    return _merge_checked(
        routes, [channel.get(key=key, timeout=timeout) for _, _, key in routes], dst_rank, tag
    )


async def async_recv_batch(
    channel: Channel,
    dst_rank: int,
    src_world_size: int,
    dst_world_size: int,
    global_batch_size: int,
    tag: Hashable = "",
    timeout: float | None = None,
) -> Any:
    """``recv_batch`` for ``async def`` methods: waits without blocking the rank's event loop."""
    routes = _incoming_routes(global_batch_size, src_world_size, dst_world_size, dst_rank, tag)
    shards = []
    for _, _, key in routes:
        shards.append(await channel.get(key=key, async_op=True, timeout=timeout))
    return _merge_checked(routes, shards, dst_rank, tag)


class Outbox:
    """Sends from ``async`` methods without waiting for each put to be acknowledged (on Ray
    that is a round trip to the channel actor); ``flush`` awaits them, so errors still surface.
    Puts from one sender keep their order."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._pending: list = []

    async def send(
        self,
        channel: Channel,
        batch: Any,
        src_rank: int,
        src_world_size: int,
        dst_world_size: int,
        tag: Hashable = "",
    ) -> None:
        for work in send_batch(
            channel, batch, src_rank, src_world_size, dst_world_size, tag, async_op=True
        ):
            self._track(work)
        if len(self._pending) >= self.limit:
            await self.flush()

    async def put(self, channel: Channel, item: Any, key: Hashable) -> None:
        """One item on one key, routed by the caller."""
        self._track(channel.put(item, key=key, async_op=True))
        if len(self._pending) >= self.limit:
            await self.flush()

    def _track(self, work) -> None:
        if work.done():  # local puts finish at once: surface an error now, keep nothing
            work.wait()
        else:
            self._pending.append(work)

    async def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            await work
