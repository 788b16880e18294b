"""Embodied runs that stop and go on: restarts after a killed worker, resumes that continue
bitwise as the uninterrupted run (CartPole, LoRA, async vector envs, MuJoCo, Ray), and one
that cannot and says so."""

from pathlib import Path

import pytest
from embodied_runs import (
    EXAMPLES,
    TINY,
    assert_resume_is_exact,
    read_metrics,
    run,
)

from tidal.config import EmbodiedConfig, load_config
from tidal.envs import GymnasiumVectorEnv, register_env
from tidal.runners import EmbodiedRunner


@pytest.mark.ray
def test_ray_run_restarts_after_a_killed_actor_and_resumes(ray_session, tmp_path):
    """A Ray actor killed in the middle of a run (after its first checkpoint): the run restarts
    its groups, resumes from the newest checkpoint and finishes, each step logged once."""
    import threading
    import time

    import ray

    from tidal.runners.loop import run_with_restarts

    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / "cartpole_ppo.yaml",
        [
            f"runner.run_dir={tmp_path}",
            "runner.progress=false",
            *TINY,
            "runner.max_steps=6",
            "runner.eval_interval=0",
            "runner.max_restarts=1",
            "runner.timeout_s=180",
            "cluster.backend=ray",
            "cluster.devices_per_node=2",
            "cluster.placement={env: '0', 'rollout,actor': '1'}",
            "env.pipeline_stage_num=1",
        ],
    )
    runners = []

    def kill_env_after_first_checkpoint():
        deadline = time.time() + 120
        while time.time() < deadline and not (
            runners and list(runners[0].run_dir.glob("checkpoints/step_000002"))
        ):
            time.sleep(0.05)
        ray.kill(runners[0].env._ranks[0].actor, no_restart=True)

    killer = threading.Thread(target=kill_env_after_first_checkpoint, daemon=True)
    killer.start()
    summary = run_with_restarts(
        lambda c, run_dir: runners.append(EmbodiedRunner(c, run_dir)) or runners[-1], cfg
    )
    killer.join(5)
    assert summary["restarts"] == 1 and summary["steps"] == 6
    assert len(runners) == 2 and runners[1].start_step >= 2
    assert [r["step"] for r in read_metrics(summary["run_dir"])] == list(range(1, 7))


# -- exact resume ------------------------------------------------------------------------


def test_resume_continues_exactly_as_the_uninterrupted_cartpole_run(tmp_path):
    """Envs mid-episode (chunks, two pipeline stages), running returns, the epoch (evaluation
    seeds) and the rollout's sampling RNG all come back; the prefetched epoch start is redone."""
    assert_resume_is_exact(
        tmp_path,
        EXAMPLES / "cartpole_ppo.yaml",
        [*TINY, "runner.overlap_env_bootstrap=true"],
        resume_at=2,
        max_steps=4,
    )


def test_a_lora_run_resumes_exactly(tmp_path):
    """LoRA adapters on every linear layer of the MLP, their optimizer state and a KL reference
    (the base with the adapters disabled): the checkpoint holds the adapters, the resume is exact."""
    assert_resume_is_exact(
        tmp_path,
        EXAMPLES / "cartpole_ppo.yaml",
        [*TINY, "model.lora.rank=4", "algorithm.kl_coef=0.1"],
        resume_at=1,
        max_steps=2,
    )
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "straight" / "checkpoints" / "step_000002" / "model.safetensors")
    params = [k for k in saved if "obs_norm" not in k]
    assert params and all(".lora_A." in k or ".lora_B." in k for k in params)
    assert any(saved[k].abs().sum() > 0 for k in params if ".lora_B." in k)  # they trained


def test_resume_with_async_vector_envs_is_exact(tmp_path):
    """The copies of an async vector env live in subprocesses: their state travels too."""
    assert_resume_is_exact(
        tmp_path,
        EXAMPLES / "cartpole_ppo.yaml",
        [*TINY, "env.vectorization_mode=async", "env.pipeline_stage_num=1", "env.total_num_envs=2"],
        resume_at=1,
        max_steps=2,
    )


MUJOCO_TINY = [
    "env.id=HalfCheetah-v5",
    "env.total_num_envs=2",
    "env.eval_num_envs=2",
    "env.max_episode_steps=12",
    "rollout.num_steps=8",
    "actor.global_batch_size=8",
    "actor.micro_batch_size=8",
    "algorithm.update_epochs=1",
    "runner.eval_interval=1",
    "runner.target_value=null",
    "runner.max_env_steps=null",
]


def test_resume_continues_exactly_as_the_uninterrupted_mujoco_run(tmp_path):
    """MuJoCo: the simulator's state, warm start and time limit counters come back."""
    assert_resume_is_exact(
        tmp_path, EXAMPLES / "halfcheetah_ppo.yaml", MUJOCO_TINY, resume_at=1, max_steps=3
    )


@pytest.mark.ray
def test_resume_on_ray_continues_exactly_as_the_uninterrupted_run(ray_session, tmp_path):
    """On ray the rollout samples in its own process: its RNG travels in the checkpoint."""
    # both runs in the module's Ray session (conftest.py): each reuses it and leaves it up
    ray_overrides = [
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "runner.timeout_s=60",
        "cluster.placement={env: '0', 'rollout,actor': '1'}",
    ]
    assert_resume_is_exact(
        tmp_path,
        EXAMPLES / "cartpole_ppo.yaml",
        [*TINY, "env.pipeline_stage_num=1", *ray_overrides],
        resume_at=1,
        max_steps=3,
    )


@register_env("test_without_state")
class _AdapterWithoutState(GymnasiumVectorEnv):
    state_dict = None  # an adapter that cannot save its envs


def test_a_resume_that_cannot_be_exact_says_so(tmp_path, caplog):
    overrides = [
        *TINY,
        "env.adapter=test_without_state",
        "runner.eval_interval=0",
        "runner.max_steps=1",
    ]
    first = Path(run(EXAMPLES / "cartpole_ppo.yaml", tmp_path, *overrides)["run_dir"])
    run(
        EXAMPLES / "cartpole_ppo.yaml",
        tmp_path,
        *overrides,
        "runner.max_steps=2",
        f"runner.resume_from={first / 'checkpoints'}",
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        "resume is not exact: env rank 0 (CartPole-v1) has state that is not checkpointed: "
        "_AdapterWithoutState has no state_dict"
    ) in warnings, warnings
