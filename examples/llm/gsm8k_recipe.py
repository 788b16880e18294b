"""The word-problem recipe as one command: data, a warm start per seed, RL per seed and objective.

    python examples/llm/gsm8k_recipe.py --out runs/gsm8k                       # GRPO, seeds 1 2 3
    python examples/llm/gsm8k_recipe.py --out runs/gsm8k --seeds 1 --objectives grpo dapo gspo

1. ``make_word_problems.py`` writes the data once (generator seed 0: every seed trains and is
   scored on the same problems).
2. Per seed, three ``tidal sft`` runs of 300 steps build a fresh tiny Qwen2 and warm-start it,
   each continuing the last with a fresh optimizer (``runner.seed`` draws the model's
   initialisation and the order of the SFT examples; the byte-level BPE tokenizer is trained on
   the data, the same for every seed), scored greedily on the dev split after each.
3. ``tidal train`` per seed and objective continues from that warm start for ``--steps``
   (``runner.seed`` also seeds the prompt order and sampling), scored greedily on the test split
   every ``runner.eval_interval`` steps; an objective is a preset of ``examples/llm/presets/``,
   a partial config merged over ``gsm8k_grpo.yaml`` as ``tidal train`` merges the files it is
   given (``tidal train gsm8k_grpo.yaml presets/dapo.yaml ...``). The budget is a step count, not a
   clock, so that a loaded machine runs the same recipe (1000 steps took 20 minutes alone on an
   idle 2-core machine); ``--minutes`` adds a clock.

Each finished step is kept (a warm start or a run already in ``--out`` is read, not redone), so
an interrupted recipe continues. ``--jobs 2`` runs two jobs side by side (each on one thread).
Writes ``<out>/recipe.json`` (every run, then mean, min and max over the seeds) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "gsm8k_grpo.yaml"
PRESETS = HERE / "presets"
DATA_ARGS = "--train-size 4000 --eval-size 256 --max-operand 9 --two-step --terse --dev-size 128"
COMMON = ["data.system_prompt=null", "rollout.max_new_tokens=32", "data.eval_size=128"]
# a constant rate: a cosine-annealed warm start of the same accuracy barely moved under GRPO
# (BENCHMARKS.md, issue 30)
SFT = ["sft.lr=2e-3", "sft.lr_schedule=constant"]


def tidal(*args: str, log: Path) -> dict:
    """Run a ``tidal`` command (its output to ``log``) and return the JSON summary it prints."""
    cmd = [sys.executable, "-m", "tidal.cli", *args, "runner.progress=false"]
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, text=True)
        out.write(done.stdout)
    out_text = done.stdout
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:4])} failed ({done.returncode}): see {log}")
    return json.loads(out_text[out_text.index("{") :])


def objective_files(objective: str) -> list[Path]:
    """The config files of an RL run, merged left to right: the demo, then the preset."""
    return [CONFIG, PRESETS / f"{objective}.yaml"]


def make_data(out: Path) -> Path:
    data = out / "data"
    if not (data / "test.parquet").exists():
        script = HERE / "data" / "make_word_problems.py"
        subprocess.run(
            [sys.executable, str(script), *DATA_ARGS.split(), "--out", str(data)], check=True
        )
    return data


def warm_start(out: Path, data: Path, seed: int, steps: int, stages: int) -> dict:
    """The seed's SFT model: ``stages`` runs of ``tidal sft``, each continuing the last with a
    fresh optimizer and its own shuffle (runner.seed ``stages * (seed - 1) + k``), each kept
    once done; the dev accuracy after each."""
    model, dev = out / "models" / f"s{seed}", []
    for stage in range(1, stages + 1):
        summary = out / f"sft_s{seed}_{stage}.json"
        if not summary.exists():
            result = tidal(
                "sft", str(CONFIG), *COMMON, *SFT, f"sft.steps={steps}",
                f"runner.seed={stages * (seed - 1) + stage}",
                f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'dev.parquet'}",
                f"model.path={model}", f"runner.run_dir={out / 'runs'}",
                f"runner.experiment=s{seed}", "sft.eval_size=128",
                log=out / f"sft_s{seed}_{stage}.log",
            )  # fmt: skip
            summary.write_text(json.dumps(result, indent=2))
        dev.append(json.loads(summary.read_text())["held_out_accuracy"])
    return {"held_out_accuracy": dev[-1], "dev_after_each_stage": dev}


def reinforce(out: Path, data: Path, seed: int, objective: str, budget: list[str]) -> dict:
    """One RL run from the seed's warm start (once: its printed summary marks it done; an
    interrupted one resumes from its newest checkpoint), read back from its metrics."""
    name = f"{objective}_s{seed}"
    done = out / f"{name}.json"
    if not done.exists():
        summary = tidal(
            "train", *map(str, objective_files(objective)), *COMMON, f"runner.seed={seed}",
            f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.parquet'}",
            f"model.path={out / 'models' / f's{seed}'}", f"runner.run_dir={out / 'runs'}",
            f"runner.experiment={name}", "runner.resume_from=auto", *budget,
            log=out / f"{name}.log",
        )  # fmt: skip
        done.write_text(json.dumps(summary, indent=2))
    run = Path(json.loads(done.read_text())["run_dir"])
    return {"seed": seed, "objective": objective, **accuracy_curve(run)}


def accuracy_curve(run: Path) -> dict:
    """The run's greedy test accuracy before RL, at its best and at its end, and its steps."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    # an evaluation is logged with the step it follows (-1: before any update)
    evals = [(row["step"] + 1, row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
    return {
        "steps": max(row["step"] for row in rows) + 1,
        "start": evals[0][1],
        "best": max(acc for _, acc in evals),
        "last": evals[-1][1],
        "gain": evals[-1][1] - evals[0][1],
        "evals": evals,
    }


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gsm8k"))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--objectives", nargs="+", default=["grpo"], help="presets/<name>.yaml")
    p.add_argument("--steps", type=int, default=1000, help="training steps of each RL run")
    p.add_argument("--minutes", type=float, default=None, help="also stop each RL run after this")
    p.add_argument("--sft-steps", type=int, default=300, help="optimizer steps of an SFT stage")
    p.add_argument("--sft-stages", type=int, default=3, help="SFT runs of each warm start")
    p.add_argument("--train-overrides", nargs="*", default=[], help="key=value for each RL run")
    p.add_argument("--jobs", type=int, default=1, help="jobs side by side")
    args = p.parse_args(argv)
    for name in args.objectives:
        if not (PRESETS / f"{name}.yaml").exists():
            p.error(f"--objectives: no preset {PRESETS / name}.yaml")
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out)
    with ThreadPoolExecutor(args.jobs) as pool:

        def warm(seed: int) -> dict:
            return warm_start(args.out, data, seed, args.sft_steps, args.sft_stages)

        sft = dict(zip(args.seeds, pool.map(warm, args.seeds)))
        plan = [(s, o) for o in args.objectives for s in args.seeds]
        budget = [f"runner.max_steps={args.steps}", f"runner.max_minutes={args.minutes or 'null'}"]
        budget += args.train_overrides
        runs = list(pool.map(lambda so: reinforce(args.out, data, *so, budget), plan))
    report = {
        "warm_start_dev": {s: r["held_out_accuracy"] for s, r in sft.items()},
        "runs": runs,
        "objectives": {
            o: {
                k: spread([r[k] for r in runs if r["objective"] == o])
                for k in ("start", "best", "last", "gain", "steps")
            }
            for o in args.objectives
        },
    }
    (args.out / "recipe.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return report


if __name__ == "__main__":
    main()
