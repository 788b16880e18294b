"""Issue 14 end to end: ``tidal sft`` (demos → behaviour cloning → saved folder) then ``tidal
train`` from that folder, with success rates in the metrics; config errors that name the key."""

import json
from pathlib import Path

import numpy as np
import pytest

from tidal.cli import main
from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.envs import make_env
from tidal.models import build_policy, save_policy
from tidal.runners.preflight import check_embodied, check_embodied_sft

EXAMPLES = Path(__file__).parent.parent / "examples" / "embodied"
VLA = EXAMPLES / "metaworld_reach_vla.yaml"
TINY = [
    "runner.progress=false",
    "runner.loggers=[jsonl]",
    "env.max_episode_steps=50",
    "env.total_num_envs=2",
    "env.eval_num_envs=4",
    "rollout.num_steps=50",
    "actor.global_batch_size=100",
    "actor.micro_batch_size=100",
    "algorithm.update_epochs=1",
    "algorithm.critic_warmup_steps=0",
    "runner.max_steps=2",
    "runner.eval_interval=2",
    "sft.demos=2",
    "sft.steps=30",
    "sft.log_interval=10",
    "cluster.torch_threads=1",
]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_then_train_from_the_saved_policy_reports_success(tmp_path, capsys):
    policy = tmp_path / "policy"
    overrides = [f"runner.run_dir={tmp_path}", f"model.path={policy}", *TINY]
    assert main(["sft", str(VLA), *overrides]) == 0
    sft = json.loads(capsys.readouterr().out)
    assert (policy / "config.json").is_file() and (policy / "model.safetensors").is_file()
    assert sft["final_loss"] < sft["first_loss"] and sft["demos"] == 2
    bc_rows = rows(Path(sft["run_dir"]) / "metrics.jsonl")
    assert [r["step"] for r in bc_rows if "bc/loss" in r] == [1, 10, 20, 30]

    video = ["runner.eval_video=true", "runner.eval_video_envs=2", "runner.eval_video_size=32"]
    sampled = ["runner.eval_sampled=true"]  # a second pass, sampled actions, no video
    assert main(["train", str(VLA), *overrides, *video, *sampled]) == 0
    summary = json.loads(capsys.readouterr().out)
    _assert_eval_videos(Path(summary["run_dir"]), steps=[0, 2], episode_steps=50)
    metrics = rows(Path(summary["run_dir"]) / "metrics.jsonl")
    first = metrics[0]  # the saved policy, evaluated before any RL step on sft's episodes
    assert first["eval/success_rate"] == sft["eval/success_rate"]
    assert first["eval/return_mean"] == pytest.approx(
        sft["eval/return_mean"], rel=1e-5
    )  # the same weights
    # in process (sft, eval) and through the workers (train): one set of names
    assert {k for k in first if k.startswith("eval/")} == {k for k in sft if k.startswith("eval/")}
    assert first["eval/episodes"] == sft["eval/episodes"]
    assert first["eval/return_std"] == pytest.approx(sft["eval/return_std"], rel=1e-4)
    # the same episodes with sampled actions: other returns, reported apart
    assert first["eval_sampled/episodes"] == first["eval/episodes"] == 4
    assert first["eval_sampled/return_mean"] != first["eval/return_mean"]
    assert 0 <= first["eval_sampled/success_rate"] <= 1
    steps = [r for r in metrics if "train/policy_loss" in r]
    assert len(steps) == 2 and all(0 <= r["rollout/success_rate"] <= 1 for r in steps)
    assert "eval_sampled/success_rate/reach-v3" in steps[-1]
    assert (
        "eval/success_rate/reach-v3" in steps[-1]
        and summary["target_metric"] == "eval/success_rate"
    )
    assert (
        summary["best_value"] == steps[-1]["eval/success_rate"]
    )  # the one evaluation after a step

    # tidal eval: the saved policy, then the run's last checkpoint, on the same fresh episodes
    bc = _eval(capsys, [str(VLA), *overrides, "--episodes", "3", "--sampled"])
    assert bc["episodes"] == 3 and bc["checkpoint"] is None
    assert {"eval/success_rate/reach-v3", "eval_sampled/success_rate/reach-v3"} <= set(bc)
    assert bc["eval_sampled/return_mean"] != bc["eval/return_mean"]
    assert (
        _eval(capsys, [str(VLA), *overrides, "--episodes", "3"])["eval/return_mean"]
        == bc["eval/return_mean"]
    )
    last = str(Path(summary["run_dir"]) / "checkpoints")
    trained = _eval(capsys, [str(VLA), *overrides, "--episodes", "3", "--checkpoint", last])
    assert trained["checkpoint"].endswith("step_000002")
    assert (
        trained["eval/return_mean"] != bc["eval/return_mean"]
    )  # the checkpoint's weights, not BC's
    assert json.loads((Path(trained["run_dir"]) / "summary.json").read_text())["episodes"] == 3
    # a checkpoint alone: the policy is built from the config, the checkpoint's weights loaded
    alone = [str(VLA), *overrides, "model.path=null", "--episodes", "3", "--checkpoint", last]
    assert _eval(capsys, alone)["eval/return_mean"] == trained["eval/return_mean"]


