"""Config loading and validation: every bad value names its key and the rule."""

from pathlib import Path

import pytest

from tidal.config import ConfigError, EmbodiedConfig, load_config
from tidal.config.embodied import same_process
from tidal.runners.llm.preflight import check_llm
from tidal.runners.preflight import check_embodied

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "embodied").glob("*.yaml"))


def check(overrides):
    check_embodied(load_config(EmbodiedConfig, None, overrides))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_validate(path):
    cfg = load_config(EmbodiedConfig, path)
    worlds = check_embodied(cfg)
    assert worlds["env"] >= 1


def test_overrides_apply_with_types():
    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES[0],
        ["env.total_num_envs=16", "algorithm.dual_clip=3.0", "model.hidden_sizes=[32,32]"],
    )
    assert (
        cfg.env.total_num_envs == 16
        and cfg.algorithm.dual_clip == 3.0
        and cfg.model.hidden_sizes == [32, 32]
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["env.nope=1"], r"env.nope: no such key; env has: adapter, id, "),
        (
            ["env.total_num_envs=many"],
            r"env.total_num_envs: expects a whole number \(got 'many'\)",
        ),
        (["algorithm.adv_type=ppo"], r"algorithm.adv_type: expected one of .*gae.*got 'ppo'"),
        (
            ["actor.global_batch_size=300"],
            r"actor.global_batch_size: the 1024 samples of a step .* batches of 300",
        ),
        (
            ["actor.micro_batch_size=48"],
            r"actor.micro_batch_size: 48 does not divide a rank's share of actor.global_batch_size "
            r"\(256 = 256 / 1 actor ranks\): e.g. actor.micro_batch_size=32",
        ),
        (
            ["env.total_num_envs=6", "env.pipeline_stage_num=4"],
            r"env.total_num_envs: 6 must divide evenly over 1 env ranks x 4 pipeline stages",
        ),
        (
            ["algorithm.adv_type=grpo", "env.group_size=4"],
            r"env.auto_reset: adv_type grpo scores whole episodes",
        ),
        (
            ["algorithm.adv_type=grpo", "env.group_size=3", "env.auto_reset=false"],
            r"env.group_size: groups of 3 must not straddle",
        ),
        (
            ["algorithm.reward_type=action"],
            r"algorithm.reward_type: 'action' needs a value per action",
        ),
        (
            ["cluster.placement={env: '0', rollout: '0'}"],
            r"cluster.placement: component 'actor' is not placed",
        ),
        (
            ["cluster.placement={env: '0', rollout: '0', actor: '0-1'}"],
            r"cluster.placement: a data-parallel actor .* needs cluster.backend=ray",
        ),
        (
            ["cluster.same_process=['rollout,actor']"],
            r"cluster.same_process: 'rollout,actor': the actor joins torch.distributed",
        ),
        (
            [
                "cluster.placement={env: '0', rollout: '1', actor: '1'}",
                "cluster.same_process=[env]",
            ],
            r"cluster.same_process: 'env' names 1 component\(s\); .* e.g. 'env,rollout'",
        ),
        (
            [
                "cluster.placement={env: '0', rollout: '1', actor: '1'}",
                "cluster.same_process=['env,rollout']",
            ],
            r"cluster.same_process: 'env,rollout': 'rollout' is placed on devices \[1\], 'env' on \[0\]",
        ),
        (
            ["cluster.same_process=['env,env']"],
            r"cluster.same_process: 'env,env' names a component twice",
        ),
        (
            ["cluster.same_process=['env,rollout', 'rollout,env']"],
            r"cluster.same_process: 'rollout,env': component 'rollout' is in two entries",
        ),
        (
            ["cluster.same_process=['env,reward']"],
            r"cluster.same_process: 'env,reward': component 'reward' is not placed",
        ),
        (["cluster.backend=slurm"], r"cluster.backend: expected one of local, ray, got 'slurm'"),
        (
            ["cluster.pin_cpus=true"],
            r"cluster.pin_cpus: pins a process per rank; the local backend",
        ),
        (["algorithm.dual_clip=0.5"], r"algorithm.dual_clip: must be > 1"),
        (["algorithm.kl_coef=-0.1"], r"algorithm.kl_coef: must be >= 0, got -0.1"),
        (["actor.ref_offload=true"], r"actor.ref_offload: there is no KL reference to offload"),
        (
            ["actor.ref_offload=true", "algorithm.kl_coef=0.1", "model.lora.rank=4"],
            r"actor.ref_offload: under model.lora the reference is the trained model",
        ),
        (["algorithm.kl_kind=k9"], r"algorithm.kl_kind: expected one of k1, k2, k3, abs, got 'k9'"),
        (["rollout.num_steps=0"], r"rollout.num_steps: must be >= 1, got 0"),
        (["env.nope"], r"override 'env.nope': expected key.sub=value"),
        (["model.name=transformer"], r"model.name: expected one of .*mlp.*got 'transformer'"),
        (
            ["model.activation=swish"],
            r"model.activation: expected one of tanh, relu, gelu, got 'swish'",
        ),
        (
            ["env.vectorization_mode=threads"],
            r"env.vectorization_mode: expected one of sync, async",
        ),
        (["actor.lr=-0.1"], r"actor.lr: must be > 0, got -0.1"),
        (["runner.timeout_s=-5"], r"runner.timeout_s: must be > 0, got -5.0"),
        (
            ["actor.max_grad_norm=-0.5"],
            r"actor.max_grad_norm: must be > 0 \(or null for no clipping\), got -0.5",
        ),
        (
            ["runner.loggers=[jsonl,neptune]"],
            r"runner.loggers: expected one of jsonl, tensorboard, wandb, mlflow",
        ),
    ],
)
def test_bad_values_name_key_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(overrides)


