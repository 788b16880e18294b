"""Weight transports (rollout.weight_sync): every transport moves the weights with their version;
a refused update changes nothing and names the tensor; failures are named, never a hang."""

import time

import pytest
import torch

from tidal.runtime import Cluster, Worker, WorkerError
from tidal.runtime.weight_sync import WeightLinks, load_checked, open_weight_link


class Holder(Worker, WeightLinks):
    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))

    def send(self, link, version: int, bad: str | None = None) -> int:
        tensors = dict(self.model.state_dict())
        if bad == "extra":
            tensors["2.weight"] = torch.zeros(1)
        elif bad == "shape":
            tensors["1.bias"] = torch.zeros(4)
        elif bad == "dtype":
            tensors["1.bias"] = torch.zeros(3, dtype=torch.int64)
        elif bad == "nan":
            tensors["0.bias"] = torch.full((16,), float("nan"))
        elif bad == "missing":
            del tensors["0.weight"]
        self.weight_end(link, "send").send(tensors.items(), version)
        return version

    def send_failing(self, link) -> None:
        def tensors():
            yield "0.weight", self.model[0].weight
            raise RuntimeError("the gather of 0.bias failed")

        self.weight_end(link, "send").send(tensors(), 3)

    def receive(self, link) -> tuple[int, str]:
        end = self.weight_end(link, "recv")
        update = end.recv()
        load_checked(self.model, update.state_dict, adopt=update.owned)
        if update.owned:  # the collective's staged tensors are the model's weights now
            end.adopted()
        return update.version, str(next(iter(update.state_dict.values())).dtype)

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def link_end(self, link, role: str) -> tuple[str, str]:
        """The backend this rank's end of a collective link chose, and its device's type."""
        end = self.weight_end(link, role)
        return end.backend, end.device.type

    def close_links(self) -> None:
        self.close_weight_links()


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    c = Cluster("local", devices_per_node=4)
    sender = Holder.create_group(0).launch(c, 1, name="actor")
    receivers = Holder.create_group(1).launch(c, 2, name="rollout")
    yield c, sender, receivers, tmp_path_factory.mktemp("weights")
    c.shutdown()


def _open(groups, transport, **options):
    c, sender, receivers, folder = groups
    if transport == "disk":
        options["folder"] = str(folder)
    return open_weight_link(transport, c, sender, receivers, "test", timeout_s=5, **options)


def _sync(groups, link, version=1, bad=None):
    _, sender, receivers, _ = groups
    sent = sender.send(link, version, bad)
    got = receivers.receive(link)
    sent.wait(10)
    return got.wait(10)


@pytest.mark.parametrize("transport", ["channel", "collective", "disk"])
def test_every_transport_moves_the_weights_with_their_version(groups, transport):
    _, sender, receivers, _ = groups
    link = _open(groups, transport, bucket_mb=0.0005)  # 512 bytes: several buckets
    assert _sync(groups, link, version=4) == [(4, "torch.float32")] * 2
    want = sender.weights().wait(5)[0]
    for got in receivers.weights().wait(5):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_collective_sends_in_the_rollout_dtype(groups):
    link = _open(groups, "collective", dtype="bfloat16")
    assert _sync(groups, link, version=2) == [(2, "torch.bfloat16")] * 2


@pytest.mark.parametrize(
    "bad, named",
    [
        ("extra", "unexpected keys ['2.weight']"),
        ("missing", "missing keys ['0.weight']"),
        ("shape", "1.bias has shape [4], the model expects [3]"),
        ("dtype", "1.bias has dtype torch.int64"),
        ("nan", "0.bias holds non-finite values"),
    ],
)
def test_a_refused_collective_update_changes_nothing_and_names_the_tensor(groups, bad, named):
    _, sender, receivers, _ = groups
    link = _open(groups, "collective", bucket_mb=0.0005)
    assert _sync(groups, link, version=4) == [(4, "torch.float32")] * 2  # adopted: now live
    before = receivers.weights().wait(5)
    with pytest.raises(WorkerError, match=named.replace("[", r"\[").replace("]", r"\]")):
        _sync(groups, link, version=5, bad=bad)
    after = receivers.weights().wait(5)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
    assert _sync(groups, link, version=6) == [(6, "torch.float32")] * 2  # the link still works


def test_a_sender_failing_mid_update_stops_the_receivers_at_once_naming_it(groups):
    _, sender, receivers, _ = groups
    link = _open(groups, "collective")
    failing, got = sender.send_failing(link), receivers.receive(link)
    with pytest.raises(
        WorkerError, match="the sender aborted the update: RuntimeError: the gather"
    ):
        got.wait(10)
    with pytest.raises(WorkerError, match="the gather of 0.bias failed"):
        failing.wait(10)


def test_a_silent_sender_and_a_gone_receiver_are_named_errors_within_the_timeout(groups):
    c, sender, receivers, _ = groups
    link = open_weight_link("collective", c, sender, receivers, "test", timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"weight link test-\w+ \(collective\): receiver rank \d"):
        receivers.receive(link).wait(10)  # nobody sends
    assert time.monotonic() - start < 5
    link = open_weight_link("collective", c, sender, receivers, "test", timeout_s=1.5)
    receivers.close_links().wait(5)  # both receivers leave the group
    with pytest.raises(WorkerError, match=r"sender: broadcast of the header of bucket 0"):
        sender.send(link, 1).wait(10)


def test_a_group_whose_receivers_never_join_fails_naming_the_rendezvous(groups):
    c, sender, _, _ = groups
    from tidal.runtime.weight_sync import LinkSpec

    spec = sender.host_weight_link(LinkSpec("collective", "lonely", 2, timeout_s=1.0)).wait(5)[0]
    with pytest.raises(WorkerError, match="weight link lonely .*sender: joining the group of 3"):
        sender.join_weight_link(spec, "send").wait(10)
