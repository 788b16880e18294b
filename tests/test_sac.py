"""SAC: the losses against float64 references, truncation vs termination, the config rules,
and short runs (pacing, ray smoke, NaN envs, data-parallel ranks, resume, learning)."""

import math
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from sac_runs import EXAMPLES, TINY, load, read_metrics, run

from tidal.algorithms.objectives import OBJECTIVES, make_objective
from tidal.algorithms.sac import (
    alpha_loss,
    critic_loss,
    ensemble_min,
    polyak_update,
    soft_td_target,
)
from tidal.config import ConfigError, validate_embodied
from tidal.models.sac import QEnsemble, SquashedGaussianPolicy
from tidal.runners.embodied.eval import run_eval
from tidal.runners.embodied.offpolicy import OffPolicyRunner
from tidal.runners.embodied.select import runner_class

# -- the losses ------------------------------------------------------------------------------


def test_td_target_bootstraps_truncations_but_not_terminations():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    terms = torch.tensor([False, True, False])
    next_q, next_logp = torch.tensor([10.0, 10.0, 4.0]), torch.tensor([-1.0, -1.0, 2.0])
    steps = torch.tensor([1, 1, 2])
    got = soft_td_target(rewards, terms, next_q, next_logp, 0.5, 0.9, steps)
    r, q, lp = rewards.double(), next_q.double(), next_logp.double()
    expected = r + torch.tensor([0.9, 0.0, 0.81], dtype=torch.float64) * (q - 0.5 * lp)
    torch.testing.assert_close(got.double(), expected)


def test_ensemble_min_over_all_or_a_random_subset():
    q = torch.tensor([[1.0, 5.0], [3.0, 2.0], [0.0, 9.0]])
    assert ensemble_min(q).tolist() == [0.0, 2.0]
    gen = torch.Generator().manual_seed(0)
    picks = {tuple(ensemble_min(q, 1, gen).tolist()) for _ in range(30)}
    assert picks == {(1.0, 5.0), (3.0, 2.0), (0.0, 9.0)}  # one critic each time


def test_critic_and_alpha_losses_match_references():
    q = torch.tensor([[1.0, 2.0], [0.0, 4.0]], requires_grad=True)
    target = torch.tensor([1.5, 3.0])
    expected = ((q.detach().double() - target.double()) ** 2).mean(1).sum()
    assert float(critic_loss(q, target).detach()) == pytest.approx(float(expected))
    log_alpha = torch.zeros((), requires_grad=True)
    # entropy below the target (log-prob high): the loss raises alpha
    alpha_loss(log_alpha, torch.tensor([2.0, 2.0]), target_entropy=-1.0).backward()
    assert log_alpha.grad < 0


def test_polyak_update_moves_targets_by_tau():
    src, dst = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = dst.weight.detach().clone()
    polyak_update(dst, src, 0.25)
    torch.testing.assert_close(dst.weight, 0.75 * before + 0.25 * src.weight.detach())


def test_sac_is_registered_beside_ppo():
    cfg = load()
    assert set(OBJECTIVES.names()) >= {"ppo", "sac"}
    assert type(make_objective(cfg.algorithm)).__name__ == "SACObjective"
    assert runner_class("sac") is OffPolicyRunner
    assert load(path=EXAMPLES / "pendulum_ppo.yaml").algorithm.name == "ppo"


# -- the models --------------------------------------------------------------------------


def test_squashed_actions_stay_in_bounds_with_their_log_probs():
    env = gym.make("Pendulum-v1")
    policy = SquashedGaussianPolicy(env.observation_space, env.action_space, 2, (16,))
    with torch.no_grad():
        actions, logp = policy.sample(torch.randn(64, 3))
    assert actions.shape == (64, 2, 1) and logp.shape == (64,)
    assert actions.abs().max() <= 1.0
    assert policy.env_actions(actions).min() >= -2.0 and policy.env_actions(actions).max() <= 2.0
    q = QEnsemble(3, policy.critic_action_dim, 3, (16,), layer_norm=True)
    assert q(torch.randn(64, 3), actions).shape == (3, 64)
    assert any(type(m).__name__ == "EnsembleLayerNorm" for m in q.modules())


def test_discrete_actions_are_refused_naming_the_algorithm(tmp_path):
    env = gym.make("CartPole-v1")
    with pytest.raises(ValueError, match="algorithm.name"):
        SquashedGaussianPolicy(env.observation_space, env.action_space)
    cfg = load(f"runner.run_dir={tmp_path}", "env.id=CartPole-v1")
    with pytest.raises(ConfigError, match="algorithm.name: sac needs a continuous"):
        OffPolicyRunner(cfg)


