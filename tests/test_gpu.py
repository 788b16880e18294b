"""On CUDA (marked ``gpu``: deselected, and counted in the summary, where there is none; run by
benchmarks/gpu_check.py): models and batches on the device in both halves, bf16, the collective
weight path over NCCL between processes, offload freeing the actor's device memory."""

import pytest
import torch

from tidal.checkpoint import rng_state, set_rng_state
from tidal.config.common import ActorConfig
from tidal.engine import TrainEngine
from tidal.runtime import Cluster
from tidal.runtime.devices import resolve_device, to_device

pytestmark = pytest.mark.gpu


def test_auto_resolves_to_cuda_and_records_move_there():
    device = resolve_device("auto")
    assert device.type == "cuda"
    moved = to_device({"x": torch.ones(3)}, device)
    assert moved["x"].is_cuda


def test_a_checkpoints_rng_state_brings_back_what_sampling_on_the_device_draws():
    torch.randn(1, device="cuda")  # CUDA in use: its generator is part of the state
    saved = rng_state()
    drawn = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(123)  # a resumed process starts from its seed
    set_rng_state(saved)
    assert torch.equal(torch.randn(4, device="cuda"), drawn)


def test_bf16_autocast_keeps_fp32_master_weights_and_offload_frees_90_percent():
    """A ~100M-parameter model (1.2 GB of weights and Adam state): what offload leaves is
    the input and the process's cuBLAS workspaces (64 MiB on an H200, allocated through
    PyTorch's allocator: beside 8M parameters they were 40% of the total, found on an H200)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(6))).cuda()
    engine = TrainEngine(model, ActorConfig(bf16=True), total_steps=2)
    x = torch.randn(16, 4096, device="cuda")
    engine.train_batch([x], lambda m, micro: (m(micro).float().pow(2).mean(), {}))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = engine.offload()
    after = torch.cuda.memory_allocated()
    assert after <= 0.1 * before, dict(before=before, freed=freed, after=after)
    engine.onload()
    engine.train_batch([x], lambda m, micro: (m(micro).float().pow(2).mean(), {}))


def test_the_collective_link_between_processes_on_the_gpu():
    """NCCL where the two ends have GPUs of their own; on one GPU NCCL refuses two ranks, and
    the link takes gloo (the receiver's staging is still on CUDA)."""
    from test_weight_sync import Holder

    from tidal.runtime.weight_sync import open_weight_link

    cluster = Cluster("ray", devices_per_node=2, ray_init_kwargs={"num_cpus": 2, "num_gpus": 1})
    try:
        sender = Holder.create_group(0).launch(cluster, [0], name="actor")
        receivers = Holder.create_group(1).launch(cluster, [1], name="rollout")
        link = open_weight_link("collective", cluster, sender, receivers, "gpu", timeout_s=60)
        sent, got = sender.send(link, 3), receivers.receive(link)
        assert got.wait(60) == [(3, "torch.float32")] and sent.wait(60) == [3]
        want = sender.weights().wait(60)[0]
        assert all(torch.equal(receivers.weights().wait(60)[0][k], want[k]) for k in want)
    finally:
        cluster.shutdown()
