"""Env adapters, chunked stepping and policies."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import Normal

from tidal.envs import ChunkedEnv, make_env
from tidal.models import MLPActorCritic, RunningNorm, build_policy
from tidal.models.policy import sample_categorical


def cartpole(n, **kw):
    return make_env("gymnasium", n, env_id="CartPole-v1", **kw)


def test_unknown_adapter_and_env_id_are_clear_errors():
    with pytest.raises(
        ValueError, match="env.adapter: unknown adapter 'maniskill'; registered: gymnasium"
    ):
        make_env("maniskill", 2)
    with pytest.raises(ValueError, match="env.id: gymnasium has no env 'NoSuchEnv-v0'"):
        make_env("gymnasium", 2, env_id="NoSuchEnv-v0")


def test_envs_in_a_group_start_identically():
    env = ChunkedEnv(cartpole(4), auto_reset=True, seeds=[7, 7, 8, 8])
    obs = env.reset().obs
    assert (
        torch.equal(obs[0], obs[1])
        and torch.equal(obs[2], obs[3])
        and not torch.equal(obs[0], obs[2])
    )


def test_chunk_step_shapes_and_final_obs_with_auto_reset():
    env = ChunkedEnv(cartpole(3), auto_reset=True, seeds=[0, 1, 2])
    env.reset()
    saw_done = False
    for _ in range(100):
        out = env.step(np.ones((3, 4), dtype=np.int64))  # always push right: episodes end fast
        assert out.rewards.shape == out.dones.shape == (3, 4)
        assert torch.equal(out.dones, out.terminations | out.truncations)
        ended = out.dones.any(-1)
        if ended.any():
            saw_done = True
            i = int(ended.nonzero()[0])
            c = int(out.dones[i].float().argmax())
            assert torch.all(out.rewards[i, c + 1 :] == 0)  # nothing counts after the done
            assert (
                abs(float(out.final_obs[i, 2])) > 0.2 or abs(float(out.final_obs[i, 0])) > 2.4
            )  # ended by falling
            assert abs(float(out.obs[i, 2])) < 0.05  # and the next observation is a fresh start
            break
    assert saw_done
    stats = env.stats.drain()
    assert len(stats["returns"]) >= 1 and stats["returns"] == [float(n) for n in stats["lengths"]]


def test_without_auto_reset_only_the_first_episode_counts():
    env = ChunkedEnv(cartpole(2), auto_reset=False, seeds=[0, 1])
    env.reset()
    for _ in range(60):
        env.step(np.ones((2, 1), dtype=np.int64))
    stats = env.stats.drain()
    assert len(stats["returns"]) == 2  # one episode per env, however long we kept stepping


def test_truncation_is_reported_as_truncation():
    env = ChunkedEnv(
        make_env("gymnasium", 2, env_id="Pendulum-v1", max_episode_steps=6),
        auto_reset=True,
        seeds=[0, 1],
    )
    env.reset()
    out = env.step(np.zeros((2, 6, 1), dtype=np.float32))
    assert out.truncations[:, -1].all() and not out.terminations.any()


# ----------------------------------------------------------------------------- policies


def test_discrete_chunk_policy_shapes_and_consistency():
    pol = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), num_action_chunks=5)
    inputs = pol.prepare(torch.randn(7, 4))
    step = pol.act(inputs)
    assert (
        step.actions.shape == (7, 5)
        and step.logprobs.shape == (7, 5, 1)
        and step.values.shape == (7,)
    )
    again = pol.evaluate(inputs, step.actions)
    torch.testing.assert_close(again["logprobs"], step.logprobs)
    assert again["entropy"].shape == (7, 5, 1)
    assert pol.env_actions(step.actions).shape == (7, 5)


@pytest.mark.parametrize("autograd", [True, False], ids=["autograd", "inference"])
def test_squashed_gaussian_logprob_is_exact(autograd):
    """Both ways ``act`` draws: ``Normal`` with autograd on, by hand (log-prob from the noise)
    under inference mode, as the rollout runs it."""
    low, high = np.array([-2.0, 0.0], dtype=np.float32), np.array([2.0, 1.0], dtype=np.float32)
    pol = MLPActorCritic(
        gym.spaces.Box(-1, 1, (3,)),
        gym.spaces.Box(low, high),
        num_action_chunks=2,
        squash=True,
        init_log_std=-0.5,
    )
    inputs = pol.prepare(torch.randn(5, 3))
    with torch.inference_mode(not autograd):
        step = pol.act(inputs)
    u = step.actions.double()
    with torch.no_grad():
        mean = pol.actor(inputs["obs"]).view(5, 2, 2).double()
        std = pol.log_std.exp().double()
    # log p(a) for a = low + (tanh(u) + 1) / 2 * (high - low), by the change of variables
    scale = torch.tensor((high - low) / 2, dtype=torch.float64)
    ref = Normal(mean, std).log_prob(u) - torch.log(1 - torch.tanh(u) ** 2) - torch.log(scale)
    torch.testing.assert_close(step.logprobs.double(), ref, atol=1e-4, rtol=1e-4)
    env_a = pol.env_actions(step.actions)
    assert (env_a >= low - 1e-6).all() and (env_a <= high + 1e-6).all()


def test_gaussian_drawn_by_hand_matches_normal():
    """The rollout's draw (inference mode): mean + std * noise, its log-prob what ``evaluate``
    (``Normal.log_prob``) gives the same action; the mode is the mean, sampled actions spread
    by std around it."""
    pol = MLPActorCritic(
        gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1.0, 1.0, (2,)), 2, init_log_std=-0.7
    )
    inputs = pol.prepare(torch.randn(4000, 3))
    with torch.inference_mode():
        step, mode = pol.act(inputs), pol.act(inputs, deterministic=True)
        mean = pol.actor(inputs["obs"]).view(-1, 2, 2)
    again = pol.evaluate(inputs, step.actions.clone())["logprobs"]
    torch.testing.assert_close(step.logprobs, again, atol=1e-5, rtol=1e-5)
    assert torch.equal(mode.actions, mean)
    std = (step.actions - mean).std(0)
    torch.testing.assert_close(std, torch.full((2, 2), math.exp(-0.7)), atol=0.03, rtol=0)


def test_gaussian_clips_env_actions_to_bounds():
    pol = MLPActorCritic(
        gym.spaces.Box(-1, 1, (2,)), gym.spaces.Box(-1.0, 1.0, (1,)), init_log_std=2.0
    )
    step = pol.act(pol.prepare(torch.randn(64, 2)))
    a = pol.env_actions(step.actions)
    assert a.max() <= 1.0 and a.min() >= -1.0 and step.actions.abs().max() > 1.0


def test_running_norm_matches_numpy_over_batches():
    norm = RunningNorm((3,))
    data = [np.random.default_rng(i).normal(5, 3, size=(50, 3)) for i in range(4)]
    for d in data:
        norm.update(torch.from_numpy(d))
    allx = np.concatenate(data)
    np.testing.assert_allclose(norm.mean.numpy(), allx.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var.numpy(), allx.var(0), rtol=1e-4)
    out = norm(torch.from_numpy(allx).float())
    assert abs(float(out.mean())) < 1e-3 and abs(float(out.std()) - 1) < 1e-2


def test_policy_registry_errors():
    with pytest.raises(
        ValueError,
        match="model.name: unknown policy .nope.; registered: cnn, flow, mlp, sac_cnn, sac_mlp, vla",
    ):
        build_policy("nope", gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2), 1)
    with pytest.raises(ValueError, match="needs a flat Box observation space"):
        MLPActorCritic(gym.spaces.Discrete(3), gym.spaces.Discrete(2))


@pytest.mark.parametrize(
    "name, kwargs",
    [("mlp", {}), ("sac_mlp", {}), ("vla", {"hidden_size": 16, "num_heads": 2, "num_layers": 1})],
)
def test_loading_a_policy_leaves_its_action_space_alone(name, kwargs):
    """The bounds are the policy's own copies: loading a checkpoint's (other) bounds into them
    writes nothing into the env's action space."""
    obs, act = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-2, 2, (2,), dtype=np.float32)
    policy = build_policy(name, obs, act, 1, **kwargs)
    state = {k: v * 3 if k in ("low", "high") else v for k, v in policy.state_dict().items()}
    policy.load_state_dict(state)
    assert policy.high.tolist() == [6.0, 6.0]
    assert act.low.tolist() == [-2.0, -2.0] and act.high.tolist() == [2.0, 2.0]