# -- config rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.gae_lambda=0.9", "algorithm.gae_lambda"),
        ("algorithm.update_epochs=2", "algorithm.update_epochs"),
        ("algorithm.utd_ratio=0", "algorithm.utd_ratio"),
        ("replay.capacity=100", "replay.capacity"),
        ("replay.max_lead=4", "replay.max_lead"),
        ("algorithm.critic_subset=3", "algorithm.critic_subset"),
        ("algorithm.name=td3", "algorithm.name"),
        ("rollout.max_staleness=1", "rollout.max_staleness"),
        ("algorithm.name=ppo", "algorithm.critic_lr"),  # the file's SAC keys do not apply
        ("algorithm.image_pad=4", "algorithm.image_pad"),  # sac_mlp reads no pixels
    ],
)
def test_bad_sac_configs_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_embodied(load(override))


def test_demonstrations_from_an_env_without_a_scripted_expert_are_refused_before_start():
    """Pendulum has no scripted expert: the preflight (which tidal config runs) says which
    adapters have demonstrations."""
    from tidal.runners.preflight import check_embodied

    cfg = load("replay.sft_demos=true")
    validate_embodied(cfg)  # the schema alone cannot know: it names no adapter
    with pytest.raises(ConfigError, match=r"replay\.sft_demos: .*adapters with them: .*metaworld"):
        check_embodied(cfg)


# -- runs ------------------------------------------------------------------------------------


class _NaNRewardPendulum(gym.Wrapper):
    """Pendulum whose reward is NaN on its steps 70..72 (after the warm-up's start)."""

    def __init__(self, env):
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        self.steps += 1
        return obs, float("nan") if 70 <= self.steps <= 72 else reward, term, trunc, info


gym.register(
    "TidalTestNaNPendulum-v0",
    entry_point=lambda **kw: _NaNRewardPendulum(gym.make("Pendulum-v1", **kw)),
)


def test_nan_rewards_are_named_and_never_stored(tmp_path, caplog):
    summary, info = run(
        tmp_path,
        *TINY,
        "env.id=TidalTestNaNPendulum-v0",
        "runner.max_env_steps=120",
        inspect=lambda r: r.actor.replay_summary().wait(30)[0],
    )
    rows = read_metrics(summary["run_dir"])
    assert sum(r["rollout/nonfinite_env_steps"] for r in rows) == 3
    assert "non-finite reward" in caplog.text
    assert info["finite"] and info["size"] == summary["env_steps"] - 3


gym.register(
    "TidalTestHugeRewardPendulum-v0",
    entry_point=lambda **kw: gym.wrappers.TransformReward(
        gym.make("Pendulum-v1", **kw), lambda r: 1e30
    ),
)


def test_updates_whose_losses_overflow_stop_the_run_after_max_skipped_steps(tmp_path):
    """Finite rewards whose squared TD error overflows: every update is skipped, and the run
    stops naming the limit instead of collecting on without ever training."""
    under_the_limit, _ = run(  # calls whose every update was skipped report so
        tmp_path,
        *TINY,
        "env.id=TidalTestHugeRewardPendulum-v0",
        "actor.max_skipped_steps=1000",
        "runner.max_env_steps=100",
    )
    last = read_metrics(under_the_limit["run_dir"])[-1]
    assert last["train/skipped_updates"] >= last["updates"] > 0 and "train/q_mean" not in last
    with pytest.raises(
        Exception, match=r"sac critic: 3 consecutive optimizer steps .*actor.max_skipped_steps=3"
    ):
        run(
            tmp_path,
            *TINY,
            "env.id=TidalTestHugeRewardPendulum-v0",
            "actor.max_skipped_steps=3",
            "runner.max_env_steps=400",
        )


def test_collection_and_updates_are_paced_and_logged(tmp_path):
    summary, _ = run(
        tmp_path, *TINY, "runner.max_env_steps=200", "algorithm.utd_ratio=2", "replay.max_lead=32"
    )
    rows = read_metrics(summary["run_dir"])
    last = rows[-1]
    for key in (
        "replay/size",
        "replay/lead",
        "train/q_mean",
        "train/alpha",
        "train/critic_loss",
        "train/actor_loss",
        "env_steps_per_s",
        "updates_per_s",
    ):
        assert any(key in r for r in rows), key
    # utd 2 after the warm-up: never more updates than owed, never behind by more than the lead
    assert all(r["updates"] <= 2 * max(0, r["env_steps"] - 64) for r in rows)
    assert last["updates"] >= 2 * (last["env_steps"] - 64 - 32)
    assert last["updates"] > 0
    assert max(r["replay/lead"] for r in rows) <= 32 + 1


