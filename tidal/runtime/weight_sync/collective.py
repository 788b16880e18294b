"""``collective``: weights broadcast over a ``torch.distributed`` group of the link's own.

The group is the sending rank (link rank 0) and every receiver (link ranks 1..N), met through a
TCPStore the sender hosts, with process-group objects made directly (never the default group:
the trainer's DDP group is untouched, and ranks that are threads of one process on the local
backend each hold their own). NCCL when every end computes on CUDA, else gloo.

An update is a sequence of buckets of at most ``bucket_mb``, each one dtype (floating tensors
cast to the rollout's ``dtype``): a JSON header (names, shapes, dtype, version), then the flat
tensor; an end marker closes it. The sender reads its ``(name, tensor)`` iterator lazily, so a
sharded trainer gathers one bucket at a time; a failure while it reads is broadcast as an abort,
so receivers fail at once, naming it. Receivers stage every bucket before anything is loaded:
a refused update (checked by the caller) changes nothing.
"""

from __future__ import annotations

import datetime
import json
import math

import torch
import torch.distributed as dist

from tidal.runtime.errors import WeightUpdateAborted
from tidal.runtime.faults import fault_point
from tidal.runtime.weight_sync.base import WEIGHT_TRANSPORTS, LinkSpec, WeightTransport
from tidal.runtime.weights import WeightsUpdate

_HOSTED: dict[str, dist.TCPStore] = {}  # link name -> the store its sender hosts (this process)


