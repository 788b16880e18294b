"""Configs as users meet them through the command: every mistake one named line with its fix from
``tidal config`` and ``tidal train`` alike (never a traceback, no run folder), printed configs
that load back to the same config, files that compose, decided values kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tidal import cli
from tidal.config import ConfigError, EmbodiedConfig, describe, load_config, to_yaml
from tidal.config.llm import LLMConfig
from tidal.config.schema import decisions
from tidal.runners.preflight import check_embodied_run

ROOT = Path(__file__).resolve().parent.parent
CARTPOLE = ROOT / "examples" / "embodied" / "cartpole_ppo.yaml"
PENDULUM_SAC = ROOT / "examples" / "embodied" / "pendulum_sac.yaml"
ARITH = ROOT / "examples" / "llm" / "arith_grpo.yaml"
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))  # presets: partial files over defaults

# (config, overrides, the key the error starts with, a word of its fix): mistakes a user makes,
# none of them the ones issue 49 lists
MISTAKES = [
    (CARTPOLE, ["env.total_num_envs=0"], "env.total_num_envs", ">= 1"),
    (CARTPOLE, ["rollout.num_steps=-4"], "rollout.num_steps", ">= 1"),
    (CARTPOLE, ["algorithm.gamma=1.5"], "algorithm.gamma", "[0, 1]"),
    (CARTPOLE, ["actor.optimizer=sgd"], "actor.optimizer", "adamw"),
    (CARTPOLE, ["actor.lr_schedule=exponential"], "actor.lr_schedule", "cosine"),
    (CARTPOLE, ["runner.eval_interval=-1"], "runner.eval_interval", ">= 0"),
    (CARTPOLE, ["runner.experiment=a/b"], "runner.experiment", "folder name"),
    (CARTPOLE, ["env.adapter=mujoco"], "env.adapter", "gymnasium"),
    (CARTPOLE, ["env.id=CartPole-v9"], "env.id", "CartPole-v9"),
    (CARTPOLE, ["env.obs_mode=pixels"], "env.obs_mode", "metaworld"),
    (CARTPOLE, ["model.hidden_sizes=64"], "model.hidden_sizes", "[a,b]"),
    (CARTPOLE, ["model.kwargs={hidden: 3}"], "model.kwargs.hidden", "it takes"),
    (CARTPOLE, ["cluster.device=tpu"], "cluster.device", "cuda"),
    (CARTPOLE, ["cluster.torch_threads=0"], "cluster.torch_threads", ">= 1"),
    (CARTPOLE, ["learning_rate=1e-3"], "learning_rate", "actor.lr"),
    (CARTPOLE, ["algorithm.clip_coef=0.2"], "algorithm.clip_coef", "algorithm.clip_ratio_low"),
    (CARTPOLE, ["env.num_envs=16"], "env.num_envs", "env.total_num_envs"),
    (CARTPOLE, ["runner.total_timesteps=1000"], "runner.total_timesteps", "max_env_steps"),
    (CARTPOLE, ["algorithm.entropy_coeff=0.01"], "algorithm.entropy_coeff", "entropy_bonus"),
    (CARTPOLE, ["algorithm.anneal_lr=true"], "algorithm.anneal_lr", "lr_schedule=linear"),
    (CARTPOLE, ["--runner.max_steps=3"], "override '--runner.max_steps=3'", "runner.max_steps=3"),
    (CARTPOLE, ["++runner.seed=3"], "override '++runner.seed=3'", "runner.seed=3"),
    (CARTPOLE, ["runner.max_steps"], "override 'runner.max_steps'", "runner.max_steps=VALUE"),
    (CARTPOLE, ["~algorithm.dual_clip"], "override '~algorithm.dual_clip'", "dual_clip=null"),
    (CARTPOLE, ["runner.seed=one"], "runner.seed", "whole number"),
    (CARTPOLE, ["env.auto_reset=sometimes"], "env.auto_reset", "true or false"),
    (CARTPOLE, ["rollout.max_staleness=-1"], "rollout.max_staleness", ">= 0"),
    (CARTPOLE, ["algorithm.adv_type=grpo"], "env.group_size", "groups of 2"),
    (CARTPOLE, ["actor.fsdp.cpu_offload=true"], "actor.fsdp.cpu_offload", "actor.strategy=fsdp2"),
    (CARTPOLE, ["model.path=/no/such/policy"], "model.path", "/no/such/policy"),
    (CARTPOLE, ["reward.enabled=true", "reward.name=nope"], "reward.name", "scale"),
    (CARTPOLE, ["runner.loggers=[jsonl,csv]"], "runner.loggers", "tensorboard"),
    (CARTPOLE, ["cluster=local"], "cluster", "cluster.backend"),
    (CARTPOLE, ["cluster.placement={env:'0'}"], "cluster.placement", "{env: '0'}"),
    (CARTPOLE, ["cluster.placement={env: null}"], "cluster.placement.env", "cannot be null"),
    (CARTPOLE, ["rollout.weight_sync=nccl"], "rollout.weight_sync", "collective"),
    (CARTPOLE, ["algorithm.name=sac"], "algorithm.name", "Box"),
    (PENDULUM_SAC, ["algorithm.name=ppo"], "algorithm.critic_lr", "algorithm.name=sac"),
    (CARTPOLE, ["model.name=sac_mlp"], "model.name", "algorithm.name=sac"),
    (PENDULUM_SAC, ["algorithm.tau=2"], "algorithm.tau", "(0, 1]"),
    (PENDULUM_SAC, ["model.name=mlp"], "model.name", "sac_mlp"),
    (CARTPOLE, ["runner.task=llm"], "env", "runner.task: embodied"),
    (ARITH, ["rollout.num_steps=4"], "rollout.num_steps", "runner.task: embodied"),
    (ARITH, ["rollout.group_size=0"], "rollout.group_size", ">= 1"),
    (ARITH, ["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    (ARITH, ["data.task=sudoku"], "data.task", "arithmetic"),
    (ARITH, ["rollout.engine=sglang"], "rollout.engine", "vllm"),
    (ARITH, ["algorithm.kl_in=both"], "algorithm.kl_in", "reward"),
    (ARITH, ["rollout.dtype=float64"], "rollout.dtype", "bfloat16"),
    (ARITH, ["num_generations=8"], "num_generations", "rollout.group_size"),
    (ARITH, ["algorithm.beta=0.04"], "algorithm.beta", "algorithm.kl_coef"),
    (ARITH, ["data.path=/no/such.jsonl"], "data.path", "/no/such.jsonl"),
    (ARITH, ["rollout.server_urls=http://x"], "rollout.server_urls", "[a,b]"),
    (ARITH, ["reward.name=exact_mach"], "reward.name", "exact_match"),
]


def run_cli(capsys, argv) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_named_line(code: int, err: str, key: str, fix: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("tidal:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"tidal: config error: {key}"), errors[0]
    assert fix in errors[0], errors[0]


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize(
    ("path", "overrides", "key", "fix"),
    MISTAKES,
    ids=[f"{p.stem}:{' '.join(o)}" for p, o, _, _ in MISTAKES],
)
def test_a_mistake_is_one_named_line_from_config_and_train(
    tmp_path, capsys, command, path, overrides, key, fix
):
    runs = tmp_path / "runs"
    code, err = run_cli(capsys, [command, str(path), *overrides, f"runner.run_dir={runs}"])
    assert_one_named_line(code, err, key, fix)
    assert not runs.exists()  # nothing written but the log


@pytest.mark.parametrize("command", ["config", "train"])
def test_file_mistakes_name_the_file_and_line(tmp_path, capsys, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("runner:\n  max_steps: 3\n   seed: 1\n")
    code, err = run_cli(capsys, [command, str(bad)])
    assert_one_named_line(code, err, f"{bad}:3: not valid YAML", "indentation")
    listed = tmp_path / "list.yaml"
    listed.write_text("- runner\n")
    assert_one_named_line(*run_cli(capsys, [command, str(listed)]), str(listed), "runner:")
    assert_one_named_line(
        *run_cli(capsys, [command, str(tmp_path / "missing.yaml")]), "config file", "missing"
    )
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("algorithm:\n  total_timesteps: 5\n")
    code, err = run_cli(capsys, [command, str(CARTPOLE), str(unknown)])
    assert_one_named_line(code, err, "algorithm.total_timesteps: no such key", str(unknown))


def load(path: Path, overrides=()):
    schema = LLMConfig if "llm" in path.parts else EmbodiedConfig
    return load_config(schema, path, list(overrides))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_prints_yaml_that_loads_back_to_the_same_config(tmp_path, path):
    cfg = load(path)
    printed = describe(cfg)
    assert isinstance(yaml.safe_load(printed), dict)
    again = tmp_path / "printed.yaml"
    again.write_text(printed)
    reloaded = load_config(type(cfg), again)
    assert reloaded == cfg
    assert decisions(reloaded) == decisions(cfg)


def test_tidal_config_output_is_accepted_by_tidal_config(tmp_path, capsys):
    assert cli.main(["config", str(CARTPOLE)]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "my.yaml").write_text(printed)
    assert cli.main(["config", str(tmp_path / "my.yaml")]) == 0
    assert capsys.readouterr().out == printed
    assert "weight_sync: auto  # decided: collective" in printed
    assert "\nreplay:" not in printed and "\nsft:" not in printed  # sections a PPO run ignores


def test_a_saved_config_keeps_what_was_written_and_a_rerun_decides_afresh(tmp_path):
    cfg = load_config(EmbodiedConfig, CARTPOLE)
    check_embodied_run(cfg)
    assert (cfg.algorithm.use_decoupled_loss, cfg.rollout.weight_sync) == (False, "collective")
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    written = yaml.safe_load(saved.read_text())
    assert written["algorithm"]["use_decoupled_loss"] is None
    assert written["rollout"]["weight_sync"] == "auto"
    assert written["decided"]["algorithm.use_decoupled_loss"] is False
    assert written["decided"]["rollout.weight_sync"] == "collective"
    rerun = load_config(EmbodiedConfig, saved, ["rollout.max_staleness=2"])
    check_embodied_run(rerun)
    assert rerun.algorithm.use_decoupled_loss is True
    assert rerun.rollout.weight_sync == "channel"
    same = load_config(EmbodiedConfig, saved)
    check_embodied_run(same)
    assert same == cfg


def test_files_merge_left_to_right_then_overrides(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("actor:\n  lr: 0.001\nrunner:\n  max_steps: 7\n")
    later = tmp_path / "later.yaml"
    later.write_text("runner:\n  max_steps: 9\n")
    cfg = load_config(EmbodiedConfig, [CARTPOLE, preset, later], ["actor.lr=0.002"])
    base = load_config(EmbodiedConfig, CARTPOLE)
    assert (cfg.actor.lr, cfg.runner.max_steps) == (0.002, 9)
    assert cfg.env == base.env and cfg.algorithm == base.algorithm
    args = cli.main(["config", str(CARTPOLE), str(preset), "runner.seed=5"])
    assert args == 0


@pytest.mark.parametrize(
    ("path", "key", "algorithm"),
    [
        (CARTPOLE, "algorithm.tau=0.01", "algorithm.name=sac"),
        (CARTPOLE, "algorithm.utd_ratio=4", "algorithm.name=sac"),
        (CARTPOLE, "replay.batch_size=512", "algorithm.name=sac"),
        (PENDULUM_SAC, "algorithm.vf_coef=1.0", "algorithm.name=ppo"),
        (PENDULUM_SAC, "algorithm.adv_type=grpo", "algorithm.name=ppo"),
    ],
)
def test_a_key_of_another_algorithm_is_refused_saying_which_reads_it(path, key, algorithm):
    schema_key = key.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{schema_key}: applies only with {algorithm}"):
        load_config(EmbodiedConfig, path, [key])


def test_the_printed_config_shows_only_the_keys_the_algorithm_reads():
    ppo = describe(load_config(EmbodiedConfig, CARTPOLE))
    sac = describe(load_config(EmbodiedConfig, PENDULUM_SAC))
    for key in ("tau:", "utd_ratio:", "num_critics:", "\nreplay:"):
        assert key not in ppo and key in sac, key
    for key in ("gae_lambda:", "vf_coef:", "update_epochs:", "adv_type:"):
        assert key in ppo and key not in sac, key


def test_the_half_comes_from_the_last_file_that_names_it(tmp_path):
    import argparse

    task, cfg = cli._config(argparse.Namespace(config=[str(ARITH)], overrides=[]))
    assert task == "llm" and isinstance(cfg, LLMConfig)
    with pytest.raises(ConfigError, match=r"runner.task: expected one of"):
        cli._config(argparse.Namespace(config=[str(ARITH)], overrides=["runner.task=vision"]))


def test_aliases_name_keys_that_exist():
    from tidal.config import field_help
    from tidal.config.aliases import ALIASES

    keys = set(field_help(EmbodiedConfig)) | set(field_help(LLMConfig))
    leaves = {key.rpartition(".")[2] for key in keys}
    for name, (_, target, _) in ALIASES.items():
        assert target in keys, f"{name} -> {target}"
        assert name not in leaves, f"{name} is a key of tidal's own: the alias would never show"


def test_serve_and_export_name_a_missing_model_or_run_in_one_line(tmp_path, capsys):
    code, err = run_cli(capsys, ["serve", "--model", str(tmp_path / "none")])
    assert code == 2 and "Traceback" not in err
    assert err.startswith("tidal: usage error: --model: no such folder"), err
    code, err = run_cli(capsys, ["export", str(tmp_path), "-o", str(tmp_path / "out")])
    assert_one_named_line(code, err, "RUN:", "config.yaml")


def test_one_name_per_config_concept():
    import tidal.config as config
    from tidal.config import embodied, llm

    assert not hasattr(config, "RewardConfig") and not hasattr(config, "SFTConfig")
    assert embodied.EmbodiedConfig().reward.__class__.__name__ == "RewardModelConfig"
    assert llm.LLMConfig().reward.__class__.__name__ == "LLMRewardConfig"
    assert {
        embodied.EmbodiedConfig().sft.__class__.__name__,
        llm.LLMConfig().sft.__class__.__name__,
    } == {
        "EmbodiedSFTConfig",
        "LLMSFTConfig",
    }


REACH_VLA = ROOT / "examples" / "embodied" / "metaworld_reach_vla.yaml"


@pytest.fixture(scope="module")
def cartpole_checkpoint(tmp_path_factory):
    runs = tmp_path_factory.mktemp("eval") / "runs"
    argv = ["train", str(CARTPOLE), "runner.max_steps=1", f"runner.run_dir={runs}"]
    assert cli.main([*argv, "runner.progress=false", "runner.eval_interval=0"]) == 0
    return runs / "cartpole_ppo" / "checkpoints"


@pytest.mark.parametrize(
    ("argv", "key", "fix"),
    [
        (["model.name=vla"], "model.name", "flat Box"),
        (["env.id=Nope-v0"], "env.id", "Nope-v0"),
        (["--episodes", "0"], "--episodes", ">= 1"),
        (["learning_rate=3"], "learning_rate", "actor.lr"),
    ],
)
def test_eval_mistakes_are_one_named_line(tmp_path, capsys, cartpole_checkpoint, argv, key, fix):
    runs = tmp_path / "runs"
    command = ["eval", str(CARTPOLE), "--checkpoint", str(cartpole_checkpoint)]
    code, err = run_cli(capsys, [*command, *argv, f"runner.run_dir={runs}"])
    assert_one_named_line(code, err, key, fix)
    assert not runs.exists()


@pytest.mark.parametrize(
    ("argv", "key", "fix"),
    [
        (["model.name=cnn"], "model.kwargs.hidden_size", "it takes"),
        (["sft.steps=0"], "sft.steps", ">= 1"),
        (["sft.lr=-1"], "sft.lr", "> 0"),
        (["algorithm.name=ppo2"], "algorithm.name", "ppo, sac"),
        (["model.path=null"], "model.path", "set it"),
    ],
)
def test_sft_mistakes_are_one_named_line(tmp_path, capsys, argv, key, fix):
    runs = tmp_path / "runs"
    code, err = run_cli(capsys, ["sft", str(REACH_VLA), *argv, f"runner.run_dir={runs}"])
    assert_one_named_line(code, err, key, fix)
    assert not runs.exists()


class _Launched(Exception):
    pass


@pytest.mark.parametrize(
    ("overrides", "dtype"), [([], "float32"), (["rollout.dtype=bfloat16"], "bfloat16")]
)
def test_the_servers_run_in_rollout_dtype(monkeypatch, tmp_path, overrides, dtype):
    """rollout.dtype reaches tidal's server group and vLLM's arguments; unset, model.dtype does."""
    from tidal.rollout.servers import TidalServers, VLLMServers
    from tidal.workers.inference_worker import InferenceServerWorker

    cfg = load_config(LLMConfig, ARITH, overrides)
    asked = {}

    def create_group(*args, **kwargs):
        asked.update(kwargs)
        raise _Launched

    monkeypatch.setattr(InferenceServerWorker, "create_group", create_group)
    with pytest.raises(_Launched):
        TidalServers(cfg, None, None, tmp_path).launch()
    assert asked["dtype"] == dtype
    assert VLLMServers(cfg, None, None, tmp_path).server_args()[:2] == ["--dtype", dtype]
