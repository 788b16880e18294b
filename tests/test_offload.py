"""actor.offload: while the rollout generates, the actor's device storages are freed and host
copies hold its state; after onload training continues bitwise as without offload."""

import torch

from tidal.config.common import ActorConfig
from tidal.engine import TrainEngine
from tidal.runtime.offload import module_and_optimizer_tensors


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
