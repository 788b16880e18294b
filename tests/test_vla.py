"""Token-action (VLA) and CNN policies, saving as a folder, demonstrations and behaviour cloning."""

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch

from tidal.config import ActorConfig
from tidal.engine import TrainEngine
from tidal.envs import LayoutBox, ObsLayout, make_env
from tidal.envs.demos import Demonstrations, collect_metaworld_demos
from tidal.models import build_policy, load_policy, save_policy
from tidal.models.imitation import bc_loss, evaluate_success, train_bc
from tidal.models.vla import GREEDY

ACTIONS = gym.spaces.Box(-1.0, 1.0, (4,), dtype=np.float32)
STATE = LayoutBox(ObsLayout(state_dim=6, num_tokens=5, vocab_size=50))
PIXELS = LayoutBox(ObsLayout(state_dim=3, num_tokens=4, vocab_size=50, image_size=16))
SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2}


def packed(space: LayoutBox, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lay = space.layout
    state = torch.randn(n, lay.state_dim, generator=g)
    tokens = torch.randint(1, lay.vocab_size, (n, lay.num_tokens), generator=g).float()
    tokens[:, -2:] = 0  # padding
    pixels = torch.randint(0, 256, (n, lay.image_numel), generator=g).float()
    return torch.cat([state, tokens, pixels], 1)


@pytest.mark.parametrize("chunks", [1, 3])
def test_vla_token_logprobs_are_consistent_and_start_uniform(chunks):
    policy = build_policy("vla", STATE, ACTIONS, chunks, **SMALL)
    inputs = policy.prepare(packed(STATE, 5))
    with torch.no_grad():  # as the rollout acts: eval mode (the transformer's fast path), no grad
        step = policy.eval().act(inputs)
    policy.train()
    assert step.actions.shape == step.logprobs.shape == (5, chunks, 4) and step.values.shape == (5,)
    assert (
        step.actions.dtype == torch.int64 and 0 <= step.actions.min() and step.actions.max() < 256
    )
    torch.testing.assert_close(
        step.logprobs, torch.full_like(step.logprobs, -math.log(256))
    )  # zero-init head
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        step = policy.eval().act(inputs)
    policy.train()
    again = policy.evaluate(inputs, step.actions)
    torch.testing.assert_close(again["logprobs"], step.logprobs)
    assert again["logprobs"].std() > 0.01  # no longer uniform: the comparison means something
    assert again["entropy"].shape == (5, chunks, 4)
    torch.testing.assert_close(again["values"], policy.value(inputs))
    assert policy.env_actions(step.actions).shape == (5, chunks, 4)


def test_vla_bins_follow_openvla_discretisation():
    policy = build_policy(
        "vla",
        STATE,
        gym.spaces.Box(np.array([-1, -1, 0, -2]), np.array([1, 1, 1, 2]), dtype=np.float32),
        1,
        **SMALL,
    )
    env = torch.tensor([[[-1.0, 1.0, 0.5, 0.0]]])
    bins = policy.policy_actions(env)
    assert bins.tolist() == [[[0, 255, 128, 128]]]
    centres = policy.env_actions(bins)
    np.testing.assert_allclose(
        centres, [[[-1 + 1 / 256, 1 - 1 / 256, 0.5 + 0.5 / 256, 2 / 256]]], rtol=1e-6
    )
    any_action = torch.rand(100, 1, 4) * 2 - 1
    recovered = policy.env_actions(policy.policy_actions(any_action))[..., :2]
    assert (
        np.abs(recovered - any_action[..., :2].numpy()).max() <= 1 / 256 + 1e-6
    )  # within half a bin


def test_greedy_action_is_the_likeliest_bin_or_the_one_nearest_the_mean(tmp_path):
    """Two modes 100 bins apart, the lower one likelier: argmax takes it, mean the bin between
    them (its distribution's mean); the choice is saved with the folder."""
    policies = {g: build_policy("vla", STATE, ACTIONS, 1, greedy=g, **SMALL) for g in GREEDY}
    logits = torch.full((256,), -30.0)
    logits[[50, 150]] = torch.tensor([0.6, 0.4]).log()
    for policy in policies.values():
        with torch.no_grad():
            policy.action_head.bias.copy_(logits)  # the head's weights start at zero
    obs = policy.prepare(packed(STATE, 3))
    assert (policies["argmax"].act(obs, deterministic=True).actions == 50).all()
    assert (policies["mean"].act(obs, deterministic=True).actions == 90).all()
    loaded = load_policy(save_policy(policies["mean"], tmp_path / "p"))
    assert (loaded.act(loaded.prepare(packed(STATE, 3)), deterministic=True).actions == 90).all()
    with pytest.raises(ValueError, match="model.kwargs.greedy: expected one of argmax, mean"):
        build_policy("vla", STATE, ACTIONS, 1, greedy="median", **SMALL)


def test_vla_and_cnn_see_pixels_and_learn_through_them():
    obs = packed(PIXELS, 4)
    for name, kwargs, encoder in (
        ("vla", SMALL, "patches"),
        ("cnn", {"channels": (8, 8)}, "encoder"),
    ):
        policy = build_policy(name, PIXELS, ACTIONS, 2, **kwargs)
        with torch.no_grad():  # off the vla's zero-initialised action head
            for p in policy.parameters():
                p.add_(0.01 * torch.randn_like(p))
        step = policy.act(policy.prepare(obs))
        assert step.logprobs.shape == (4, 2, 4) and step.values.shape == (4,)
        out = policy.evaluate(policy.prepare(obs), step.actions)
        out["logprobs"].sum().backward()  # the actor's loss trains the encoder
        grad = next(getattr(policy, encoder).parameters()).grad
        assert grad is not None and grad.abs().sum() > 0, name
        other = obs.clone()
        other[:, 7:] = 255 - other[:, 7:]  # same state and words, other image
        with torch.no_grad():
            assert not torch.allclose(
                policy.value(policy.prepare(other)), policy.value(policy.prepare(obs))
            )


def test_bad_policy_options_name_their_key():
    with pytest.raises(ValueError, match="model 'cnn': needs pixel observations .*env.obs_mode"):
        build_policy("cnn", STATE, ACTIONS, 1)
    with pytest.raises(ValueError, match="model.patch_size: 5 must divide env.image_size 16"):
        build_policy("vla", PIXELS, ACTIONS, 1, patch_size=5)
    with pytest.raises(ValueError, match="model 'vla': needs a flat Box action space"):
        build_policy("vla", STATE, gym.spaces.Discrete(3), 1)
    with pytest.raises(ValueError, match="model.path: .* is not a saved policy"):
        load_policy("/nonexistent/policy")
    with pytest.raises(ValueError, match="bc_loss: the batch has no 'actions'"):
        bc_loss(build_policy("vla", STATE, ACTIONS, 1, **SMALL), {"obs": packed(STATE, 2)})


@pytest.mark.parametrize(
    "name,space,kwargs",
    [
        ("vla", PIXELS, {**SMALL, "obs_norm": True}),
        ("cnn", PIXELS, {"channels": (8,)}),
        ("mlp", gym.spaces.Box(-1, 1, (5,)), {"squash": True}),
    ],
)
def test_saved_folder_rebuilds_the_same_policy(tmp_path, name, space, kwargs):
    policy = build_policy(name, space, ACTIONS, 2, **kwargs)
    obs = packed(space, 6) if isinstance(space, LayoutBox) else torch.randn(6, 5)
    if policy.obs_norm is not None:
        policy.obs_norm.update(obs * 3 + 1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = save_policy(policy, tmp_path / "policy")
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_policy(folder)
    assert type(loaded) is type(policy)
    step = policy.act(policy.prepare(obs))
    torch.testing.assert_close(
        loaded.evaluate(loaded.prepare(obs), step.actions)["logprobs"], step.logprobs
    )


def test_action_chunks_hold_the_last_action_past_an_episode_end():
    demos = Demonstrations(
        obs=np.zeros((5, 1), np.float32),
        actions=np.arange(5, dtype=np.float32)[:, None],
        episode=np.array([0, 0, 0, 1, 1]),
        tasks=["a", "a"],
        instructions=["x", "x"],
        successes=np.array([True, True]),
    )
    assert demos.action_chunks(3)[..., 0].tolist() == [
        [0, 1, 2],
        [1, 2, 2],
        [2, 2, 2],
        [3, 4, 4],
        [4, 4, 4],
    ]


def test_mlp_policy_actions_invert_env_actions():
    policy = build_policy("mlp", gym.spaces.Box(-1, 1, (3,)), ACTIONS, 2, squash=True)
    raw = torch.randn(4, 2, 4)
    back = policy.policy_actions(torch.from_numpy(policy.env_actions(raw)))
    torch.testing.assert_close(back, raw, atol=1e-3, rtol=1e-3)


@pytest.fixture
def one_thread():
    """Small models train several times faster on one intra-op thread on a shared 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_behaviour_cloning_on_scripted_demos_raises_reach_success(one_thread):
    warnings.filterwarnings("ignore", message="Constant")
    torch.manual_seed(0)
    demos = collect_metaworld_demos(
        "reach-v3", 10, action_noise=0.2, max_episode_steps=100, instruction_tokens=4
    )
    assert (
        demos.num_episodes == 10
        and demos.successes.all()
        and len(set(demos.obs[:, 36].tolist())) == 10
    )
    env = make_env("metaworld", 8, env_id="reach-v3", max_episode_steps=100, instruction_tokens=4)
    policy = build_policy(
        "vla",
        env.observation_space,
        env.action_space,
        1,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        state_tokens=2,
        obs_norm=True,
    )
    seeds = list(range(1000, 1008))
    before = evaluate_success(policy, env, seeds)["eval/success_rate"]
    engine = TrainEngine(
        policy, ActorConfig(lr=5e-3, optimizer="adamw", max_grad_norm=1.0), 300, name="bc"
    )
    history = train_bc(policy, demos, engine, steps=300, batch_size=64, log_every=150)
    after = evaluate_success(policy, env, seeds)
    assert [h["step"] for h in history] == [1, 150, 300]
    assert (
        history[-1]["bc/loss"]
        < history[1]["bc/loss"]
        < history[0]["bc/loss"]
        <= math.log(256) + 1e-4
    )
    # measured: 0/8 before, 4/8 after (2 cores, seed 0)
    assert before <= 0.125 and after["eval/success_rate"] >= 0.25, (before, after)
    env.close()
    # the same 8 episodes in two rounds on 4 copies (tidal eval --episodes 500 holds no 500 envs)
    env = make_env("metaworld", 4, env_id="reach-v3", max_episode_steps=100, instruction_tokens=4)
    assert evaluate_success(policy, env, seeds) == after
    with pytest.raises(ValueError, match="6 seeds for rounds of 4 env copies"):
        evaluate_success(policy, env, seeds[:6])
    env.close()


def test_eval_rounds_divide_the_episodes():
    from tidal.runners.embodied.eval import copies_per_round

    assert [copies_per_round(e, m) for e, m in [(500, 50), (64, 10), (7, 4), (3, 10), (10, 0)]] == [
        50, 8, 1, 3, 1
    ]  # fmt: skip


def test_eval_says_when_tasks_weigh_unequally_in_the_mean():
    from tidal.runners.embodied.eval import unequal_task_weights

    assert (
        unequal_task_weights(list("abcabc"), 3) is None
        and unequal_task_weights(["a"] * 4, 1) is None
    )
    assert unequal_task_weights(list("abca"), 3) == (
        "4 env copies per round run 3 of the 3 tasks, 1 to 2 copies each: eval/success_rate "
        "weighs tasks unequally (the per-task rates are exact); ask for a multiple of 3 "
        "episodes with env.eval_num_envs a multiple of 3"
    )
    assert "run 2 of the 3 tasks" in unequal_task_weights(list("ab"), 3)  # one never evaluated


@pytest.mark.parametrize("detached", [True, False])
@pytest.mark.parametrize("name,kwargs", [("cnn", {"channels": (8,)}), ("vla", SMALL)])
def test_value_loss_moves_the_actor_only_when_the_critic_is_not_detached(name, kwargs, detached):
    """Critic-only training (``critic_warmup_steps``) must leave a cloned policy's actions as
    they were: with ``critic_detached`` the value loss cannot move what the actor reads."""
    policy = build_policy(name, PIXELS, ACTIONS, 1, critic_detached=detached, **kwargs)
    with torch.no_grad():  # an actor that is not uniform (the vla's action head starts at zero)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.eval()  # no dropout: only the weights can change the outputs
    inputs = policy.prepare(packed(PIXELS, 8))

    def actor_logprobs():
        with torch.no_grad():
            return policy.evaluate(inputs, actions)["logprobs"]

    actions = policy.act(inputs).actions
    before, values = actor_logprobs(), policy.value(inputs).detach()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        ((policy.value(inputs) - 50.0) ** 2).mean().backward()
        optimizer.step()
    assert (policy.value(inputs).detach() - values).abs().min() > 0.01  # the critic did learn
    moved = (actor_logprobs() - before).abs().max()
    assert (moved == 0) if detached else (moved > 1e-4)


def test_cnn_random_shift_moves_only_the_image_within_its_bound():
    size, pad = PIXELS.layout.image_size, 2
    policy = build_policy("cnn", PIXELS, ACTIONS, 1, channels=(8,), augment_shift=pad)
    obs = packed(PIXELS, 16)
    shifted = policy.augment(obs, torch.Generator().manual_seed(0))
    head = PIXELS.layout.state_dim + PIXELS.layout.num_tokens
    torch.testing.assert_close(shifted[:, :head], obs[:, :head])
    images = obs[:, head:].reshape(-1, size, size, 3)
    out = shifted[:, head:].reshape(-1, size, size, 3)
    offsets = set()
    for image, moved in zip(images, out):
        # the shift that reproduces the crop's interior (away from the replicated border)
        found = [
            (dy, dx)
            for dy in range(-pad, pad + 1)
            for dx in range(-pad, pad + 1)
            if torch.equal(
                moved[pad : size - pad, pad : size - pad],
                image[pad + dy : size - pad + dy, pad + dx : size - pad + dx],
            )
        ]
        assert len(found) == 1
        offsets.add(found[0])
    assert len(offsets) > 3  # random, not one fixed offset
    assert torch.equal(
        build_policy("cnn", PIXELS, ACTIONS, 1, channels=(8,)).augment(obs, None), obs
    )


@pytest.mark.parametrize("name", ["mlp", "vla"])
def test_obs_norm_is_applied_when_asked_for(name):
    from tidal.models.policy import RunningNorm, build_policy

    layout = ObsLayout(state_dim=3, num_tokens=2, vocab_size=16)
    space = LayoutBox(layout) if name == "vla" else gym.spaces.Box(-9.0, 9.0, (3,))
    action_space = gym.spaces.Box(-1.0, 1.0, (2,))
    kwargs = {"hidden_size": 8, "num_layers": 1, "num_heads": 2} if name == "vla" else {}
    policy = build_policy(name, space, action_space, 1, obs_norm=True, **kwargs)
    assert isinstance(policy.obs_norm, RunningNorm)  # not shadowed by a class attribute
    obs = torch.cat([torch.randn(64, 3) * 4 + 5, torch.ones(64, space.shape[0] - 3)], 1)
    policy.obs_norm.update(obs)
    state = policy.prepare(obs)["obs"][:, :3]
    assert state.mean(0).abs().max() < 1e-4 and (state.std(0) - 1).abs().max() < 0.05
    assert build_policy(name, space, action_space, 1, **kwargs).obs_norm is None
