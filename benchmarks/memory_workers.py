"""The rank of benchmarks/memory_bench.py (importable by Ray worker processes)."""

from __future__ import annotations

import ctypes
import resource
import time

import psutil
import torch

from tidal.config.common import ActorConfig
from tidal.engine import TrainEngine
from tidal.memory import state_bytes_counted
from tidal.runtime import Worker
from tidal.strategies import build_model

# Llama shapes of ~100M and ~400M parameters (untied embeddings, GQA with half the heads)
SIZES = {
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 2048},
    "400m": {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096},
}
VOCAB = 16000


def llama_config(size: str):
    from transformers import LlamaConfig

    shape = SIZES[size]
    heads = shape["hidden_size"] // 64
    return LlamaConfig(
        vocab_size=VOCAB,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **shape,
    )


class MemoryWorker(Worker):
    def run(self, size: str, strategy: str, steps: int, rows: int, seq: int, micro: int) -> dict:
        from transformers import LlamaForCausalLM

        torch.set_num_threads(1)
        if self.world_size > 1:
            self.init_distributed()
        torch.manual_seed(0)
        cfg = ActorConfig(lr=1e-4, strategy=strategy)
        # under fsdp2 only rank 0 builds the whole model; the others a meta skeleton
        model = build_model(
            cfg, lambda: LlamaForCausalLM(llama_config(size)), self.rank, self.world_size, "cpu"
        )
        phases = {"built": rss_now()}
        engine = TrainEngine(model, cfg, steps + 1, self.world_size > 1)
        phases["wrapped"] = rss_now()
        g = torch.Generator().manual_seed(self.rank)

        def loss_fn(module, ids):
            loss = module(input_ids=ids, labels=ids).loss
            return loss / micro, {"loss": loss.item()}

        def batch():
            return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(micro)]

        engine.train_batch(batch(), loss_fn)  # warm-up: the optimizer state exists from here
        phases["warm-up step"] = rss_now()
        start = time.perf_counter()
        for _ in range(steps):
            engine.train_batch(batch(), loss_fn)
        elapsed = time.perf_counter() - start
        phases["timed steps"] = rss_now()
        # what a rank holds at its peak: one more backward, gradients present
        loss, _ = loss_fn(engine.module, batch()[0])
        loss.backward()
        held = state_bytes_counted(engine.model, engine.optimizer)
        phases["one more backward"] = rss_now()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory (e.g. the unsharded build) back
        return {
            "rank": self.rank,
            "num_params": sum(p.numel() for p in model.parameters()),
            **{f"{k}_bytes": v for k, v in held.items()},
            "state_bytes": sum(held.values()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_after_bytes": psutil.Process().memory_info().rss,
            "tokens_per_s": steps * micro * rows * seq / elapsed,
            "rss_phases": phases,
        }


def rss_now() -> dict[str, int]:
    """The process's resident set now and its peak so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss": psutil.Process().memory_info().rss, "peak": peak}
