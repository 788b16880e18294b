"""The weight-link interface, its registry and the driver's ``open_weight_link``."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tidal.registry import Registry
from tidal.runtime.errors import WeightSyncError
from tidal.runtime.handle import wait_all
from tidal.runtime.weights import WeightsUpdate

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class LinkSpec:
    """What every end of one link needs (pickled to each rank): the transport, a name unique to
    the run (a restart opens a new one), the receivers and the transport's own options."""

    transport: str
    name: str
    receivers: int
    timeout_s: float = 600.0
    options: dict[str, Any] = field(default_factory=dict)


class WeightTransport:
    """One end of a link. ``role`` is ``send`` (the trainer's rank 0) or ``recv``; ``rank`` is
    the receiver's rank (0 for the sender)."""

    name: ClassVar[str]
    blocking: ClassVar[bool] = True  # recv blocks its thread (run it off a shared event loop)

    def __init__(self, spec: LinkSpec, role: str, rank: int):
        self.spec, self.role, self.rank = spec, role, rank

    @classmethod
    def make_spec(cls, spec: LinkSpec, cluster, receivers) -> LinkSpec:
        """Driver side, before any end exists (e.g. create the channel the link uses)."""
        return spec

    @classmethod
    def host(cls, spec: LinkSpec) -> LinkSpec:
        """On the sending rank, before the ends connect (e.g. the rendezvous address)."""
        return spec

    @classmethod
    def release(cls, spec: LinkSpec) -> None:
        """Driver side, when the run closes: what ``make_spec`` made."""

    def send(self, tensors: NamedTensors, version: int, snapshot: bool = False) -> None:
        """``snapshot``: the caller changes the weights in place later while the update may
        still wait to be read (asynchronous runs): copy what is not sent at once."""
        raise NotImplementedError

    def recv(self) -> WeightsUpdate:
        raise NotImplementedError

    def adopted(self) -> None:
        """The receiver loaded the last update by adopting its tensors (``WeightsUpdate.owned``):
        they are its weights now, and the next update must not be written into them."""

    async def arecv(self, run_blocking) -> WeightsUpdate:
        """``recv`` from a coroutine; ``run_blocking(fn)`` runs it on the rank's compute thread."""
        return await run_blocking(self.recv)

    def close(self) -> None:
        pass

    def error(self, call: str, exc: BaseException | str, kind=WeightSyncError) -> RuntimeError:
        who = "sender" if self.role == "send" else f"receiver rank {self.rank}"
        return kind(f"weight link {self.spec.name} ({self.name}): {who}: {call} failed: {exc}")


WEIGHT_TRANSPORTS: Registry[type[WeightTransport]] = Registry(
    "weight transport", "rollout.weight_sync"
)


class WeightLinks:
    """Mixed into a worker: the ends of the links it takes part in, made on first use."""

    def weight_end(
        self, link, role: str, receivers: int = 0, timeout_s: float = 600.0
    ) -> WeightTransport:
        """This rank's end of ``link`` (a ``LinkSpec``, or a bare channel: the channel
        transport over it, to ``receivers`` ranks)."""
        from tidal.runtime.channel import Channel

        if isinstance(link, Channel):
            link = LinkSpec("channel", link.name, receivers, timeout_s, {"channel": link})
        ends = self.__dict__.setdefault("_weight_ends", {})
        key = (link.name, role)
        if key not in ends:
            rank = 0 if role == "send" else self.rank
            ends[key] = WEIGHT_TRANSPORTS.get(link.transport)(link, role, rank)
        return ends[key]

    def host_weight_link(self, link: LinkSpec) -> LinkSpec:
        return WEIGHT_TRANSPORTS.get(link.transport).host(link)

    def join_weight_link(self, link: LinkSpec, role: str) -> str:
        """Make this rank's end now (a collective's ends meet here: all at once)."""
        return type(self.weight_end(link, role)).__name__

    def close_weight_links(self) -> None:
        for end in self.__dict__.pop("_weight_ends", {}).values():
            end.close()


def open_weight_link(
    transport: str,
    cluster,
    sender,
    receivers,
    prefix: str,
    timeout_s: float = 600.0,
    **options,
) -> LinkSpec:
    """Open a link from ``sender`` (a one-rank view of the trainer group) to every rank of
    ``receivers`` (worker groups of ``WeightLinks`` workers); returns the spec their send and
    receive calls take."""
    cls = WEIGHT_TRANSPORTS.get(transport)
    spec = LinkSpec(transport, f"{prefix}-{uuid.uuid4().hex[:6]}", receivers.world_size, timeout_s)
    spec.options.update(options)
    spec = cls.make_spec(spec, cluster, receivers)
    spec = sender.host_weight_link(spec).wait(timeout_s)[0]
    wait_all(
        [sender.join_weight_link(spec, "send"), receivers.join_weight_link(spec, "recv")],
        timeout_s,
    )
    return spec