def _eval(capsys, args: list[str]) -> dict:
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--episodes", "0"], "--episodes: must be >= 1, got 0"),
        (["--n", "2"], "--n: embodied configs take --episodes and --sampled"),
        (["--checkpoint", "nowhere"], "--checkpoint"),
        (
            ["model.path=null"],
            "model.path: tidal eval needs a saved policy (tidal sft writes one) or --checkpoint",
        ),
    ],
)
def test_bad_embodied_eval_arguments_name_them(tmp_path, capsys, args, message):
    assert main(["eval", str(VLA), f"runner.run_dir={tmp_path}", *args]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before a run folder exists


def _assert_eval_videos(run_dir: Path, steps: list[int], episode_steps: int) -> None:
    """One GIF per evaluation: two envs side by side, a frame per action (not per chunk), and
    frames that change (the arm moves)."""
    from PIL import Image, ImageSequence

    videos = sorted((run_dir / "videos").glob("*.gif"))
    assert [v.name for v in videos] == [f"eval_step{s:06d}.gif" for s in steps]
    for path in videos:
        with Image.open(path) as gif:  # Pillow merges repeated frames, adding their durations
            frames, durations = [], []
            for frame in ImageSequence.Iterator(gif):
                frames.append(np.asarray(frame.convert("RGB")))
                durations.append(frame.info["duration"])
        assert frames[0].shape == (32, 64, 3)
        # the reset, then every action, at 30 fps (GIF stores whole centiseconds: 30 ms)
        assert sum(durations) >= (episode_steps + 1) * 30
        assert any(not np.array_equal(frames[0], f) for f in frames[1:])


def test_target_success_rate_stops_the_run(tmp_path, capsys):
    """A target of 0 is reached at the first evaluation: the run stops there, not at max_steps."""
    policy = tmp_path / "policy"
    overrides = [f"runner.run_dir={tmp_path}", f"model.path={policy}", *TINY, "sft.steps=2"]
    assert main(["sft", str(VLA), *overrides]) == 0
    capsys.readouterr()
    overrides += ["runner.max_steps=4", "runner.eval_interval=1", "runner.target_value=0.0"]
    assert main(["train", str(VLA), *overrides]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 1 and summary["solved_at_step"] == 1


def _sft_examples() -> list[Path]:
    """The MetaWorld examples that ``tidal sft`` warm-starts (they name the policy's folder);
    the SAC ones train from scratch and are validated in tests/test_sac.py."""
    examples = sorted(EXAMPLES.glob("metaworld_*.yaml"))
    return [p for p in examples if load_config(EmbodiedConfig, p).model.path is not None]


@pytest.mark.parametrize("path", _sft_examples(), ids=lambda p: p.name)
def test_manipulation_examples_validate_for_sft(path):
    check_embodied_sft(load_config(EmbodiedConfig, path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env.obs_mode=rgb"], "env.obs_mode: expected one of state, pixels, state+pixels"),
        (["env.image_size=4"], "env.image_size: must be >= 8"),
        (
            ["env.adapter_kwargs={obs_mode: pixels}"],
            "env.adapter_kwargs.obs_mode: set env.obs_mode instead",
        ),
        (["model.kwargs={depth: 3}"], "model.kwargs.depth: policy 'vla' takes no such argument"),
        (["model.kwargs={critic: false}"], "model.kwargs.critic: set model.critic instead"),
        (["model.hidden_sizes=[8]"], "model.hidden_sizes: policy 'vla' does not use it"),
        (  # the name tidal sft and tidal eval reported before they took the training run's
            ["runner.target_metric=eval/return"],
            "runner.target_metric: 'eval/return' is now 'eval/return_mean'",
        ),
    ],
)
def test_bad_manipulation_values_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        check_embodied(load_config(EmbodiedConfig, VLA, overrides))


def test_pixels_need_an_adapter_that_renders():
    cfg = load_config(EmbodiedConfig, None, ["env.obs_mode=pixels"])
    with pytest.raises(ConfigError, match="env.obs_mode: the gymnasium adapter renders no pixels"):
        check_embodied(cfg)


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        (
            "cartpole_ppo.yaml",
            ["model.path=p"],
            "env.adapter: tidal sft collects scripted demonstrations, which the gymnasium adapter",
        ),
        (
            "metaworld_reach_vla.yaml",
            ["model.path=null"],
            "model.path: tidal sft saves the policy there",
        ),
        ("metaworld_reach_vla.yaml", ["sft.demos=0"], "sft.demos: must be >= 1"),
        ("metaworld_reach_vla.yaml", ["sft.action_noise=-1"], "sft.action_noise: must be >= 0"),
        (
            "metaworld_reach_vla.yaml",
            ["sft.lr_schedule=step"],
            "sft.lr_schedule: expected one of constant, linear, cosine",
        ),
        (
            "metaworld_reach_vla.yaml",
            ["sft.steps=10", "sft.warmup_steps=10"],
            "sft.warmup_steps: must be >= 0 and < sft.steps (10)",
        ),
    ],
)
def test_bad_sft_values_name_their_key(config, overrides, message, capsys):
    assert main(["sft", str(EXAMPLES / config), *overrides]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_or_mismatched_saved_policy_is_a_config_error_before_workers(tmp_path, capsys):
    base = [f"runner.run_dir={tmp_path}", *TINY]
    assert main(["train", str(VLA), *base, f"model.path={tmp_path / 'nothing'}"]) == 2
    assert (
        "model.path:" in (err := capsys.readouterr().err) and "is not a saved policy folder" in err
    )
    env = make_env("metaworld", 1, env_id="reach-v3")  # 16 instruction tokens, the example 4
    save_policy(
        build_policy(
            "vla",
            env.observation_space,
            env.action_space,
            1,
            hidden_size=8,
            num_heads=2,
            num_layers=1,
        ),
        tmp_path / "other",
    )
    env.close()
    assert main(["train", str(VLA), *base, f"model.path={tmp_path / 'other'}"]) == 2
    assert "model.path:" in (err := capsys.readouterr().err) and "was saved for observations" in err
    assert (
        main(
            [
                "train",
                str(VLA),
                *base,
                f"model.path={tmp_path / 'other'}",
                "env.num_action_chunks=2",
            ]
        )
        == 2
    )
    assert "env.num_action_chunks:" in capsys.readouterr().err
    assert not (tmp_path / "metaworld_reach_vla").exists()  # stopped before the run folder
