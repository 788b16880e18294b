"""cluster.device: each rank's torch.device, records moved on and off it, and the config errors
raised before start. (The same paths on CUDA are the ``gpu`` tests.)"""

import dataclasses

import pytest
import torch

from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.engine import host_floats
from tidal.runners.preflight import check_embodied
from tidal.runtime.devices import DeviceError, resolve_device, to_device, to_host

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what a CPU node does")


@no_cuda
def test_auto_and_cpu_resolve_to_the_cpu_and_cuda_is_an_error_naming_the_rank():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", placed_on_gpu=True) == torch.device("cpu")
    with pytest.raises(DeviceError, match="cluster.device: cuda, but actor rank 1 sees no CUDA"):
        resolve_device("cuda", "actor rank 1")
    # a GPU placement whose torch cannot see it would otherwise train on the CPU silently
    with pytest.raises(DeviceError, match="rollout rank 0 is placed on a GPU and sees no CUDA"):
        resolve_device("auto", "rollout rank 0", placed_on_gpu=True)
    with pytest.raises(DeviceError, match="expected one of auto, cpu, cuda"):
        resolve_device("tpu")


@no_cuda
def test_cuda_on_a_cpu_node_is_a_config_error_before_start():
    with pytest.raises(ConfigError, match="cluster.device: cuda, but this node sees no CUDA"):
        check_embodied(load_config(EmbodiedConfig, None, ["cluster.device=cuda"]))
    with pytest.raises(ConfigError, match="cluster.device: expected one of auto, cpu, cuda"):
        check_embodied(load_config(EmbodiedConfig, None, ["cluster.device=gpu"]))


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    parts: dict
    note: str = "kept"


def test_records_move_to_a_device_and_back_to_the_host_whole():
    record = Record(torch.ones(2), {"a": [torch.zeros(1)], "n": None, "s": torch.tensor(3.0)})
    meta = to_device(record, torch.device("meta"))
    assert meta.x.is_meta and meta.parts["a"][0].is_meta and meta.parts["s"].is_meta
    assert meta.note == "kept" and meta.parts["n"] is None
    back = to_host(to_device(record, torch.device("cpu")))
    assert back.x is record.x  # already on the host: no copy


def test_micro_batch_metrics_are_read_in_one_transfer_with_plain_floats_kept():
    metrics = {"loss": [torch.tensor(1.5), torch.tensor(2.0)], "kl": [0.25, torch.tensor(0.5)]}
    assert host_floats(metrics) == {"loss": [1.5, 2.0], "kl": [0.25, 0.5]}


def test_cuda_with_the_local_backend_asks_this_process_not_the_cluster_nodes(monkeypatch, tmp_path):
    """The local backend's ranks are threads of the driver: its node is never a "GPU node", so
    ``cuda`` is checked against the driver's own CUDA (found on an H200: it was refused)."""
    from tidal.runners.embodied.train import EmbodiedRunner
    from tidal.runtime import devices

    cfg = load_config(EmbodiedConfig, None, ["cluster.device=cuda"])
    runner = EmbodiedRunner.__new__(EmbodiedRunner)
    runner.cfg = cfg
    monkeypatch.setattr(devices, "cuda_visible", lambda: True)
    runner.start_cluster().shutdown()  # accepted: this process sees CUDA
    monkeypatch.setattr(devices, "cuda_visible", lambda: False)
    with pytest.raises(DeviceError, match="cluster.device: cuda, but this node sees no CUDA"):
        runner.start_cluster()