@pytest.mark.parametrize(
    "overrides,shared",
    [
        (["cluster.backend=ray"], ["env,rollout"]),  # the default placement: all on 0
        (
            ["cluster.backend=ray", "cluster.placement={'env,rollout': '0-1', actor: '1'}"],
            ["env,rollout"],
        ),
        (["cluster.backend=ray", "cluster.placement={env: '0-1', rollout: '0-1', actor: '1'}"], []),
        (["cluster.backend=ray", "env.pipeline_stage_num=2"], []),
        (["cluster.backend=ray", "cluster.same_process=[]"], []),
        ([], []),  # local: every rank is in this process already
    ],
)
def test_env_and_rollout_share_processes_by_default_on_ray_when_placed_in_one_entry(
    overrides, shared
):
    """``cluster.same_process`` unset: env and rollout share their processes on ray when one
    placement entry names both and they take turns (one pipeline stage)."""
    cfg = load_config(EmbodiedConfig, None, overrides)
    assert same_process(cfg) == shared
    check_embodied(cfg)


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


def test_unknown_env_id_and_kwargs_are_config_errors_before_any_worker(tmp_path):
    from tidal.runners import EmbodiedRunner

    for overrides, message in (
        (["env.id=NoSuchEnv-v0"], r"env.id: cannot make 'NoSuchEnv-v0'"),
        (["env.kwargs={gravity: 3}"], r"env.kwargs: cannot make 'CartPole-v1'"),
    ):
        cfg = load_config(EmbodiedConfig, None, [f"runner.run_dir={tmp_path}", *overrides])
        with pytest.raises(ConfigError, match=message):
            EmbodiedRunner(cfg)
    assert not any(tmp_path.iterdir())  # no run folder was made


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.temperature=-1"], r"rollout.temperature: must be >= 0"),
        (
            ["rollout.workflow=no_such_module:factory"],
            r"rollout.workflow: cannot import 'no_such_module'",
        ),
        (
            ["rollout.workflow=json:no_factory"],
            r"rollout.workflow: module 'json' has no 'no_factory'",
        ),
        (["algorithm.adv_type=gae"], r"algorithm.adv_type: expected one of"),
        (
            ["rollout.tool_parser=nope"],
            r"rollout.tool_parser: expected one of hermes, qwen, got 'nope'",
        ),
    ],
)
def test_llm_bad_values(overrides, message):
    from tidal.config.llm import LLMConfig

    with pytest.raises(ConfigError, match=message):
        check_llm(load_config(LLMConfig, None, overrides))