def test_a_fractional_utd_ratio_with_a_lead_of_one_segment_never_stalls(tmp_path):
    """Caught up with the updates, the lead is 0, not the env steps a fraction of an update
    stands for: with max_lead at one segment (8 env steps) collection stopped after 8 segments
    then waited for updates nobody owed until runner.timeout_s."""
    summary, _ = run(
        tmp_path,
        *TINY,
        "replay.max_lead=8",
        "algorithm.utd_ratio=0.3",
        "runner.max_env_steps=200",
        "runner.timeout_s=20",
    )
    assert summary["env_steps"] >= 200
    rows = read_metrics(summary["run_dir"])
    assert rows[-1]["updates"] == math.floor(0.3 * (rows[-1]["env_steps"] - 64))


def test_the_rollout_loads_only_the_newest_of_the_weights_waiting(tmp_path, monkeypatch):
    """At 4 updates an env step, each sending its weights, several wait at each chunk step:
    the rollout loads the newest of them, not each in turn."""
    import tidal.workers.rollout_worker as rollout_worker

    loaded = []

    def counting(model, state, adopt=False):
        loaded.append(1)
        return load_checked(model, state, adopt=adopt)

    load_checked = rollout_worker.load_checked
    monkeypatch.setattr(rollout_worker, "load_checked", counting)
    summary, _ = run(
        tmp_path, *TINY, "algorithm.utd_ratio=4", "runner.max_env_steps=200", "replay.max_lead=64"
    )
    updates = read_metrics(summary["run_dir"])[-1]["updates"]
    assert updates >= 4 * (200 - 64 - 64)  # each sent its weights (weight_sync_interval 1)
    assert 0 < len(loaded) < updates / 4  # 21 of 380 here; loaded in turn, 349


def test_an_update_that_never_ends_times_out_naming_it_while_collection_goes_on():
    """The step waits on the actor's call and the running segment at once (no polling); a call
    that does not finish within runner.timeout_s is named."""
    import concurrent.futures as cf

    from tidal.runners.embodied.pacer import Pacer, UpdateLead
    from tidal.runtime import Handle
    from tidal.runtime.handle import CallResult

    def segment():
        future = cf.Future()
        future.set_result(CallResult(value={"env_steps": 8}))
        return [Handle("env", "collect", [0], [future])]

    lead = UpdateLead(utd_ratio=1.0, max_lead=16, segment_env_steps=8, warmup=0)
    pacer = Pacer(lead, segment, 0.2)
    hung = Handle("actor", "update", [0], [cf.Future()])
    with pytest.raises(
        TimeoutError, match=r"actor.update: ranks \[0\] had not answered after 0.2 s"
    ):
        pacer.wait([hung])
    # meanwhile collection went on until it led the (never finished) updates by max_lead
    assert lead.segments == 2 and lead.env_steps == 16 and lead.lead() == 16


@pytest.mark.parametrize(
    "name",
    [
        "halfcheetah_sac.yaml",
        "hopper_sac.yaml",
        "metaworld_mt10_rlpd.yaml",
        "metaworld_reach_pixels_sac.yaml",
    ],
)
def test_the_mujoco_examples_are_valid(name):
    validate_embodied(load(path=EXAMPLES / name))


def test_a_resume_with_the_buffer_saved_continues_with_it(tmp_path, caplog):
    common = [*TINY, "replay.save=true", "runner.max_steps=12"]
    first, _ = run(tmp_path, *common, "runner.max_steps=10", "runner.experiment=a")
    checkpoint = first["checkpoint"]
    resumed, info = run(
        tmp_path,
        *common,
        f"runner.resume_from={checkpoint}",
        inspect=lambda r: r.actor.replay_summary().wait(30)[0],
    )
    assert "resume is not exact" not in caplog.text
    assert info["added"] == resumed["env_steps"]  # nothing collected before was lost
    caplog.clear()
    unsaved, _ = run(tmp_path, *TINY, "runner.max_steps=10", "runner.experiment=b")
    run(tmp_path, *TINY, "runner.max_steps=12", f"runner.resume_from={unsaved['checkpoint']}")
    assert "resume is not exact: the checkpoint holds no replay buffer" in caplog.text


