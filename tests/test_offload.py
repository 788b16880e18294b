"""actor.offload: while the rollout generates, the actor's device storages are freed and host
copies hold its state; after onload training continues bitwise as without offload."""

import torch

from tidal.config.common import ActorConfig
from tidal.engine import MultiOptimizerEngine, TrainEngine
from tidal.runtime.offload import HostParkedModule, module_and_optimizer_tensors


def _engine(seed: int) -> TrainEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return TrainEngine(model, ActorConfig(lr=1e-2), total_steps=10)


def _train(engine: TrainEngine, steps: int, offload: bool) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(steps):
        if offload:
            freed = engine.offload()
            tensors = module_and_optimizer_tensors(engine.model, engine.optimizer)
            assert freed > 0 and all(t.untyped_storage().size() == 0 for t in tensors)
            assert all(len(host) > 0 for _, host in engine._host._held)
            engine.onload()
        x = torch.randn(8, 6, generator=gen)
        loss_fn = lambda model, micro: ((model(micro) ** 2).mean(), {"loss": 0.0})  # noqa: E731
        norms += engine.train_batch([x[:4], x[4:]], loss_fn)["grad_norm"]
        engine.end_step()
    return norms


def test_offload_frees_the_device_storages_and_training_continues_bitwise():
    plain, offloaded = _engine(0), _engine(0)
    assert _train(plain, 4, offload=False) == _train(offloaded, 4, offload=True)
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(plain.optimizer.state.values(), offloaded.optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _frozen(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_a_host_resident_reference_comes_to_the_device_only_while_in_use():
    """actor.ref_offload: the reference's storages are freed between passes and its outputs are
    those of a copy never moved."""
    kept, parked = _frozen(1), HostParkedModule(_frozen(1), resident_on_host=True)
    x = torch.randn(5, 6)
    assert parked.resident_bytes() == 0
    for _ in range(2):
        with parked.in_use() as ref:
            assert parked.resident_bytes() > 0
            assert torch.equal(ref(x), kept(x))
        assert parked.resident_bytes() == 0
    assert parked.unpark() == 0  # it lives on the host: a collocated onload leaves it there


def test_a_reference_copy_steps_off_with_the_engine_and_a_view_is_never_moved():
    ref = HostParkedModule(_frozen(2))
    full = ref.resident_bytes()
    assert full > 0 and ref.park() == full and ref.resident_bytes() == 0
    assert ref.unpark() == full and ref.resident_bytes() == full

    class View:  # LoRA's adapters-disabled reference: the trained model's own weights
        pass

    view = HostParkedModule(View(), resident_on_host=True)
    assert view.park() == 0 and view.resident_bytes() == 0
    with view.in_use() as same:
        assert same is view.module


def _parts_engine(seed: int, **actor) -> MultiOptimizerEngine:
    """SAC's shape: two parts of one model, each stepped on a loss of its own."""
    model = _frozen(seed).requires_grad_(True)
    parts = {
        "first": (list(model[0].parameters()), 1e-2),
        "last": (list(model[2].parameters()), 1e-3),
    }
    return MultiOptimizerEngine(model, parts, ActorConfig(**actor), name="sac")


def _train_parts(engine: MultiOptimizerEngine, steps: int, offload: bool) -> list[bool]:
    gen, applied = torch.Generator().manual_seed(4), []
    for _ in range(steps):
        if offload:
            assert engine.offload() > 0
            assert all(p.untyped_storage().size() == 0 for p in engine.model.parameters())
            engine.onload()
        x = torch.randn(8, 6, generator=gen)
        for part in ("first", "last"):
            applied.append(engine.step_loss(part, (engine.model(x) ** 2).mean()))
        engine.end_step()
    return applied


def test_the_multi_optimizer_engine_offloads_bitwise_and_guards_each_part():
    """MultiOptimizerEngine (SAC's): offload and onload leave training bitwise as it was; a
    non-finite loss skips only its part's step, counted; clipping bounds each part's norm."""
    plain, offloaded = _parts_engine(5), _parts_engine(5)
    assert _train_parts(plain, 3, False) == _train_parts(offloaded, 3, True) == [True] * 6
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
    before = [p.clone() for p in plain.model.parameters()]
    assert not plain.step_loss("first", torch.tensor(float("nan"), requires_grad=True))
    assert plain.skipped_steps == 1 and plain.skips["first"].in_a_row == 1
    assert all(torch.equal(a, b) for a, b in zip(before, plain.model.parameters()))
    clipped = _parts_engine(5, max_grad_norm=1e-3)
    x = torch.randn(8, 6)
    clipped.step_loss("first", (clipped.model(x) ** 2).mean() * 1e3)
    grads = [p.grad for p in clipped.model[0].parameters()]
    assert abs(float(torch.nn.utils.get_total_norm(grads)) - 1e-3) < 1e-6
