"""On CUDA (marked ``gpu``: deselected, and counted in the summary, where there is none; run by
benchmarks/gpu_check.py): models and batches on the device in both halves, bf16, the collective
weight path between processes (gloo on one GPU, NCCL on two: ``gpu(count=2)``), offload freeing
the actor's device memory."""

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
    """actor.bf16: the forward computes in bf16 (its outputs are bf16) on fp32 weights, fp32
    gradients and fp32 Adam state. A ~100M-parameter model (1.2 GB of weights and Adam state):
    what offload leaves is the input and the process's cuBLAS workspaces (64 MiB on an H200,
    allocated through PyTorch's allocator: beside 8M parameters they were 40% of the total,
    found on an H200)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(6))).cuda()
    engine = TrainEngine(model, ActorConfig(bf16=True), total_steps=2)
    x = torch.randn(16, 4096, device="cuda")
    computed = []

    def loss(m, micro):
        out = m(micro)
        computed.append(out.dtype)
        return out.float().pow(2).mean(), {}

    engine.train_batch([x], loss)
    assert computed == [torch.bfloat16]  # autocast was on (fp32 weights alone prove nothing)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    state = [s for s in engine.optimizer.state.values() if "exp_avg" in s]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = engine.offload()
    after = torch.cuda.memory_allocated()
    assert after <= 0.1 * before, dict(before=before, freed=freed, after=after)
    engine.onload()
    engine.train_batch([x], loss)
    assert computed == [torch.bfloat16] * 2


@pytest.mark.parametrize(
    ("gpus", "backend"),
    [
        # both ends on GPU 0: NCCL refuses two ranks on one GPU, the link takes gloo (host)
        (1, "gloo"),
        # a GPU each: NCCL, device to device (deselected, and counted, with fewer GPUs)
        pytest.param(2, "nccl", marks=pytest.mark.gpu(count=2)),
    ],
)
def test_the_collective_link_between_processes_on_the_gpu(gpus, backend):
    """The collective weight link between an actor and a rollout process that both compute on
    CUDA: the backend both ends chose, where they stage, and the weights received bit for bit."""
    from test_weight_sync import Holder

    from tidal.runtime.weight_sync import open_weight_link

    init = {"num_cpus": 2, "num_gpus": gpus}
    cluster = Cluster("ray", devices_per_node=gpus, ray_init_kwargs=init)
    try:
        sender = Holder.create_group(0).launch(cluster, [0], name="actor")
        receivers = Holder.create_group(1).launch(cluster, [gpus - 1], name="rollout")
        link = open_weight_link("collective", cluster, sender, receivers, "gpu", timeout_s=60)
        sent, got = sender.send(link, 3), receivers.receive(link)
        assert got.wait(60) == [(3, "torch.float32")] and sent.wait(60) == [3]
        ends = sender.link_end(link, "send").wait(60) + receivers.link_end(link, "recv").wait(60)
        device = "cuda" if backend == "nccl" else "cpu"
        assert ends == [(backend, device)] * 2, ends
        want = sender.weights().wait(60)[0]
        assert all(torch.equal(receivers.weights().wait(60)[0][k], want[k]) for k in want)
    finally:
        cluster.shutdown()
