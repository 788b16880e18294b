"""The MetaWorld adapter: tasks, instructions, seeds, truncation, success flags; users' env ids."""

import sys
import textwrap

import numpy as np
import pytest
import torch

from tidal.envs import ChunkedEnv, ObsLayout, make_env, success_metrics, tokenize
from tidal.envs.metaworld_adapter import INSTRUCTIONS


def expert_actions(env) -> np.ndarray:
    from metaworld.policies import ENV_POLICY_MAP

    experts = {t: ENV_POLICY_MAP[t]() for t in set(env.task_names)}
    return np.stack([experts[t].get_action(s) for t, s in zip(env.task_names, env.states)])


def test_reach_obs_layout_seeds_and_visible_goal():
    env = make_env("metaworld", 3, env_id="reach-v3", max_episode_steps=20)
    assert env.layout == ObsLayout(state_dim=39, num_tokens=16, vocab_size=1024)
    obs = env.reset(seeds=[5, 5, 6])
    assert obs.shape == (3, 55) and obs.dtype == np.float32
    assert np.array_equal(obs[0], obs[1]) and not np.array_equal(obs[0], obs[2])
    goal = obs[:, 36:39]
    np.testing.assert_allclose(goal[2], env.envs[2]._target_pos, atol=1e-6)  # goal observable
    tokens = tokenize(INSTRUCTIONS["reach-v3"], 16, 1024)
    assert np.array_equal(obs[0, 39:], tokens) and (tokens > 0).sum() == 7
    again = make_env("metaworld", 1, env_id="reach-v3").reset(seeds=[5])
    assert np.array_equal(again[0], obs[0])  # the seed alone decides the start
    env.close()


def test_truncation_auto_reset_and_episode_success_from_the_scripted_expert():
    env = make_env("metaworld", 2, env_id="reach-v3", max_episode_steps=60)
    chunked = ChunkedEnv(env, auto_reset=True, seeds=[0, 1])
    chunked.reset()
    truncated_at = []
    for t in range(60):
        out = chunked.step(expert_actions(env)[:, None])
        if out.dones.any():
            truncated_at.append(t)
            assert out.truncations.all() and not out.terminations.any()
    assert truncated_at == [59]
    assert env._steps.tolist() == [0, 0]  # auto-reset restarted both copies
    stats = chunked.stats.drain()
    assert stats["successes"] == [1.0, 1.0] and stats["lengths"] == [60, 60]
    assert stats["tasks"] == ["reach-v3", "reach-v3"]
    env.close()


def test_random_actions_rarely_succeed_and_terminate_on_success_ends_the_episode():
    env = make_env("metaworld", 2, env_id="reach-v3", max_episode_steps=15)
    chunked = ChunkedEnv(env, auto_reset=False, seeds=[0, 1])
    chunked.reset()
    for _ in range(15):
        chunked.step(np.zeros((2, 1, 4), dtype=np.float32))
    assert chunked.stats.drain()["successes"] == [0.0, 0.0]

    env = make_env("metaworld", 1, env_id="reach-v3", terminate_on_success=True)
    env.reset(seeds=[0])
    for _ in range(200):
        _, _, term, trunc = env.step(expert_actions(env))
        if term[0]:
            break
    assert term[0] and not trunc[0] and env.successes[0] and env._steps[0] < 150


def test_success_reward_pays_one_per_step_in_success_and_unknown_rewards_are_refused():
    dense = make_env("metaworld", 1, env_id="reach-v3", max_episode_steps=150)
    sparse = make_env("metaworld", 1, env_id="reach-v3", max_episode_steps=150, reward="success")
    dense.reset(seeds=[3])
    sparse.reset(seeds=[3])
    dense_rewards, sparse_rewards, flags = [], [], []
    for _ in range(60):
        actions = expert_actions(sparse)
        dense_rewards.append(dense.step(actions)[1][0])
        sparse_rewards.append(sparse.step(actions)[1][0])
        flags.append(bool(sparse.successes[0]))
    assert any(flags) and not all(flags)  # the expert gets there within 60 steps, not at once
    assert sparse_rewards == [float(f) for f in flags]
    assert len(set(dense_rewards)) > 2  # the same trajectory under the shaped reward
    with pytest.raises(ValueError, match="reward: expected one of dense, success, got 'sparse'"):
        make_env("metaworld", 1, env_id="reach-v3", reward="sparse")


def test_terminate_on_success_scores_an_episode_exactly_one_or_zero():
    """``reward: success`` with ``terminate_on_success``: the episode ends at its first success
    step, which pays 1, so the GRPO score (rewards up to the first done) is 1 for a success,
    however soon, and 0 for a failure; without termination it counts the steps in success."""
    from tidal.algorithms import episode_scores

    def scores(terminate: bool) -> list[float]:
        env = make_env(
            "metaworld",
            2,
            env_id="reach-v3",
            max_episode_steps=100,
            reward="success",
            terminate_on_success=terminate,
        )
        chunked = ChunkedEnv(env, auto_reset=False, seeds=[3, 3])
        chunked.reset()
        rewards, dones = [], [torch.zeros(2, dtype=torch.bool)]
        for _ in range(100):
            actions = expert_actions(env)
            actions[1] = 0.0  # the second copy stands still: it fails
            out = chunked.step(actions[:, None].astype(np.float32))
            rewards.append(out.rewards[:, 0])
            dones.append(out.dones[:, 0])
        stats = chunked.stats.drain()
        assert stats["successes"] == [1.0, 0.0] and chunked.all_reported()
        if terminate:
            assert stats["lengths"][0] < 100 and stats["lengths"][1] == 100
        env.close()
        return episode_scores(torch.stack(rewards), torch.stack(dones)).tolist()

    assert scores(terminate=True) == [1.0, 0.0]
    steps_in_success, failed = scores(terminate=False)
    assert steps_in_success > 1 and failed == 0.0


