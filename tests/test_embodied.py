"""The embodied pipeline end to end: learning, pipelining, chunks, reward worker, Ray layouts,
non-finite values, normaliser statistics and micro-batches."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from embodied_runs import EXAMPLES, REQUIRED_KEYS, TINY, read_metrics, run, without_timings

from tidal.config import EmbodiedConfig, load_config
from tidal.envs.recorder import StageRecorder
from tidal.runners import EmbodiedRunner
from tidal.runtime import WorkerError
from tidal.workers.reward_worker import register_reward_model


def test_cartpole_ppo_solves_within_100k_steps(tmp_path):
    summary = run(EXAMPLES / "cartpole_ppo.yaml", tmp_path)
    assert summary["best_value"] >= 475, summary
    assert summary["solved_at_env_steps"] <= 100_000
    rows = read_metrics(summary["run_dir"])
    assert REQUIRED_KEYS <= set(rows[0])
    assert any(r.get("eval/return_mean") is not None for r in rows)
    assert [r["env_steps"] for r in rows] == sorted(r["env_steps"] for r in rows)
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert any((run_dir / "tensorboard").iterdir())


def test_pipelined_chunked_run_without_auto_reset_with_reward_worker_and_resume(tmp_path):
    overrides = [
        *TINY,
        "env.auto_reset=false",
        "reward.enabled=true",
        "reward.name=termination_penalty",
        "reward.mode=add",
        "runner.experiment=tiny",
        "algorithm.logprob_type=action",
    ]
    summary = run(EXAMPLES / "cartpole_ppo.yaml", tmp_path, *overrides)
    rows = read_metrics(summary["run_dir"])
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["env_steps"] == 2 * 4 * 8 * 3
    assert all(r["eval/return_mean"] is not None for r in rows)
    assert 0 < rows[0]["rollout/valid_fraction"] <= 1
    checkpoints = Path(summary["run_dir"]) / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_000002"

    resumed = run(
        EXAMPLES / "cartpole_ppo.yaml",
        tmp_path,
        *overrides,
        "runner.max_steps=3",
        f"runner.resume_from={checkpoints}",
    )
    assert resumed["run_dir"] == summary["run_dir"]
    rows = read_metrics(summary["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["env_steps"] == 3 * 4 * 8 * 3
    assert rows[-1]["version"] == 2  # the rollout got the resumed weights (trained twice)


@register_reward_model("test_explodes")
def _explodes():
    def model(out):
        raise ArithmeticError("reward model exploded")

    return model


def test_a_failing_worker_is_named_with_its_traceback(tmp_path):
    with pytest.raises(
        WorkerError,
        match=r"reward\[rank 0\].compute_rewards failed: ArithmeticError: reward model exploded",
    ):
        run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path,
            *TINY,
            "reward.enabled=true",
            "reward.name=test_explodes",
            "runner.timeout_s=60",
        )


def test_a_kl_penalty_keeps_the_policy_near_the_one_training_started_from(tmp_path):
    """``algorithm.kl_coef`` > 0: ``train/kl_ref`` (k3 to a frozen copy of the starting policy)
    is logged every step, and a large coefficient holds the policy closer than a tiny one;
    that run also keeps its reference in host memory and steps off the device while the rollout
    collects (actor.ref_offload, actor.offload: both timed)."""
    tiny = [
        "env.total_num_envs=8",
        "env.group_size=4",
        "env.max_episode_steps=48",
        "env.eval_num_envs=2",
        "rollout.num_steps=48",
        "actor.global_batch_size=384",
        "actor.micro_batch_size=192",
        "actor.lr=1.0e-2",
        "runner.max_steps=3",
        "runner.eval_interval=100",
        "runner.save_interval=100",
        "runner.target_value=null",
        "runner.loggers=[jsonl]",
    ]
    kl = {}
    for coef in (1e-6, 10.0):
        offload = coef > 1
        summary = run(
            EXAMPLES / "cartpole_grpo.yaml",
            tmp_path / str(coef),
            *tiny,
            f"algorithm.kl_coef={coef}",
            f"actor.offload={offload}",
            f"actor.ref_offload={offload}",
        )
        steps = [r for r in read_metrics(summary["run_dir"]) if "train/policy_loss" in r]
        assert len(steps) == 3 and all(r["train/kl_ref"] >= 0 for r in steps)
        assert all(("time/offload" in r and "time/onload" in r) == offload for r in steps)
        kl[coef] = [r["train/kl_ref"] for r in steps]
    assert kl[1e-6][-1] > 0 and kl[10.0][-1] < 0.5 * kl[1e-6][-1], kl


def test_truncated_episode_is_bootstrapped_not_terminal():
    rec = StageRecorder(torch.zeros(3, 2, dtype=torch.bool))
    from tidal.data import EnvOutput

    dones = torch.tensor([[False, True], [False, False], [True, False]])
    rec.add_env(
        EnvOutput(
            obs=torch.zeros(3, 1),
            rewards=torch.ones(3, 2),
            terminations=torch.tensor([[False, False], [False, False], [True, False]]),
            truncations=torch.tensor([[False, True], [False, False], [False, False]]),
            dones=dones,
        )
    )
    needs = torch.tensor([True, False, False])  # only the truncated env
    rec.add_bootstrap(needs, torch.tensor([10.0, 20.0, 30.0]), gamma=0.5)
    assert rec.rewards[-1].tolist() == [[1.0, 6.0], [1.0, 1.0], [1.0, 1.0]]


def test_no_reward_channel_without_a_reward_group(tmp_path):
    # unbound, a channel is a channel actor's process on ray: none for a group that is not there
    cfg = load_config(
        EmbodiedConfig,
        EXAMPLES / "cartpole_ppo.yaml",
        [f"runner.run_dir={tmp_path}", "runner.progress=false"],
    )
    with EmbodiedRunner(cfg) as runner:
        assert set(runner.channels) == {"env", "rollout", "actor", "weights"}


def test_policy_half_of_the_record_stays_with_the_rollout_until_the_epoch_ends():
    from tidal.data import ChunkActions
    from tidal.envs.recorder import PolicyRecorder

    rec, steps, envs = PolicyRecorder(), 3, 2
    for t in range(steps + 1):  # the last answer is the bootstrap step's
        answer = rec.add(
            ChunkActions(
                env_actions=torch.full((envs, 1), t),
                actions=torch.full((envs, 1), t),
                logprobs=torch.full((envs, 1, 1), -t / 10),
                values=torch.full((envs,), 10.0 * t),
                final_values=torch.full((envs,), 0.5 * t),
                forward_inputs={"obs": torch.full((envs, 4), float(t))},
                version=torch.full((envs,), 7),
            )
        )
        # what travels to the env each chunk step: what it steps with, and the bootstrap values
        assert answer.actions is None and answer.logprobs is None and not answer.forward_inputs
        assert answer.env_actions.tolist() == [[t]] * envs
        assert answer.final_values.tolist() == [0.5 * t] * envs
    record = rec.record()
    assert record.actions[:, :, 0].tolist() == [[0, 1, 2]] * envs  # [B, T, ...]
    assert record.values.tolist() == [[0.0, 10.0, 20.0, 30.0]] * envs  # [B, T + 1]
    assert record.forward_inputs["obs"].shape == (envs, steps, 4)
    assert record.bootstrap_inputs["obs"].tolist() == [[3.0] * 4] * envs
    assert record.versions.shape == (envs, steps) and record.logprobs.shape == (envs, steps, 1, 1)


@pytest.mark.ray
def test_a_data_parallel_actor_takes_the_step_of_one_rank(ray_session, tmp_path):
    """Env, rollout and actor apart on Ray, the actor on 1 rank or on 2 DDP ranks (each its
    half of the envs and of every minibatch): the same losses and weights after the step. The
    whole batch is one minibatch and advantages are not whitened: per-rank shuffles and
    per-rank whitening are where 2 ranks may differ from 1 by design."""
    from safetensors.torch import load_file

    common = [
        "cluster.backend=ray",
        "runner.max_steps=1",
        "runner.eval_interval=1",
        "runner.target_value=null",
        "env.total_num_envs=8",
        "rollout.num_steps=32",
        "actor.global_batch_size=256",
        "actor.micro_batch_size=64",
        "algorithm.normalize_advantages=false",
    ]
    layouts = {
        1: ["cluster.devices_per_node=3", "cluster.placement={env: '0', rollout: '1', actor: '2'}"],
        2: [
            "cluster.devices_per_node=4",
            "cluster.placement={env: '0', rollout: '1', actor: '2-3'}",
        ],
    }
    rows, weights = {}, {}
    for ranks, layout in layouts.items():
        summary = run(EXAMPLES / "cartpole_ppo.yaml", tmp_path / str(ranks), *common, *layout)
        rows[ranks] = read_metrics(summary["run_dir"])
        weights[ranks] = load_file(Path(summary["checkpoint"]) / "model.safetensors")
    assert rows[2][-1]["eval/return_mean"] is not None
    assert all(r["train/skipped_steps"] == 0 for r in rows[2])
    (one,), (two,) = rows[1], rows[2]
    assert one["rollout/return_mean"] == two["rollout/return_mean"]  # the same episodes
    assert one["train/grad_norm"] > 0 and one["train/approx_kl"] != 0  # the step moved them
    for key in ("train/policy_loss", "train/value_loss", "train/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    assert weights[1].keys() == weights[2].keys()
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[2][name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("auto_reset", [True, False])
def test_prefetched_bootstrap_changes_nothing_but_the_overlap(tmp_path, auto_reset):
    """``runner.overlap_env_bootstrap``: the envs start the next epoch while the actor trains;
    the run sees the same episodes and takes the same steps as without it."""
    overrides = [
        *TINY,
        f"env.auto_reset={str(auto_reset).lower()}",
        "runner.max_steps=3",
        "runner.save_interval=0",
        "runner.eval_interval=2",
    ]
    runs = []
    for overlap in (False, True):
        summary = run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path,
            *overrides,
            f"runner.overlap_env_bootstrap={str(overlap).lower()}",
            f"runner.experiment=overlap-{overlap}",
        )
        runs.append(read_metrics(summary["run_dir"]))
    keys = [
        "env_steps",
        "rollout/return_mean",
        "rollout/episodes",
        "train/policy_loss",
        "train/value_loss",
        "eval/return_mean",
    ]
    assert [[r.get(k) for k in keys] for r in runs[0]] == [
        [r.get(k) for k in keys] for r in runs[1]
    ]
    assert [r["rollout/bootstrap_prefetched"] for r in runs[1]] == [
        0.0,
        1.0,
        1.0,
    ]  # it did start epochs early
    assert [r["rollout/bootstrap_prefetched"] for r in runs[0]] == [0.0, 0.0, 0.0]


def test_the_same_experiment_twice_makes_two_run_folders(tmp_path):
    summaries = [
        run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path,
            *TINY,
            "runner.max_steps=1",
            "runner.experiment=twice",
        )
        for _ in range(2)
    ]
    assert [Path(s["run_dir"]).name for s in summaries] == ["twice", "twice-2"]
    assert all(len(read_metrics(s["run_dir"])) == 1 for s in summaries)


@pytest.mark.ray
def test_env_and_rollout_in_one_process_train_exactly_as_in_two(ray_session, tmp_path):
    """``cluster.same_process``: the rollout in its env rank's process (actions reach the env in
    memory) takes the same steps, episodes and evaluations as in a process of its own; with
    two pipeline stages the env steps off the shared event loop. Unset, env and rollout share
    their processes when one placement entry names both and there is one stage."""
    layout = [
        *TINY,
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "runner.timeout_s=60",
        "cluster.placement={'env,rollout': '0-1', actor: '1'}",
    ]
    runs, shared = {}, {}
    for setting, stages in (("[]", 2), ("['env,rollout']", 2), (None, 1)):
        overrides = [*layout, f"env.pipeline_stage_num={stages}", f"runner.experiment=s{len(runs)}"]
        if setting is not None:
            overrides.append(f"cluster.same_process={setting}")
        cfg = load_config(
            EmbodiedConfig,
            EXAMPLES / "cartpole_ppo.yaml",
            [f"runner.run_dir={tmp_path}", "runner.progress=false", *overrides],
        )
        runner = EmbodiedRunner(cfg)
        try:
            summary = runner.run()
        finally:
            runner.close()
        pairs = zip(runner.env.rank_handles, runner.rollout.rank_handles, strict=True)
        shared[setting] = [env.actor == rollout.actor for env, rollout in pairs]
        runs[setting] = [without_timings(r) for r in read_metrics(summary["run_dir"])]
    assert shared == {"[]": [False, False], "['env,rollout']": [True, True], None: [True, True]}
    assert len(runs["[]"]) == 2 and runs["[]"] == runs["['env,rollout']"]
    assert len(runs[None]) == 2


# -- non-finite values from envs and reward models ---------------------------------------


class _NonFiniteCartPole(gym.Wrapper):
    """CartPole; the copy reset with seed ``bad_seed`` returns NaN (``what``: obs or reward) on
    its steps ``first`` .. ``last`` (counted from 1 over its whole life)."""

    def __init__(self, env, bad_seed: int, what: str, first: int, last: int):
        super().__init__(env)
        self.bad_seed, self.what, self.first, self.last = bad_seed, what, first, last
        self.bad, self.steps = False, 0

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.bad = seed == self.bad_seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        self.steps += 1
        if self.bad and self.first <= self.steps <= self.last:
            if self.what == "obs":
                obs = np.full_like(obs, np.nan)
            else:
                reward = float("nan")
        return obs, reward, term, trunc, info


def _make_nonfinite_cartpole(bad_seed=-1, what="reward", first=1, last=10**9, **kwargs):
    return _NonFiniteCartPole(gym.make("CartPole-v1", **kwargs), bad_seed, what, first, last)


gym.register("TidalTestNonFinite-v0", entry_point=_make_nonfinite_cartpole)


@register_reward_model("test_inf_for_env_3_once")
def _inf_for_env_3_once():
    calls = []

    def model(out):
        calls.append(1)
        rewards = out.rewards.clone()
        if len(calls) == 6:
            rewards[3] = float("inf")
        return rewards

    return model


NONFINITE = [
    *TINY,
    "env.pipeline_stage_num=1",
    "env.num_action_chunks=1",
    "runner.seed=0",
    "runner.eval_interval=0",
    "env.id=TidalTestNonFinite-v0",
]


def test_nonfinite_values_are_named_and_masked_and_training_goes_on(tmp_path, caplog):
    """env 1's observation turns NaN on its 3rd step (one run), env 2's reward on its 5th (another),
    the reward model answers inf for env 3 on its 6th call (both): each is named, that env's
    samples up to there are masked, and every optimizer step is taken."""
    overrides = [
        *NONFINITE,
        "reward.enabled=true",
        "reward.name=test_inf_for_env_3_once",
        "reward.mode=add",
    ]
    for bad_seed, what, step in ((1, "obs", 3), (2, "reward", 5)):
        kwargs = f"env.kwargs={{bad_seed: {bad_seed}, what: {what}, first: {step}, last: {step}}}"
        summary = run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path,
            *overrides,
            kwargs,
            f"runner.experiment={what}",
        )
        rows = read_metrics(summary["run_dir"])
        assert [r["train/skipped_steps"] for r in rows] == [0, 0]
        assert [r["rollout/nonfinite_env_steps"] for r in rows] == [2, 0]
        # env bad_seed masked up to its bad step (chunk step step - 1), env 3 up to chunk step 5
        assert rows[0]["rollout/valid_fraction"] == 1 - (step + 6) / (4 * 8)
        keys = ("train/policy_loss", "train/value_loss", "train/grad_norm")
        assert np.isfinite([[r[k] for k in keys] for r in rows]).all()
    messages = [r.getMessage() for r in caplog.records if r.name == "tidal.envs"]
    at = "at training step 1, chunk step"
    for expected, count in (
        (f"env rank 0, env 1: non-finite observation from the env {at} 2", 1),
        (f"env rank 0, env 2: non-finite reward from the env {at} 4", 1),
        (f"env rank 0, env 3: non-finite reward from the reward model {at} 5", 2),
    ):
        assert sum(m.startswith(expected) for m in messages) == count, (expected, messages)
    assert len(messages) == 4


def test_an_env_that_keeps_returning_nan_ends_the_run_named(tmp_path):
    named = (
        r"NonFiniteEnvError: env rank 0, env 2: non-finite observations or rewards 3 chunk "
        r"steps in a row \(up to training step 1, chunk step 3;"
    )
    with pytest.raises(WorkerError, match=named):
        run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path,
            *NONFINITE,
            "env.max_nonfinite_steps=3",
            "env.kwargs={bad_seed: 2, what: obs, first: 2}",
        )


def test_a_policy_started_from_model_path_keeps_its_normaliser_statistics(tmp_path):
    """A cloned policy's weights were fitted to its normaliser's statistics: RL keeps them
    (moving them would change the policy without a gradient step); a fresh policy fits its own."""
    from safetensors.torch import load_file

    from tidal.checkpoint import MODEL_FILE, complete_checkpoints
    from tidal.models import save_policy
    from tidal.models.factory import build_from_config

    config = EXAMPLES / "pendulum_ppo.yaml"
    cfg = load_config(EmbodiedConfig, config, [])
    env = gym.make("Pendulum-v1")
    policy = build_from_config(cfg.model, env.observation_space, env.action_space, 1)
    policy.obs_norm.update(torch.randn(256, 3, dtype=torch.float64) * 3 + 7)
    fitted = policy.obs_norm.mean.clone()
    save_policy(policy, tmp_path / "policy")
    small = [
        "runner.max_steps=2",
        "runner.save_interval=2",
        "runner.eval_interval=0",
        "env.total_num_envs=4",
        "env.eval_num_envs=4",
        "rollout.num_steps=16",
        "actor.global_batch_size=64",
        "actor.micro_batch_size=64",
    ]
    means = {}
    for name, path in (("cloned", str(tmp_path / "policy")), ("fresh", "null")):
        summary = run(config, tmp_path / name, *small, f"model.path={path}")
        last = complete_checkpoints(Path(summary["run_dir"]) / "checkpoints")[-1]
        means[name] = load_file(str(last / MODEL_FILE))["obs_norm.mean"]
    torch.testing.assert_close(means["cloned"], fitted)
    assert means["fresh"].abs().max() > 0.01  # fitted to the rollouts from zero


def test_a_training_step_does_not_depend_on_the_micro_batch_size(tmp_path):
    """Without auto-reset the steps after an episode's end are masked, so micro-batches hold
    unequal counts of valid steps: the minibatch loss divides by its own count either way, and
    one step with 4 micro-batches updates the weights as one micro-batch does."""
    from safetensors.torch import load_file

    def weights(micro):
        summary = run(
            EXAMPLES / "cartpole_ppo.yaml",
            tmp_path / f"micro{micro}",
            "env.auto_reset=false",
            "env.total_num_envs=4",
            "rollout.num_steps=16",
            "actor.global_batch_size=64",
            f"actor.micro_batch_size={micro}",
            "algorithm.update_epochs=1",
            "runner.max_steps=1",
            "runner.eval_interval=0",
            "runner.target_value=null",
        )
        rows = read_metrics(summary["run_dir"])
        assert rows[0]["rollout/valid_fraction"] < 1.0  # the split is uneven
        return load_file(Path(summary["checkpoint"]) / "model.safetensors")

    whole, split = weights(64), weights(16)
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-5, atol=1e-6)
