"""Config loading and validation: every bad value names its key and the rule."""

from pathlib import Path

import pytest

from tidal.config import ConfigError, EmbodiedConfig, load_config, validate_embodied

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "embodied").glob("*.yaml"))


def check(overrides):
    validate_embodied(load_config(EmbodiedConfig, None, overrides))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_validate(path):
    cfg = load_config(EmbodiedConfig, path)
    worlds = validate_embodied(cfg)
    assert worlds["env"] >= 1


def test_overrides_apply_with_types():
    cfg = load_config(EmbodiedConfig, EXAMPLES[0], ["env.total_num_envs=16", "algorithm.dual_clip=3.0", "model.hidden_sizes=[32,32]"])
    assert cfg.env.total_num_envs == 16 and cfg.algorithm.dual_clip == 3.0 and cfg.model.hidden_sizes == [32, 32]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["env.nope=1"], r"env.nope: Key 'nope' not in 'EnvConfig'"),
        (["env.total_num_envs=many"], r"env.total_num_envs: Value 'many' of type 'str' could not be converted to Integer"),
        (["algorithm.adv_type=ppo"], r"algorithm.adv_type: expected one of .*gae.*got 'ppo'"),
        (["actor.global_batch_size=300"], r"actor.global_batch_size: the 1024 samples of a step .* batches of 300"),
        (["actor.micro_batch_size=48"], r"actor.global_batch_size: 256 must be a multiple of micro_batch_size x actor ranks = 48 x 1"),
        (["env.total_num_envs=6", "env.pipeline_stage_num=4"], r"env.total_num_envs: 6 must divide evenly over 1 env ranks x 4 pipeline stages"),
        (["algorithm.adv_type=grpo", "env.group_size=4"], r"env.auto_reset: adv_type grpo scores whole episodes"),
        (["algorithm.adv_type=grpo", "env.group_size=3", "env.auto_reset=false"], r"env.group_size: groups of 3 must not straddle"),
        (["algorithm.reward_type=action"], r"algorithm.reward_type: 'action' needs a value per action"),
        (["cluster.placement={env: '0', rollout: '0'}"], r"cluster.placement: component 'actor' is not placed"),
        (["cluster.placement={env: '0', rollout: '0', actor: '0-1'}"], r"cluster.placement: a data-parallel actor .* needs cluster.backend=ray"),
        (["cluster.backend=slurm"], r"cluster.backend: expected one of local, ray, got 'slurm'"),
        (["algorithm.dual_clip=0.5"], r"algorithm.dual_clip: must be > 1"),
        (["rollout.num_steps=0"], r"rollout.num_steps: must be >= 1, got 0"),
        (["env.nope"], r"override 'env.nope': expected key.sub=value"),
    ],
)
def test_bad_values_name_key_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(overrides)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(EmbodiedConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(EmbodiedConfig, bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("env:\n  total_num_envs: [1]\n")
    with pytest.raises(ConfigError, match="env.total_num_envs"):
        load_config(EmbodiedConfig, wrong)