def test_mt10_spreads_envs_over_tasks_with_distinct_instructions():
    env = make_env("metaworld", 10, env_id="MT10", max_episode_steps=5)
    assert env.task_names == list(INSTRUCTIONS)
    obs = env.reset(seeds=list(range(10)))
    tokens = {tuple(row) for row in obs[:, 39:]}
    assert len(tokens) == 10
    chunked = ChunkedEnv(env, auto_reset=True, seeds=list(range(10)))
    chunked.reset()
    chunked.step(np.zeros((10, 5, 4), dtype=np.float32))
    stats = chunked.stats.drain()
    metrics = success_metrics(stats["successes"], stats["tasks"], "rollout")
    assert metrics["rollout/success_rate"] == 0.0 and len(metrics) == 11
    assert metrics["rollout/success_rate/reach-v3"] == 0.0
    env.close()
    listed = make_env("metaworld", 3, env_id="reach-v3, push-v3")
    assert listed.task_names == ["reach-v3", "push-v3", "reach-v3"]


def test_tasks_follow_the_global_env_numbering_and_grpo_groups_share_a_task():
    from tidal.config import EmbodiedConfig, load_config
    from tidal.envs import env_make_kwargs

    cfg = load_config(
        EmbodiedConfig, None, ["env.adapter=metaworld", "env.id=MT10", "env.group_size=2"]
    )
    env = make_env("metaworld", 6, **env_make_kwargs(cfg.env, 0, cfg.env.group_size))
    tasks = list(INSTRUCTIONS)
    assert env.task_names == [tasks[0], tasks[0], tasks[1], tasks[1], tasks[2], tasks[2]]
    # the second stage (or rank) of 6 envs goes on where the first stopped
    second = make_env("metaworld", 6, **env_make_kwargs(cfg.env, 6, cfg.env.group_size))
    assert second.task_names == [tasks[3], tasks[3], tasks[4], tasks[4], tasks[5], tasks[5]]
    eval_env = make_env("metaworld", 3, **env_make_kwargs(cfg.env, 3))  # evaluation: no groups
    assert eval_env.task_names == tasks[3:6]
    with pytest.raises(ValueError, match="group_size"):
        make_env("metaworld", 3, env_id="MT10", group_size=0)


def test_success_metrics_per_task():
    out = success_metrics([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], "eval")
    assert out == {
        "eval/success_rate": 0.75,
        "eval/success_rate/a": 0.5,
        "eval/success_rate/b": 1.0,
    }
    assert success_metrics([], [], "eval") == {}


def test_bad_metaworld_options_name_their_key():
    with pytest.raises(ValueError, match="env.id: MetaWorld has no task reach-v9"):
        make_env("metaworld", 1, env_id="reach-v9")
    with pytest.raises(ValueError, match="env.obs_mode: expected one of state, pixels, state"):
        make_env("metaworld", 1, env_id="reach-v3", obs_mode="rgb")
    with pytest.raises(ValueError, match="env.vectorization_mode"):
        make_env("metaworld", 1, env_id="reach-v3", vectorization_mode="async")
    with pytest.raises(ValueError, match="adapter_kwargs.terminate_on_success: expected true or"):
        make_env("metaworld", 1, env_id="reach-v3", terminate_on_success="no")


def test_module_colon_env_id_imports_the_users_module(tmp_path, monkeypatch):
    (tmp_path / "my_tidal_envs.py").write_text(
        textwrap.dedent("""
        import gymnasium as gym
        gym.register("MyCartPole-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv",
                     max_episode_steps=7)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("gymnasium", 2, env_id="my_tidal_envs:MyCartPole-v0")
    assert "my_tidal_envs" in sys.modules and env.max_episode_steps == 7
    chunked = ChunkedEnv(env, auto_reset=True, seeds=[0, 1])
    assert chunked.reset().obs.shape == (2, 4)
    out = chunked.step(np.zeros((2, 7), dtype=np.int64))
    assert torch.any(out.dones)
    with pytest.raises(ValueError, match="env.id: cannot import module 'no_such_tidal_mod'"):
        make_env("gymnasium", 1, env_id="no_such_tidal_mod:Foo-v0")


def test_the_reach_expert_is_shown_a_goal_that_puts_the_tool_centre_on_it():
    """MetaWorld's reach expert steers the hand to the goal; success is measured at the tool
    centre 4.5 cm below it. Through ``EXPERT_VIEWS`` the demonstrations centre the tool."""
    from metaworld.policies import ENV_POLICY_MAP

    from tidal.envs.demos import EXPERT_VIEWS

    final = {}
    for name, view in (("raw", lambda _, state: state), ("view", EXPERT_VIEWS["reach-v3"])):
        env = make_env("metaworld", 3, env_id="reach-v3", max_episode_steps=80)
        env.reset(seeds=[0, 1, 2])
        expert = ENV_POLICY_MAP["reach-v3"]()
        for _ in range(80):
            env.step(
                np.stack([expert.get_action(view(e, s)) for e, s in zip(env.envs, env.states)])
            )
        final[name] = [np.linalg.norm(e.tcp_center - e._target_pos) for e in env.envs]
        env.close()
    assert np.mean(final["raw"]) > 0.03  # mostly on the edge of the 5 cm success ball
    assert max(final["view"]) < 0.01
