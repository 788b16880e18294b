"""The GRPO trainer's step on the real model (SmolLM2-135M-Instruct, model.path of
examples/llm/smollm2_grpo.yaml), where its time goes, and its memory, with the chosen-token
log-probs computed whole (the ``[B, L, 49152]`` float logits at once, as at first), chunked at
every position (tidal.algorithms.tokens.token_logprobs, as next), or chunked at the generated
tokens only (``generated``: the trainer's form now), and with each group's prompt packed once
(``packed``: ``actor.shared_prefix``). Each variant runs in a fresh process:

- a batch shaped as the issue's: 4 word problems (chat-templated) x 8 samples, 64 generated
  tokens each (random ids: only shapes matter for time and memory);
- ``time/logp``: one no-grad log-prob pass over the batch (what the old log-probs with
  ``algorithm.recompute_logprob`` or the reference with ``algorithm.kl_coef`` each cost);
- ``time/step`` and train tokens/s of ``LLMActor.train_step`` (LoRA r16 unless --full), the
  passes its config asks for included; peak RSS of the process before and after the step.

  python benchmarks/smollm2_train_bench.py [--variants whole chunked generated packed] [--steps 2]
      [--threads 2] [--json benchmarks/smollm2_train_bench.json] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm" / "smollm2_grpo.yaml"


def whole_logprobs(model, input_ids, attention_mask, temperature, **_):
    """The form before chunking: every position's float logits at once."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def word_problem_batch(tokenizer, prompts: int, samples: int, new_tokens: int, seed: int = 0):
    from tidal.data import LLMBatch
    from tidal.models.llm import render_prompt
    from tidal.rollout.tasks import word_problems

    g = torch.Generator().manual_seed(seed)
    rows = []
    for record in word_problems(prompts, seed):
        prompt = render_prompt(tokenizer, record["prompt"])
        for _ in range(samples):
            out = torch.randint(0, len(tokenizer), (new_tokens,), generator=g).tolist()
            rows.append((prompt, out))
    width = max(len(p) + len(o) for p, o in rows)
    n = len(rows)
    ids = torch.full((n, width), tokenizer.pad_token_id)
    attn = torch.zeros(n, width, dtype=torch.bool)
    gen = torch.zeros(n, width, dtype=torch.bool)
    for i, (p, o) in enumerate(rows):
        ids[i, : len(p) + len(o)] = torch.tensor(p + o)
        attn[i, : len(p) + len(o)] = True
        gen[i, len(p) : len(p) + len(o)] = True
    logprobs = torch.where(gen, -torch.rand(n, width, generator=g) - 8.0, 0.0)
    return LLMBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=gen,
        logprobs=logprobs,
        versions=torch.where(gen, 0, -1),
        rewards=(torch.rand(n, generator=g) < 0.3).float(),
        group_ids=torch.arange(n) // samples,
    )


def measure(variant: str, args) -> dict:
    import tidal.workers.llm_actor as llm_actor
    from tidal.config import load_config
    from tidal.config.llm import LLMConfig
    from tidal.models.llm import load_tokenizer
    from tidal.runtime import Cluster

    torch.set_num_threads(args.threads)
    if variant == "whole":
        llm_actor.token_logprobs = whole_logprobs
    elif variant == "chunked":  # every position projected, the prompt's too
        chunked = llm_actor.token_logprobs
        llm_actor.token_logprobs = lambda *a, wanted=None, **kw: chunked(*a, **kw)
    overrides = [f"cluster.torch_threads={args.threads}", *args.overrides]
    if variant == "packed":  # generated tokens only, and each group's prompt run once
        overrides.append("actor.shared_prefix=true")
    if args.full:
        overrides.append("model.lora.rank=0")
    cfg = load_config(LLMConfig, EXAMPLE, overrides)
    tokenizer = load_tokenizer(cfg.model.path)
    batch = word_problem_batch(
        tokenizer, cfg.rollout.batch_size, cfg.rollout.group_size, cfg.rollout.max_new_tokens
    )
    cluster = Cluster("local")
    try:
        actor = llm_actor.LLMActor.create_group(cfg).launch(cluster, "0", name="actor")
        rss_loaded = peak_rss_mb()
        start = time.perf_counter()
        logp_s = timed(lambda: actor.compute_logp(batch).wait(3600))
        steps = []
        for _ in range(args.steps):
            t = time.perf_counter()
            metrics = actor.train_step(batch).wait(3600)[0]
            steps.append(time.perf_counter() - t)
        actor.shutdown()
    finally:
        cluster.shutdown()
    tokens = float(batch.attention_mask.sum())
    return {
        "variant": variant,
        "lora_rank": cfg.model.lora.rank,
        "rows": len(batch),
        "width": batch.input_ids.shape[1],
        "tokens": tokens,
        "generated_tokens": float(batch.loss_mask.sum()),
        "time/logp": round(logp_s, 2),
        "time/step": [round(s, 2) for s in steps],
        "train_tokens_per_s": round(tokens / min(steps), 1),
        "generated_tokens_per_s": round(float(batch.loss_mask.sum()) / min(steps), 1),
        "needs_prox": bool(metrics.get("train/mismatch_kl") is not None),
        "peak_rss_mb_loaded": round(rss_loaded),
        "peak_rss_mb_after_step": round(peak_rss_mb()),
        "wall_s": round(time.perf_counter() - start, 1),
        "threads": args.threads,
    }


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["chunked", "generated", "packed"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r16")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: this variant
    p.add_argument("overrides", nargs="*", help="key=value overrides of the example")
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)), flush=True)
        return
    results = []
    for variant in args.variants:
        child = [sys.executable, __file__, "--one", variant, "--steps", str(args.steps)]
        child += [
            "--threads",
            str(args.threads),
            *(["--full"] if args.full else []),
            *args.overrides,
        ]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
