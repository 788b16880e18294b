"""Engines under each actor.strategy for tests/test_strategies.py (importable by Ray workers).

Every rank builds the same tiny models from one seed; ``train`` takes the global batches of
every step and trains on this rank's rows, two micro-batches per optimizer step; ``lora``: with
LoRA adapters (PEFT) on the model, wrapped before the engine shards it."""

import gymnasium as gym
import numpy as np
import torch

from tidal.config.common import ActorConfig
from tidal.config.lora import LoRAConfig
from tidal.engine import TrainEngine
from tidal.memory import state_bytes_counted
from tidal.models.lora import (
    apply_lora,
    lora_meta,
    reference_model,
    rollout_weight_stream,
    rollout_weights,
    save_pretrained_folder,
)
from tidal.runtime import Worker
from tidal.strategies import build_model as build_for_rank

VOCAB, OBS_DIM, ACT_DIM = 40, 6, 2
POISON = -1  # a step whose loss is NaN: the non-finite guard skips it
LORA = LoRAConfig(rank=4, alpha=8)


def build_model(kind: str, lora: bool = False) -> torch.nn.Module:
    model = build_base(kind)
    if not lora:
        return model
    model = apply_lora(model, LORA, kind)
    # adapters that start non-zero: both A and B train from the first step, at a scale that a
    # relative comparison can read (from B = 0 they hold a few steps' updates, mostly noise-free
    # but as small as Adam's reduction-order noise allows)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def build_base(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "lm":
        from tidal.inference.tiny import tiny_llama

        return tiny_llama(VOCAB, hidden=32, layers=2, heads=4, max_positions=32)
    from tidal.models.vla import TokenActionPolicy

    obs = gym.spaces.Box(-1.0, 1.0, (OBS_DIM,), np.float32)
    act = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,), np.float32)
    return TokenActionPolicy(obs, act, hidden_size=32, num_layers=2, num_heads=2, num_bins=16)