@pytest.mark.ray
def test_a_short_sac_run_on_ray_with_collection_and_updates_apart(tmp_path):
    summary, _ = run(
        tmp_path,
        *TINY,
        "cluster.backend=ray",
        "cluster.devices_per_node=2",
        "cluster.placement={'env,rollout': '0', actor: '1'}",
        "runner.max_env_steps=90",
        "runner.eval_interval=1000",
        "env.max_episode_steps=20",
    )
    rows = read_metrics(summary["run_dir"])
    assert rows[-1]["updates"] > 0 and rows[-1]["eval/return_mean"] is not None


TWO_ACTOR_RANKS = [
    "cluster.backend=ray",
    "cluster.devices_per_node=3",
    "env.total_num_envs=4",
    "env.max_episode_steps=20",
]


@pytest.mark.ray
def test_two_actor_ranks_train_data_parallel_and_resume_each_with_its_buffer(tmp_path):
    """Each rank holds the transitions of its own envs and samples half of every minibatch;
    the averaged gradients keep their weights equal (their batches differ, so without the
    average they would part at the first update). A checkpoint keeps both buffers."""

    def ranks(runner):
        return runner.actor.agent_state().wait(60), runner.actor.replay_summary().wait(60)

    placement = "cluster.placement={'env,rollout': '0', actor: '1-2'}"
    common = [*TINY, *TWO_ACTOR_RANKS, placement, "replay.save=true"]
    first, (states, buffers) = run(
        tmp_path, *common, "runner.max_steps=8", "runner.experiment=a", inspect=ranks
    )
    assert read_metrics(first["run_dir"])[-1]["updates"] > 0
    assert set(states[0]) == set(states[1])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert [b["size"] for b in buffers] == [first["env_steps"] // 2] * 2
    checkpoint = Path(first["checkpoint"])
    assert (checkpoint / "actor_rank1.pt").exists()

    resumed, (_, buffers) = run(
        tmp_path, *common, "runner.max_steps=10", f"runner.resume_from={checkpoint}", inspect=ranks
    )
    assert [b["added"] for b in buffers] == [resumed["env_steps"] // 2] * 2  # nothing lost
    with pytest.raises(Exception, match="trained on 2 actor rank"):
        run(
            tmp_path,
            *TINY,
            "cluster.backend=ray",
            "cluster.devices_per_node=2",
            "cluster.placement={'env,rollout': '0', actor: '1'}",
            "env.total_num_envs=4",
            "runner.max_steps=12",
            f"runner.resume_from={checkpoint}",
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["cluster.backend=local"],
            "cluster.placement: a data-parallel actor .* cluster.backend=ray",
        ),
        (["replay.batch_size=33"], "replay.batch_size: 33 must divide evenly over 2"),
        (["env.total_num_envs=2"], r"env.total_num_envs: .* 1 env\(s\) .* evenly over 2 actor"),
        (["env.total_num_envs=6"], r"env.total_num_envs: .* 3 env\(s\) .* evenly over 2 actor"),
    ],
)
def test_data_parallel_sac_configs_are_checked_before_start(tmp_path, overrides, message):
    two_env_ranks = "cluster.placement={env: '0-1', rollout: '0', actor: '1-2'}"
    cfg = load(f"runner.run_dir={tmp_path}", *TINY, *TWO_ACTOR_RANKS, two_env_ranks, *overrides)
    with pytest.raises(ConfigError, match=message):
        OffPolicyRunner(cfg)


@pytest.mark.slow
def test_sac_learns_pendulum_in_3k_env_steps(tmp_path):
    """A short budget of the example (small networks): an untrained policy scores about
    -1100 to -1700 on the eval episodes; after 3k env steps SAC clearly swings up some."""
    summary, _ = run(
        tmp_path,
        "model.hidden_sizes=[64,64]",
        "replay.warmup_steps=400",
        "runner.max_env_steps=3000",
        "runner.eval_interval=100000",
        "runner.save_interval=0",
        "runner.target_value=null",
    )
    rows = read_metrics(summary["run_dir"])
    assert rows[-1]["eval/return_mean"] > -900, rows[-1]
    assert rows[-1]["updates"] >= 2400
    # tidal eval reads the policy out of the SAC checkpoint (actor, critics, targets, alpha)
    cfg = load(f"runner.run_dir={tmp_path}", "model.hidden_sizes=[64,64]")
    held_out = run_eval(cfg, checkpoint=summary["checkpoint"], episodes=4)
    assert held_out["eval/return_mean"] > -900, held_out


def test_keys_the_sac_policy_does_not_read_are_refused(tmp_path):
    cfg = load(f"runner.run_dir={tmp_path}", "model.obs_norm=true")
    with pytest.raises(ConfigError, match="model.obs_norm"):
        OffPolicyRunner(cfg)