def test_llm_model_path_and_context_are_checked_before_anything_starts(tmp_path, capsys):
    from tidal.cli import main

    arith = Path(__file__).parent.parent / "examples" / "llm" / "arith_grpo.yaml"
    assert (
        main(
            [
                "train",
                str(arith),
                f"model.path={tmp_path}/missing",
                f"runner.run_dir={tmp_path}/runs",
            ]
        )
        == 2
    )
    assert "model.path: " in capsys.readouterr().err and not (tmp_path / "runs").exists()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"max_position_embeddings": 64}')  # no model_type
    assert main(["train", str(arith), f"model.path={tmp_path}/x"]) == 2
    assert "model.path: cannot read" in capsys.readouterr().err
    from tidal.inference.tiny import save_tiny_model

    save_tiny_model(tmp_path / "m", hidden=16, layers=1, heads=2, max_positions=64)
    assert (
        main(["train", str(arith), f"model.path={tmp_path}/m", "rollout.max_new_tokens=100"]) == 2
    )
    assert (
        "rollout.max_new_tokens: 100 does not fit the model's context of 64 tokens"
        in capsys.readouterr().err
    )
    for bad in ("sft.steps=0", "sft.batch_size=0"):
        assert main(["sft", str(arith), bad]) == 2
        assert f"{bad.split('=')[0]}: must be >= 1" in capsys.readouterr().err
    assert main(["sft", str(arith), "sft.eval_size=-1"]) == 2
    assert "sft.eval_size: must be >= 0, got -1" in capsys.readouterr().err
    assert main(["sft", str(arith), "sft.lr_schedule=step"]) == 2
    assert "sft.lr_schedule: expected one of constant, linear, cosine" in capsys.readouterr().err
    assert main(["sft", str(arith), "sft.steps=100", "sft.warmup_steps=100"]) == 2
    assert "sft.warmup_steps: must be >= 0 and < sft.steps (100)" in capsys.readouterr().err


def test_an_unreachable_ray_address_is_named_within_the_connect_timeout(tmp_path, capsys):
    import time

    from tidal.cli import main

    start = time.perf_counter()
    code = main(
        [
            "train",
            str(EXAMPLES[0]),
            f"runner.run_dir={tmp_path}",
            "cluster.backend=ray",
            "cluster.address=127.0.0.1:9",
            "cluster.connect_timeout_s=2",
        ]
    )
    assert code == 2 and time.perf_counter() - start < 20
    assert "cluster.address: cannot reach a Ray cluster at '127.0.0.1:9'" in capsys.readouterr().err


def test_lora_under_fsdp2_is_valid_and_the_lora_rules_still_hold():
    from tidal.config.embodied import validate_embodied
    from tidal.config.llm import LLMConfig, validate_llm

    for schema, validate in ((EmbodiedConfig, validate_embodied), (LLMConfig, validate_llm)):
        both = ["model.lora.rank=4", "actor.strategy=fsdp2"]
        validate(load_config(schema, None, both))
        with pytest.raises(ConfigError, match=r"^model.lora.alpha: must be > 0, got 0"):
            validate(load_config(schema, None, [*both, "model.lora.alpha=0"]))
        with pytest.raises(ConfigError, match=r"^model.lora.rank: must be >= 0"):
            validate(load_config(schema, None, [*both, "model.lora.rank=-1"]))