def test_gumbel_max_sampling_draws_the_categorical_distribution_and_never_a_masked_action():
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    draws = sample_categorical(probs.log().expand(100_000, 2, 4))
    assert draws.shape == (100_000, 2)
    freq = torch.bincount(draws.flatten(), minlength=4).double() / draws.numel()
    # 200k draws: a frequency's standard error is at most 0.0012
    assert torch.allclose(freq, probs.double(), atol=0.006), freq
    masked = torch.tensor([0.0, float("-inf"), 3.0, float("-inf")]).expand(50_000, 4)
    counts = torch.bincount(sample_categorical(masked), minlength=4)
    assert counts[1] == counts[3] == 0 and counts[0] > 0 and counts[2] > counts[0]


def test_entropy_of_uniform_categorical():
    pol = MLPActorCritic(gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(4))
    with torch.no_grad():
        for p in pol.actor.parameters():
            p.zero_()
    out = pol.evaluate(pol.prepare(torch.randn(3, 2)), torch.zeros(3, 1, dtype=torch.long))
    torch.testing.assert_close(out["entropy"], torch.full((3, 1, 1), math.log(4)))


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Ant-v5"])
def test_a_restored_env_continues_bitwise_as_the_original(env_id):
    """The state of a ChunkedEnv mid-episode, through a weights-only save, into envs made with
    other seeds: both then step identically. Ant reads a body position the last simulator step
    computed, so restoring qpos/qvel alone would not do."""
    import io

    envs = [
        ChunkedEnv(make_env("gymnasium", 2, env_id=env_id), True, seeds)
        for seeds in ([1, 2], [7, 8])
    ]
    for env in envs:
        env.reset()
    space = envs[0].env.action_space
    actions = [np.stack([[space.sample()] for _ in range(2)]) for _ in range(40)]
    for a in actions[:15]:
        envs[0].step(a)
    state, missed = envs[0].state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    envs[1].load_state_dict(torch.load(buffer, weights_only=True))
    assert missed == []
    for a in actions[15:]:
        first, second = (env.step(a) for env in envs)
        assert torch.equal(first.obs, second.obs) and torch.equal(first.rewards, second.rewards)
    assert envs[0].stats.returns == envs[1].stats.returns


