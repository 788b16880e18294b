"""``channel``: the state dict through a channel, pickled once (on ray, ZeroMQ straight into
each receiver's process when the channel is bound to them). Host tensors on the wire."""

from __future__ import annotations

from tidal.runtime.weight_sync.base import WEIGHT_TRANSPORTS, LinkSpec, WeightTransport
from tidal.runtime.weights import WeightsUpdate, async_recv_weights, recv_weights, send_weights


@WEIGHT_TRANSPORTS.register("channel")
class ChannelTransport(WeightTransport):
    name = "channel"
    blocking = False  # an async get: the event loop keeps serving meanwhile

    @classmethod
    def make_spec(cls, spec: LinkSpec, cluster, receivers) -> LinkSpec:
        if "channel" not in spec.options:
            from tidal.runtime.channel import Channel

            spec.options["channel"] = Channel.create(spec.name, cluster, consumer=receivers)
            spec.options["own_channel"] = True
        return spec

    @classmethod
    def release(cls, spec: LinkSpec) -> None:
        if spec.options.get("own_channel"):
            spec.options["channel"].close()

    @property
    def channel(self):
        return self.spec.options["channel"]

    def send(self, tensors, version: int, snapshot: bool = False) -> None:
        state = {k: v.detach().clone() if snapshot else v for k, v in tensors}
        send_weights(self.channel, state, version, self.spec.receivers, timeout=self.spec.timeout_s)

    def recv(self) -> WeightsUpdate:
        return recv_weights(self.channel, self.rank, timeout=self.spec.timeout_s)

    async def arecv(self, run_blocking) -> WeightsUpdate:
        return await async_recv_weights(self.channel, self.rank, timeout=self.spec.timeout_s)
