"""Language runs end to end: presets, resuming, Ray servers with a sharded trainer, restarts."""

import json
import threading
from pathlib import Path

import pytest
import torch

from tidal.config import load_config
from tidal.config.llm import LLMConfig
from tidal.rollout.rewards import register_reward


@pytest.mark.parametrize(
    "preset", ["sync", "throughput", "stable", "grpo", "dr_grpo", "dapo", "gspo", "cispo"]
)
def test_presets_run_the_async_loop_and_resume(arith_model, tmp_path, preset):
    from tidal.runners.llm.train import LLMRunner

    presets = Path(__file__).parent.parent / "examples" / "llm" / "presets"
    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=3",
        "runner.eval_interval=3",
        "data.eval_size=8",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "rollout.max_concurrent_rollouts=8",
        "runner.experiment=e",
    ]
    extra = ["algorithm.loss_agg=seq-mean-token-mean"] if preset == "stable" else []
    cfg = load_config(LLMConfig, presets / f"{preset}.yaml", overrides + extra)
    runner = LLMRunner(cfg)
    try:
        summary = runner.run()
    finally:
        runner.close()
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] <= cfg.rollout.max_staleness for r in steps)
    assert "eval/accuracy" in steps[-1] and "train/tokens_per_s" in steps[-1]
    if preset == "sync":
        cfg = load_config(
            LLMConfig,
            presets / f"{preset}.yaml",
            overrides + ["runner.max_steps=4", f"runner.resume_from={summary['checkpoint']}"],
        )
        runner = LLMRunner(cfg)
        try:
            assert runner.staleness.snapshot()["accepted"] == 3 * 4 and runner.version == 3
            resumed = runner.run()
        finally:
            runner.close()
        assert resumed["steps"] == 4
    assert torch.isfinite(torch.tensor([r["train/policy_loss"] for r in steps])).all()


@register_reward("test_digit_share")
def _digit_share(completion: str, answer: str, **_) -> float:
    """A reward with spread for a model that rarely answers right: every step trains."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def test_a_synchronous_run_resumed_mid_way_ends_as_one_run_straight_through(arith_model, tmp_path):
    """8 episodes in flight read records ahead of each batch: the checkpoint rewinds over them,
    and each episode samples with seeds drawn from runner.seed and its record's place in the
    data stream, so the resumed run makes the same rollouts, rewards and weights."""
    from safetensors.torch import load_file

    from tidal.runners.llm.train import LLMRunner

    def run(name, steps, *extra):
        cfg = load_config(
            LLMConfig,
            Path(__file__).parent.parent / "examples" / "llm" / "presets" / "sync.yaml",
            [
                f"model.path={arith_model}",
                f"runner.run_dir={tmp_path / name}",
                "runner.progress=false",
                "runner.eval_interval=0",
                "runner.save_interval=2",
                f"runner.max_steps={steps}",
                "rollout.batch_size=4",
                "rollout.group_size=4",
                "rollout.max_concurrent_rollouts=8",
                "reward.name=test_digit_share",
                "actor.lr=1e-3",
                *extra,
            ],
        )
        with LLMRunner(cfg) as runner:
            summary = runner.run()
        rows = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        rewards = [json.loads(r)["rollout/reward_mean"] for r in rows if json.loads(r)["step"] >= 1]
        weights = load_file(Path(summary["checkpoint"]) / "model.safetensors")
        return rewards, weights

    straight = run("straight", 4)
    first_half = run("resumed", 2)[0]
    resumed = run("resumed", 4, "runner.resume_from=auto")
    assert len(set(straight[0])) > 1  # the rewards differ: the steps trained
    assert resumed[0] == straight[0] and first_half == straight[0][:2]
    assert all(torch.equal(straight[1][k], resumed[1][k]) for k in straight[1])


@pytest.mark.ray
def test_ray_servers_and_a_sharded_data_parallel_trainer_run_the_loop_and_resume(
    ray_session, arith_model, tmp_path
):
    """The whole loop on Ray: a server process and two trainer ranks, FSDP2-sharded (every
    rank gathers the weights as rank 0 streams them to the server over the collective link;
    the checkpoint is sharded), in-place pauses, then a resume on the same layout. (Two DDP
    ranks take the same steps as one: test_llm_trainer.py,
    and as FSDP2's: tests/test_strategies.py.)"""
    from tidal.runners.llm.train import LLMRunner

    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=2",
        "runner.eval_interval=2",
        "data.eval_size=8",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "rollout.max_staleness=1",
        "algorithm.use_decoupled_loss=true",
        "rollout.pause_mode=in_place",
        "cluster.backend=ray",
        "cluster.devices_per_node=3",
        "cluster.placement={rollout: '0', actor: '1-2'}",
        "actor.strategy=fsdp2",
    ]
    summaries = []
    for extra in ([], ["runner.max_steps=3"]):
        if summaries:
            extra.append(f"runner.resume_from={summaries[-1]['checkpoint']}")
        runner = LLMRunner(load_config(LLMConfig, None, overrides + extra))
        try:
            summaries.append(runner.run())
        finally:
            runner.close()
    rows = [
        json.loads(x)
        for x in (Path(summaries[-1]["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["version"] for r in rows if r["step"] >= 1] == [1, 2, 3]
    assert summaries[-1]["steps"] == 3 and Path(summaries[-1]["checkpoint"]).is_dir()


@pytest.mark.ray
def test_a_killed_inference_server_restarts_the_llm_run(ray_session, arith_model, tmp_path):
    """The inference server's Ray actor killed after the first checkpoint: the run restarts its
    groups, resumes from the newest checkpoint and finishes, each step logged once."""
    import time

    import ray

    from tidal.runners.llm.train import LLMRunner
    from tidal.runners.loop import run_with_restarts

    overrides = [
        f"model.path={arith_model}",
        f"runner.run_dir={tmp_path}",
        "runner.progress=false",
        "runner.max_steps=4",
        "runner.eval_interval=0",
        "runner.save_interval=1",
        "runner.max_restarts=1",
        "runner.timeout_s=60",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "cluster.placement={rollout: '0', actor: '1'}",
    ]
    runners = []

    def kill_server_after_first_checkpoint():
        deadline = time.time() + 240
        while time.time() < deadline and not (
            runners and list(runners[0].run_dir.glob("checkpoints/step_000001"))
        ):
            time.sleep(0.05)
        ray.kill(runners[0].rollout.servers._ranks[0].actor, no_restart=True)

    killer = threading.Thread(target=kill_server_after_first_checkpoint, daemon=True)
    killer.start()
    summary = run_with_restarts(
        lambda c, run_dir: runners.append(LLMRunner(c, run_dir)) or runners[-1],
        load_config(LLMConfig, None, overrides),
    )
    killer.join(5)
    assert summary["restarts"] == 1 and summary["steps"] == 4 and len(runners) == 2
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