@pytest.mark.parametrize("auto_reset,chunk", [(True, 1), (False, 1), (True, 3), (False, 3)])
def test_sync_copies_step_as_gymnasiums_vector_env(auto_reset, chunk):
    """The sync adapter steps its copies in its own loop (masked resets, quiet restarts); the
    async one goes through gymnasium's vector env. On one seed both give the same chunks:
    observations, final observations, rewards, dones and episode stats."""
    envs = [
        ChunkedEnv(
            make_env("gymnasium", 4, env_id="CartPole-v1", vectorization_mode=mode),
            auto_reset,
            [3, 4, 5, 6],
        )
        for mode in ("sync", "async")
    ]
    rng = np.random.default_rng(0)
    try:
        outs = [[env.reset().obs] for env in envs]
        for _ in range(60):
            actions = rng.integers(0, 2, size=(4, chunk))
            for env, out in zip(envs, outs):
                step = env.step(actions)
                out += [step.obs, step.final_obs, step.rewards, step.dones, step.truncations]
        for a, b in zip(*outs):
            assert (a is None and b is None) or torch.equal(a, b)
        assert envs[0].stats.returns == envs[1].stats.returns
        assert envs[0].stats.returns  # episodes did end
    finally:
        for env in envs:
            env.close()


def test_evaluation_seeds_are_one_numbering_over_the_env_ranks_and_held_out_seeds_are_apart():
    from tidal.envs.seeds import evaluation_offset, evaluation_seeds, held_out_seeds

    ranks = [evaluation_seeds(3, 4, first=r * 4) for r in range(2)]
    assert ranks[0] + ranks[1] == evaluation_seeds(3, 8)  # tidal sft's one rank sees the same
    training = set(range(3, 3 + 4096))
    evaluations = {s + evaluation_offset(e) for s in evaluation_seeds(3, 64) for e in range(100)}
    held_out = set(held_out_seeds(3, 64))
    assert not (training & evaluations or training & held_out or evaluations & held_out)
