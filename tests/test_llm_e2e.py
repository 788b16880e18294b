"""The language half on a user's own data: a dataset file, a chat template, a configured reward,
`tidal sft` -> `tidal train` (GRPO) -> `tidal eval`, and the checks that run before anything
starts."""

import asyncio
import itertools
import json
import math
from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.config.llm import LLMConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "llm" / "gsm8k_grpo.yaml"
TINY = [
    "model.hidden=32",
    "model.layers=1",
    "model.heads=2",
    "model.max_positions=192",
    "runner.progress=false",
    "sft.batch_size=8",
    "sft.lr=3e-3",
    "data.eval_size=4",
    "sft.eval_size=4",
    "rollout.max_new_tokens=12",
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "rollout.max_concurrent_rollouts=4",
    "runner.eval_interval=2",
    "runner.save_interval=2",
    "reward.kwargs={timeout_s: 20}",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo config shrunk, and the tiny chat model `tidal sft` built and warm-started."""
    from tidal.runners.llm.sft import run_sft

    root = tmp_path_factory.mktemp("gsm8k")
    overrides = [*TINY, f"model.path={root}/model", f"runner.run_dir={root}/runs"]
    summary = run_sft(load_config(LLMConfig, DEMO, [*overrides, "sft.steps=30"]))
    return overrides, summary


def test_sft_builds_a_chat_model_and_learns_the_assistant_turns(demo):
    from tidal.models.llm import load_tokenizer

    overrides, summary = demo
    tokenizer = load_tokenizer(summary["model_path"])
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # 30 steps on the worked answers: the loss falls well below where it started
    assert summary["final_loss"] < 0.6 * summary["first_loss"], summary
    assert 0.0 <= summary["held_out_accuracy"] <= 1.0
    run_dir = Path(summary["run_dir"])  # tidal sft writes a run folder as every command does
    assert run_dir.name == "gsm8k_grpo-sft" and (run_dir / "config.yaml").is_file()
    assert "sft: built a tiny model" in (run_dir / "sft.log").read_text()


def test_grpo_on_the_dataset_resumes_its_data_position_and_tidal_eval_scores_it(
    demo, tmp_path, capsys
):
    from tidal.cli import main
    from tidal.runners.llm.train import LLMRunner

    overrides, _ = demo
    with LLMRunner(load_config(LLMConfig, DEMO, [*overrides, "runner.max_steps=2"])) as runner:
        first = runner.run()
    rows = [
        json.loads(x) for x in (Path(first["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["version"] for r in steps] == [1, 2]
    assert steps[-1]["rollout/reward_errors"] == 0 and steps[-1]["rollout/reward_timeouts"] == 0
    assert {"eval/accuracy", "eval/reward_mean"} <= set(steps[-1])
    saved = json.loads((Path(first["checkpoint"]) / "meta.json").read_text())["data"]
    assert saved["position"] > 0 and saved["size"] == 200

    resumed_cfg = load_config(
        LLMConfig,
        DEMO,
        [*overrides, "runner.max_steps=3", f"runner.resume_from={first['checkpoint']}"],
    )
    with LLMRunner(resumed_cfg) as runner:
        assert runner.train_data.state_dict() == saved  # the data position came back
        assert runner.run()["steps"] == 3

    code = main(["eval", str(DEMO), *overrides, "--n", "2", "--checkpoint", first["checkpoint"]])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 4 and summary["checkpoint"] == first["checkpoint"]
    assert {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/sampled_reward_mean"} <= set(
        summary
    )
    samples = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "samples.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 4 * 3 and {s["sample"] for s in samples} == {"greedy", 0, 1}
    assert all(
        "<|im_start|>assistant\n" in s["prompt"] and "step by step" in s["prompt"] for s in samples
    )
    assert (
        summary["eval/accuracy"]
        == sum(s["reward"] > 0 for s in samples if s["sample"] == "greedy") / 4
    )


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "data.prompt_key=problem",
            r"data.prompt_key: '.*train.jsonl' has no field 'problem'; "
            r"its fields: question, answer",
        ),
        ("data.eval_path=missing.parquet", r"data.eval_path: no such file 'missing.parquet'"),
        (
            "reward.name=nope",
            r"reward.name: unknown reward 'nope'; "
            r"registered: exact_match, math_verify, regex_match",
        ),
        ("reward.name=json:nope", r"reward.name: module 'json' has no function 'nope'"),
        ("model.dtype=float8", r"model.dtype: expected one of"),
        (
            "data.chat_template=false",
            r"data.system_prompt: a system prompt needs data.chat_template=true",
        ),
    ],
)
def test_bad_data_reward_and_model_keys_fail_before_the_run_folder(
    demo, tmp_path, capsys, override, message
):
    import re

    from tidal.cli import main

    overrides, _ = demo
    assert main(["train", str(DEMO), *overrides, f"runner.run_dir={tmp_path}/runs", override]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_a_chat_template_the_tokenizer_lacks_is_a_config_error(tmp_path, capsys):
    from tidal.cli import main
    from tidal.inference.tiny import save_tiny_model

    save_tiny_model(tmp_path / "char", hidden=16, layers=1, heads=2)
    code = main(
        [
            "train",
            str(DEMO),
            f"model.path={tmp_path}/char",
            f"runner.run_dir={tmp_path}/runs",
            "rollout.max_new_tokens=8",
        ]
    )
    assert code == 2 and "data.chat_template: the tokenizer of" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_reward_receives_the_records_other_fields():
    from tidal.inference import GenerationConfig, ModelResponse
    from tidal.inference.tiny import byte_level_tokenizer
    from tidal.rollout.workflows import RLVRWorkflow

    tok = byte_level_tokenizer()
    seen = []

    def reward(completion, answer, unit, **record):
        seen.append((completion, answer, unit, record["id"]))
        return 1.0

    class Client:
        async def agenerate_n(self, req, n):
            out = tok.encode("7 cm", add_special_tokens=False)
            return [
                ModelResponse(req.input_ids, out, [-0.1] * len(out), [0] * len(out))
                for _ in range(n)
            ]

    wf = RLVRWorkflow(Client(), tok, reward, GenerationConfig(), group_size=2)
    batch = asyncio.run(wf({"prompt": "How long?", "answer": "7", "unit": "cm", "id": "r1"}))
    assert batch.rewards.tolist() == [1.0, 1.0] and seen == [("7 cm", "7", "cm", "r1")] * 2


def test_pass_at_k_matches_counting_subsets():
    from tidal.rollout.evaluation import pass_at_k, pass_ks

    for n, correct in [(5, 0), (5, 2), (6, 5), (4, 4)]:
        outcomes = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert math.isclose(
                pass_at_k(n, correct, k), sum(any(s) for s in subsets) / len(subsets)
            )
    assert pass_ks(1) == [1] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


def test_sft_with_no_held_out_problems_scores_none(demo, tmp_path):
    """``sft.eval_size: 0``: an agent's demonstrations, which single-turn greedy answers cannot
    score, report no held-out accuracy rather than a misleading 0."""
    from tidal.runners.llm.sft import run_sft

    overrides, _ = demo
    keys = [f"model.path={tmp_path}/m", f"runner.run_dir={tmp_path}/runs", "sft.steps=1"]
    summary = run_sft(load_config(LLMConfig, DEMO, [*overrides, *keys, "sft.eval_size=0"]))
    assert summary["held_out_accuracy"] is None and (tmp_path / "m" / "config.json").is_file()


def test_sft_on_conversations_learns_only_the_assistant_turns(demo, tmp_path):
    from tidal.models.llm import load_tokenizer
    from tidal.runners.llm.common import sft_examples
    from tidal.runners.llm.preflight import check_llm_sft

    overrides, summary = demo
    chats = ROOT / "examples" / "llm" / "data" / "sft.jsonl"
    keys = [f"data.path={chats}", "data.messages_key=messages", "data.system_prompt=null"]
    cfg = load_config(LLMConfig, DEMO, [*overrides, *keys])
    check_llm_sft(cfg)
    tokenizer = load_tokenizer(summary["model_path"])
    examples = sft_examples(cfg, tokenizer, tmp_path)
    rows = [json.loads(x) for x in chats.read_text().splitlines()]
    assert len(examples) == len(rows) == 24
    for (ids, mask), row in zip(examples, rows):
        learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert learned == "".join(f"{reply}<|im_end|>" for reply in replies)


@pytest.mark.parametrize("objective", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_the_gsm8k_recipe_applies_each_objective_preset_over_the_demo(objective):
    import importlib.util

    import yaml

    spec = importlib.util.spec_from_file_location("recipe", DEMO.parent / "gsm8k_recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    files = recipe.objective_files(objective)
    assert files[0] == DEMO
    cfg = load_config(LLMConfig, files, [*recipe.COMMON, *recipe.SFT])
    preset = yaml.safe_load(files[1].read_text())
    for section, keys in preset.items():
        for key, value in keys.items():
            assert getattr(getattr(cfg, section), key) == value, (section, key)
    demo = load_config(LLMConfig, DEMO)
    assert (cfg.data.path, cfg.model.path) == (demo.data.path, demo.model.path)  # the demo's
    assert cfg.sft.lr_schedule == "constant" and cfg.sft.lr == 2e-3
    assert cfg.rollout.max_new_tokens == 32 and cfg.data.system_prompt is None