def node_ip() -> str:
    """This process's node address as its peers reach it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


@WEIGHT_TRANSPORTS.register("collective")
class CollectiveTransport(WeightTransport):
    name = "collective"

    @classmethod
    def host(cls, spec: LinkSpec) -> LinkSpec:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(node_ip(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        _HOSTED[spec.name] = store
        spec.options["address"] = (node_ip(), store.port)
        return spec

    def __init__(self, spec: LinkSpec, role: str, rank: int):
        super().__init__(spec, role, rank)
        self.link_rank = 0 if role == "send" else rank + 1
        self.world = spec.receivers + 1
        self.bucket_bytes = int(spec.options.get("bucket_mb", 256) * 2**20)
        dtype = spec.options.get("dtype")
        self.dtype = _dtype(dtype) if dtype else None
        self.pg = self._join()
        # bucket buffers kept between updates (same layout every time): no allocation and no
        # first-touch page faults per update. A receiver stages into one of two sets; a loader
        # that adopts the staged tensors as its weights (``adopted``) makes that set live, and
        # the next update goes into the other one.
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._live_set: int | None = None
        self._inflight = None  # the sender's bucket on the wire: (work, what)
        self._staging_set = 0

    def _join(self):
        timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        call = f"joining the group of {self.world} ranks"
        try:
            if self.role == "send":
                store = _HOSTED.pop(self.spec.name)
            else:
                host, port = self.spec.options["address"]
                store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            store = dist.PrefixStore(self.spec.name, store)
            self._store = store
            # NCCL only when every end computes on a GPU of its own (NCCL refuses two ranks on
            # one GPU: a collocated layout takes gloo): each says which, all read all
            store.set(f"gpu/{self.link_rank}", self._gpu_id())
            gpus = [store.get(f"gpu/{r}").decode() for r in range(self.world)]
            on_cuda = all(gpus) and len(set(gpus)) == self.world
            self.backend = "nccl" if on_cuda else "gloo"
            self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
            self.device = self.device or torch.device("cpu")
            if on_cuda:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(store, self.link_rank, self.world, options)
            return dist.ProcessGroupGloo(store, self.link_rank, self.world, timeout)
        except Exception as exc:  # noqa: BLE001 (named and re-raised)
            raise self.error(call, exc) from exc

    def _gpu_id(self) -> str:
        """This end's GPU (its UUID), or "" when it computes on the CPU."""
        if self.spec.options.get("device", "auto") == "cpu" or not torch.cuda.is_available():
            return ""
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    # -- the wire ----------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        try:
            self.pg.broadcast(tensor, 0).wait()
        except Exception as exc:  # noqa: BLE001 (named and re-raised)
            raise self.error(f"broadcast of {what}", exc) from exc
        return tensor

    def _header(self, header: dict | None, what: str) -> dict:
        """The sender's header, broadcast as its length, then its bytes."""
        data = json.dumps(header).encode() if header is not None else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        size = int(self._broadcast(size, f"the header of {what}")[0])
        if header is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._broadcast(payload, f"the header of {what}")
        return header if header is not None else json.loads(payload.cpu().numpy().tobytes())

    # -- sending -----------------------------------------------------------------------------

    def send(self, tensors, version: int, snapshot: bool = False) -> None:
        bucket: list[tuple[str, torch.Tensor]] = []
        size, count = 0, 0
        try:
            for name, tensor in tensors:
                tensor = tensor.detach()
                if self.dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(self.dtype)
                if bucket and (
                    tensor.dtype != bucket[0][1].dtype or size + tensor.nbytes > self.bucket_bytes
                ):
                    self._send_bucket(bucket, version, count)
                    bucket, size, count = [], 0, count + 1
                bucket.append((name, tensor))
                size += tensor.nbytes
        except Exception as exc:  # the iterator failed (e.g. a gather): receivers stop too
            self._finish_inflight()
            self._header({"abort": f"{type(exc).__name__}: {exc}"}, "an abort")
            raise
        if bucket:
            self._send_bucket(bucket, version, count)
        self._finish_inflight()
        self._header({"end": True, "version": version}, "the end marker")

    def _finish_inflight(self) -> None:
        if self._inflight is not None:
            work, what = self._inflight
            self._inflight = None
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 (named and re-raised)
                raise self.error(f"broadcast of {what}", exc) from exc

    def _send_bucket(self, bucket, version: int, index: int) -> None:
        names = [n for n, _ in bucket]
        header = {
            "version": version,
            "names": names,
            "shapes": [list(t.shape) for _, t in bucket],
            "dtype": str(bucket[0][1].dtype),
        }
        what = f"bucket {index} ({names[0]} ...)"
        numel = sum(t.numel() for _, t in bucket)
        # two buffers per dtype, taking turns: bucket i + 1 is packed while bucket i is on the
        # wire; the sender holds at most two buckets' bytes beside its model
        flat = self._send_buffer(index % 2, numel, bucket[0][1].dtype)
        if bucket[0][1].device == self.device:
            torch.cat([t.reshape(-1) for _, t in bucket], out=flat)
        else:
            flat.copy_(torch.cat([t.reshape(-1) for _, t in bucket]))
        self._finish_inflight()
        self._header(header, what)
        fault_point("weights.send", transport=self.name, version=version, bucket=index, rank=0)
        try:
            self._inflight = (self.pg.broadcast(flat, 0), what)
        except Exception as exc:  # noqa: BLE001 (named and re-raised)
            raise self.error(f"broadcast of {what}", exc) from exc

    # -- receiving ---------------------------------------------------------------------------

    def recv(self) -> WeightsUpdate:
        staged: dict[str, torch.Tensor] = {}
        versions = set()
        self._staging_set = 1 if self._live_set == 0 else 0
        for index in range(1 << 62):
            what = f"bucket {index}"
            header = self._header(None, what)
            if "abort" in header:
                aborted = f"the sender aborted the update: {header['abort']}"
                raise self.error("receive", aborted, WeightUpdateAborted)
            versions.add(header["version"])
            if header.get("end"):
                break
            where = {"version": header["version"], "bucket": index, "rank": self.rank}
            fault_point("weights.recv", transport=self.name, **where)
            shapes = header["shapes"]
            sizes = [math.prod(s) for s in shapes]
            flat = self._buffer((self._staging_set, index), sum(sizes), _dtype(header["dtype"]))
            self._broadcast(flat, f"{what} ({header['names'][0]} ...)")
            for name, part, shape in zip(header["names"], flat.split(sizes), shapes):
                staged[name] = part.view(shape)
        if len(versions) != 1:
            raise self.error("receive", f"buckets of one update carry versions {sorted(versions)}")
        return WeightsUpdate(versions.pop(), staged, owned=True)

    def adopted(self) -> None:
        self._live_set = self._staging_set

    def _send_buffer(self, turn: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (-1 - turn, hash(dtype))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def _buffer(self, index: tuple[int, int], numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(index)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[index] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 (closing: the peers may be gone already)
                pass
        self.pg = None