def make_batches(kind: str, steps: int, rows: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "lm":
        return [{"ids": torch.randint(3, VOCAB, (rows, 12), generator=g)} for _ in range(steps)]
    return [
        {
            "obs": torch.rand(rows, OBS_DIM, generator=g) * 2 - 1,
            "actions": torch.randint(0, 16, (rows, 1, ACT_DIM), generator=g),
            "returns": torch.randn(rows, generator=g),
        }
        for _ in range(steps)
    ]


def micro_loss(kind: str, parts: int):
    """Each micro-batch's share (1/parts) of the minibatch's mean loss."""

    def loss_fn(model, micro):
        if kind == "lm":
            loss = model(input_ids=micro["ids"], labels=micro["ids"]).loss
        else:
            out = model({"obs": micro["obs"]}, micro["actions"])
            loss = -out["logprobs"].mean() + ((out["values"] - micro["returns"]) ** 2).mean()
        if micro.get("poison", False):
            loss = loss * float("nan")
        return loss / parts, {"loss": loss.item()}

    return loss_fn


def actor_config(strategy: str, lora: bool = False, **kw) -> ActorConfig:
    # a linear schedule and clipping that bites (the norms here are ~1-5, the adapters' ~0.1-1)
    clip = 0.05 if lora else 0.5
    # Adam's epsilon above rounding noise: an attention's key bias has a zero gradient in exact
    # arithmetic (softmax ignores it), and at eps 1e-8 Adam scales the ~1e-10 rounding left in
    # it to a full step of lr, whose sign is the reduction order's (DDP's all-reduce against
    # FSDP2's reduce-scatter), not the strategy's arithmetic
    kw.setdefault("adam_eps", 1e-5)
    return ActorConfig(lr=3e-3, lr_schedule="linear", max_grad_norm=clip, strategy=strategy, **kw)


def train_steps(
    engine, kind, batches, rank, world, micro_per_rank, poison_step=None, after_step=None
):
    out = []
    for step, batch in enumerate(batches):
        per_rank = next(iter(batch.values())).shape[0] // world
        mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
        size = per_rank // micro_per_rank
        micros = [
            {k: v[i * size : (i + 1) * size] for k, v in mine.items()}
            for i in range(micro_per_rank)
        ]
        if step == poison_step:
            micros[-1]["poison"] = True
        metrics = engine.train_batch(micros, micro_loss(kind, micro_per_rank))
        engine.end_step()
        out.append((float(np.mean(metrics["loss"])), metrics["grad_norm"][0]))
        if after_step is not None:
            after_step(step + 1)
    return out


class EngineWorker(Worker):
    def __init__(self):
        torch.set_num_threads(1)
        self.init_distributed()

    def resume(self, kind: str, checkpoint: str, steps: int, rows: int, lora: bool) -> dict:
        """A fresh fsdp2 engine resumed from ``checkpoint`` and trained to step ``steps`` on
        the same batches as ``train``: each step's (loss, grad norm) and the whole weights."""
        cfg = actor_config("fsdp2", lora)
        model = build_for_rank(
            cfg, lambda: build_model(kind, lora), self.rank, self.world_size, "cpu"
        )
        engine = TrainEngine(model, cfg, 10, distributed=True)
        engine.load(checkpoint)
        batches = make_batches(kind, steps, rows)[engine.step :]
        history = train_steps(engine, kind, batches, self.rank, self.world_size, 2)
        return {"history": history, "weights": engine.full_state_dict(self.rank)}

    def load(self, folder: str, lora: bool) -> dict:
        """The language actor's model from a Hugging Face folder under fsdp2 (rank 0 reads
        the weights, rank 1 builds from config.json on the meta device): the rollout's
        weights on rank 0 (merged under LoRA) and whether this rank built a skeleton."""
        from tidal.config.llm import LLMModelConfig
        from tidal.workers.llm_actor import trained_model

        m = LLMModelConfig(path=folder, lora=LORA if lora else LoRAConfig())
        cfg = actor_config("fsdp2", lora)
        model = build_for_rank(
            cfg,
            lambda: trained_model(m),
            self.rank,
            self.world_size,
            "cpu",
            skeleton=lambda: trained_model(m, weights=False),
        )
        built_on_meta = any(p.is_meta for p in model.parameters())
        engine = TrainEngine(model, cfg, 10, distributed=True)
        rollout = rollout_weights(model, engine, self.rank)
        return {
            "rollout": None if rollout is None else dict(rollout),
            "built_on_meta": built_on_meta,
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        }

    def train(
        self,
        kind: str,
        strategy: str,
        steps: int,
        rows: int,
        poison_step=None,
        save=None,
        lora=False,
        weights_folder=None,
    ):
        """A fresh engine trained ``steps`` steps: each step's (loss, grad norm), the value of
        the batch after training (policies: a forward method besides forward), the whole
        updated weights and the rollout's (merged under LoRA) on rank 0, and the bytes this
        rank holds. ``save``: (step, path), a checkpoint after that step; ``weights_folder``:
        the rollout's weights as a ``save_pretrained`` folder (what vLLM reloads) at the end."""
        cfg = actor_config(strategy, lora)
        model = build_for_rank(
            cfg, lambda: build_model(kind, lora), self.rank, self.world_size, "cpu"
        )
        built_on_meta = any(p.is_meta for p in model.parameters())
        engine = TrainEngine(model, cfg, 10, distributed=True)
        batches = make_batches(kind, steps, rows)

        def after_step(step):
            if save is not None and step == save[0]:
                meta = {"step": step, "lora": lora_meta(LORA if lora else LoRAConfig())}
                engine.save(save[1], meta, rank=self.rank)

        history = train_steps(
            engine, kind, batches, self.rank, self.world_size, 2, poison_step, after_step
        )
        # the bytes held with gradients present: after one more backward (no step)
        loss, _ = micro_loss(kind, 1)(engine.module, batches[0])
        loss.backward()
        held = state_bytes_counted(engine.model, engine.optimizer)
        engine.optimizer.zero_grad(set_to_none=True)
        value = None
        if kind == "vla":
            with torch.no_grad():
                value = engine.model.value({"obs": batches[0]["obs"]})
        rollout = rollout_weights(model, engine, self.rank)
        rollout = None if rollout is None else dict(rollout)
        gathers = count_gathers(rollout_weight_stream(model, engine, self.rank))
        if weights_folder is not None and rollout is not None:
            save_pretrained_folder(model, weights_folder, rollout)
        ref_loss = None
        if lora:  # the KL reference: the same (sharded) model with its adapters disabled
            with torch.no_grad():
                ref_loss = micro_loss(kind, 1)(reference_model(model, True), batches[0])[0]
        return {
            "history": history,
            "value": value,
            "weights": engine.full_state_dict(self.rank),
            "rollout": rollout,
            "ref_loss": ref_loss,
            "bytes": held,
            "skipped": engine.skipped_steps,
            "built_on_meta": built_on_meta,
            "gathers": gathers,
        }


def count_gathers(stream) -> tuple[int, int]:
    """How many parameters a weight stream had all-gathered when it yielded its first pair, and
    in all (read to the end, as every rank must)."""
    from torch.distributed.tensor import DTensor

    calls, first = [0], None
    gather = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return gather(self, *args, **kwargs)

    DTensor.full_tensor = counted
    try:
        for _ in stream:
            first = calls[0] if first is None else first
    finally:
        DTensor.full_tensor = gather
    return first, calls[0]
