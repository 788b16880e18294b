"""The train engine: gradient accumulation, the lr schedule, the non-finite guard, and
checkpoints that round-trip exactly (tied weights too)."""

import logging
import math

import pytest
import torch

from tidal.config import ActorConfig
from tidal.engine import NonFiniteError, TrainEngine


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _mse(model, batch):
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    return loss, {"loss": loss.item()}


def test_gradient_accumulation_equals_one_large_batch():
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    whole, split = (
        TrainEngine(_model(), ActorConfig(lr=0.1), 10),
        TrainEngine(_model(), ActorConfig(lr=0.1), 10),
    )
    whole.train_batch([(x, y)], _mse)

    def quarter(model, batch):  # each micro-batch is a quarter of the minibatch loss
        loss, info = _mse(model, batch)
        return loss / 4, info

    split.train_batch(list(zip(x.split(8), y.split(8))), quarter)
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "schedule, expected",
    [  # lr 1.0, 2 warm-up steps of 6: the factor at each optimizer step
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
        (
            "cosine",
            [
                0.5,
                1.0,
                1.0,
                0.5 + 0.5 * math.cos(math.pi / 4),
                0.5,
                0.5 - 0.5 * math.cos(math.pi / 4),
            ],
        ),
    ],
)
def test_the_lr_warms_up_linearly_then_follows_its_schedule(schedule, expected):
    cfg = ActorConfig(lr=1.0, lr_schedule=schedule, warmup_steps=2, max_grad_norm=None)
    engine = TrainEngine(_model(), cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(engine.optimizer.param_groups[0]["lr"])
        engine.optimizer.step()
        engine.scheduler.step()
    assert seen == pytest.approx(expected)


def test_non_finite_steps_are_skipped_counted_and_abort_the_run(caplog):
    engine = TrainEngine(_model(), ActorConfig(lr=0.1, max_skipped_steps=3), 10)
    before = [p.detach().clone() for p in engine.model.parameters()]
    bad = (torch.full((4, 4), float("nan")), torch.zeros(4, 1))
    with caplog.at_level(logging.WARNING, logger="tidal.engine"):
        for _ in range(2):
            engine.train_batch([bad], _mse)
    assert (
        engine.skipped_steps == 2 and "non-finite gradient norm at training step 1" in caplog.text
    )
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    engine.train_batch([(torch.randn(4, 4), torch.zeros(4, 1))], _mse)  # a good step resets the run
    assert engine.consecutive_skips == 0
    for _ in range(2):
        engine.train_batch([bad], _mse)
    with pytest.raises(
        NonFiniteError, match="3 consecutive optimizer steps .* actor.max_skipped_steps=3"
    ):
        engine.train_batch([bad], _mse)


def test_checkpoint_round_trip_is_exact_and_loading_is_strict(tmp_path):
    cfg = ActorConfig(lr=0.05, lr_schedule="linear")
    engine = TrainEngine(_model(), cfg, 10)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    for b in batches[:2]:
        engine.train_batch([b], _mse)
        engine.end_step()
    engine.save(tmp_path / "ck", {"step": 2})
    for b in batches[2:]:
        engine.train_batch([b], _mse)
        engine.end_step()
    expected = [p.detach().clone() for p in engine.model.parameters()]

    resumed = TrainEngine(_model(seed=5), cfg, 10)
    assert resumed.load(tmp_path / "ck")["step"] == 2 and resumed.step == 2
    for b in batches[2:]:
        resumed.train_batch([b], _mse)
        resumed.end_step()
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed.model.parameters()))

    other = TrainEngine(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), cfg, 10)
    with pytest.raises(
        ValueError, match=r"missing keys \[\].*unexpected keys \['2.bias', '2.weight'\]"
    ):
        other.load(tmp_path / "ck")


class _TiedLM(torch.nn.Module):
    """A language model whose output head is its input embedding: one parameter, two names."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _next_token_loss(model, ids):
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    return loss, {"loss": loss.item()}


def test_tied_weights_are_saved_and_loaded(tmp_path):
    """Saved under both names and loaded into a model built from another seed: still one
    parameter, the saved values under both names, and its optimizer state with it (the steps
    after the load are the uninterrupted run's)."""
    cfg = ActorConfig(lr=0.05)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 6, (8, 5), generator=g) for _ in range(4)]
    engine = TrainEngine(_TiedLM(seed=0), cfg, 10)
    for b in batches[:2]:
        engine.train_batch([b], _next_token_loss)
        engine.end_step()
    engine.save(tmp_path / "ck", {"step": 2})
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for b in batches[2:]:
        engine.train_batch([b], _next_token_loss)
        engine.end_step()

    resumed = TrainEngine(_TiedLM(seed=5), cfg, 10)
    resumed.load(tmp_path / "ck")
    model = resumed.model
    assert model.head.weight is model.embed.weight  # the tie survives the load
    loaded = model.state_dict()
    assert loaded.keys() == saved.keys() >= {"embed.weight", "head.weight"}
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    for b in batches[2:]:
        resumed.train_batch([b], _next_token_loss)
        resumed.end_step()
    for k, v in engine.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
