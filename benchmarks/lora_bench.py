"""LoRA against full fine-tuning on a ~100M- or ~400M-parameter Qwen2-like LM built from a
config (no download), through tidal's TrainEngine: per mode, in a process of its own,

- the bytes of parameters, gradients and optimizer state, counted from the tensors after a step
  (trainable state: what requires grad, its gradients and its Adam moments), and with the KL
  reference included (full FT keeps a frozen copy; LoRA disables its adapters instead);
- peak RSS of the process;
- training tokens/s (forward, backward and optimizer step on micro-batches of tokens).

  python benchmarks/lora_bench.py [--size 100m|400m] [--rank 16] [--steps 3] [--batch 2] [--seq 128]
      [--json benchmarks/lora_bench.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

# Qwen2-like shapes (untied embeddings, vocabulary 16384): ~96M and ~436M parameters
SIZES = {
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 10, "heads": 12},
    "400m": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "heads": 16},
}


def model_config(args):
    from transformers import Qwen2Config

    shape = dict(SIZES[args.size])
    heads = shape.pop("heads")
    return Qwen2Config(
        vocab_size=16384,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(512, args.seq),
        tie_word_embeddings=False,
        **shape,
    )


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(mode: str, args) -> dict:
    """One mode's bytes, peak RSS and tokens/s (run in a fresh process)."""
    from transformers import Qwen2ForCausalLM

    from tidal.config import ActorConfig
    from tidal.config.lora import LoRAConfig
    from tidal.engine import TrainEngine
    from tidal.models.lora import apply_lora, reference_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(model_config(args))
    lora = LoRAConfig(rank=args.rank if mode == "lora" else 0, alpha=2.0 * args.rank)
    model = apply_lora(model, lora)
    ref = reference_model(model, keep=True)  # a KL reference, as a run with kl_coef > 0 keeps
    engine = TrainEngine(model, ActorConfig(lr=1e-5, optimizer="adamw"), 100)
    ids = torch.randint(
        0, 16384, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )

    def loss_fn(module, micro):
        loss = module(input_ids=micro, labels=micro).loss
        return loss, {}

    engine.train_batch([ids], loss_fn)  # warm-up, and the optimizer state exists after it
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.train_batch([ids], loss_fn)
    seconds = time.perf_counter() - start

    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = [
        t
        for s in engine.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim()
    ]
    state = {
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_trainable": sum(p.numel() for p in trainable),
        "bytes_params": nbytes(model.parameters()),
        "bytes_trainable_params": nbytes(trainable),
        "bytes_grads": 4 * sum(p.numel() for p in trainable),  # set to None after each step
        "bytes_optimizer": nbytes(moments),
    }
    state["bytes_trainable_state"] = (
        state["bytes_trainable_params"] + state["bytes_grads"] + state["bytes_optimizer"]
    )
    ref_bytes = 0 if mode == "lora" else nbytes(ref.parameters())
    state["bytes_all_with_reference"] = (
        state["bytes_params"] + state["bytes_grads"] + state["bytes_optimizer"] + ref_bytes
    )
    del ref
    return {
        "mode": mode,
        **state,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens_per_s": args.steps * ids.numel() / seconds,
        "seconds_per_step": seconds / args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--mode", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:  # a child: one mode
        print(json.dumps(measure(args.mode, args)))
        return
    rows = {}
    for mode in ("full", "lora"):
        child = [a for a in sys.argv[1:]] + ["--mode", mode]
        done = subprocess.run(
            [sys.executable, __file__, *child], capture_output=True, text=True, check=True
        )
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    full, lora = rows["full"], rows["lora"]
    ratios = {
        "trainable_state": lora["bytes_trainable_state"] / full["bytes_trainable_state"],
        "all_with_reference": lora["bytes_all_with_reference"] / full["bytes_all_with_reference"],
        "peak_rss": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
        "tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"],
    }
    result = {"args": vars(args), "rows": rows, "lora_over_full": ratios}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
