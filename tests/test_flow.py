"""The ``flow`` policy: its chain's log-probability, the SDE's marginals, PPO on its own samples,
behaviour cloning then RL, resume, and the settings it refuses."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from embodied_runs import EXAMPLES, assert_resume_is_exact, read_metrics, run

from tidal.algorithms.chunks import chunk_loss_inputs
from tidal.algorithms.objectives import make_objective
from tidal.config import ActorConfig, ConfigError, EmbodiedConfig, load_config
from tidal.engine import TrainEngine
from tidal.envs import LayoutBox, ObsLayout
from tidal.envs.demos import Demonstrations
from tidal.models import build_policy, load_policy, save_policy
from tidal.models.imitation import train_bc
from tidal.runners.preflight import check_embodied, probe_env

ACTIONS = gym.spaces.Box(-1.0, 1.0, (4,), dtype=np.float32)
STATE = LayoutBox(ObsLayout(state_dim=6, num_tokens=5, vocab_size=50))
SMALL = {"hidden_sizes": (32, 32), "expert_sizes": (32, 32)}


@pytest.fixture(autouse=True)
def one_thread():  # two cores shared: one thread is faster
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def packed(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (n, 5), generator=g).float()
    tokens[:, -2:] = 0  # padding
    return torch.cat([torch.randn(n, 6, generator=g), tokens], 1)


def flow_policy(chunks=2, **flow):
    return build_policy("flow", STATE, ACTIONS, chunks, obs_norm=True, flow=flow, **SMALL)


@pytest.mark.parametrize("noise", ["sde", "learned"])
def test_the_chain_logprob_is_the_sum_of_its_gaussian_transitions(noise):
    """Recomputed in float64 from the velocity (and noise head) by the formulas of the docs,
    the densities summed per step match what ``act`` returned and what ``evaluate`` recomputes
    from the stored chain."""
    torch.manual_seed(0)
    policy = flow_policy(steps=4, noise=noise, sigma=0.7)
    with torch.no_grad():  # a noise head that is not constant
        for p in policy.noise_head.parameters():
            p.normal_(0.0, 0.3)
    inputs = policy.prepare(packed(6))
    with torch.no_grad():
        step = policy.act(inputs)
        again = policy.evaluate(step.inputs, step.actions)
    wide = policy.double()
    chain = step.inputs["chain"].double()
    states = torch.cat([chain, step.actions.double()[:, None]], 1)  # x_0 .. x_K
    dt, sigma = 1 / 4, 0.7
    with torch.no_grad():
        h = wide.features(inputs["obs"].double())
        expected = torch.zeros(6, 2, 4, dtype=torch.float64)
        for k in range(4):
            x, t = states[:, k], torch.full((6,), k * dt, dtype=torch.float64)
            v = wide.velocity(h, x, t)
            if noise == "sde":
                mean = x + dt * (v + sigma**2 / 2 * (k * dt * v - x))
                std = torch.full_like(x, sigma * math.sqrt((1 - k * dt) * dt))
            else:
                raw = wide.noise_head(wide._expert_input(h, x, t)).view_as(x)
                mean, std = x + dt * v, sigma * math.sqrt(dt) * torch.exp(2 * torch.tanh(raw))
            expected += torch.distributions.Normal(mean, std).log_prob(states[:, k + 1])
    assert step.logprobs.shape == (6, 2, 4)
    torch.testing.assert_close(step.logprobs.double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again["logprobs"], step.logprobs, rtol=1e-5, atol=1e-5)


def test_the_sde_keeps_the_marginals_of_the_ode():
    """With the exact velocity of a Gaussian target N(m, s^2) in place of the network, the
    SDE's actions (fine steps) have the target's mean and spread, for any sigma."""
    m, s = 0.3, 0.2

    def exact(h, x, t):  # E[x_1 - x_0 | x_t] on the path x_t = (1 - t) x_0 + t x_1
        t = t.view(-1, 1, 1)
        gain = (t * s**2 - (1 - t)) / ((1 - t) ** 2 + (t * s) ** 2)
        return m + gain * (x - t * m)

    space = gym.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)
    obs = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    for sigma in (0.3, 1.0):
        policy = build_policy("flow", obs, space, 1, flow={"steps": 100, "sigma": sigma})
        policy.velocity = exact
        torch.manual_seed(0)
        with torch.no_grad():
            actions = policy.act({"obs": torch.zeros(10_000, 2)}).actions.flatten()
        assert abs(actions.mean().item() - m) < 0.01, (sigma, actions.mean())
        assert abs(actions.std().item() - s) < 0.01, (sigma, actions.std())


def test_as_sigma_shrinks_the_chain_becomes_the_ode():
    torch.manual_seed(0)
    inputs = flow_policy().prepare(packed(8))
    errors = []
    for sigma in (0.3, 0.03, 0.003):
        policy = flow_policy(sigma=sigma)
        policy.load_state_dict(flow_policy(sigma=0.3).state_dict())
        with torch.no_grad():
            policy.expert[-1].weight.normal_(0.0, 0.5)  # a velocity far from zero
            step = policy.act(inputs)
            ode = policy.ode_actions(policy.features(inputs["obs"]), step.inputs["chain"][:, 0])
        errors.append((step.actions - ode).abs().max().item())
    # linear in sigma: measured 0.78, 0.065, 0.010
    assert errors[1] < errors[0] / 5 and errors[2] < errors[1] / 5 and errors[2] < 0.02, errors
    deterministic = policy.act(inputs, deterministic=True)
    torch.testing.assert_close(
        deterministic.actions,
        policy.ode_actions(policy.features(inputs["obs"]), torch.zeros(8, 2, 4)),
    )


@pytest.mark.parametrize("noise", ["sde", "learned"])
def test_the_ppo_ratio_is_one_on_the_behaviour_policys_own_samples(noise):
    """Through the objective every policy trains with: ratio 1, nothing clipped, no KL."""
    torch.manual_seed(0)
    policy = flow_policy(noise=noise)
    inputs = policy.prepare(packed(16))
    with torch.no_grad():
        step = policy.act(inputs)
    micro = {
        "old_logprobs": step.logprobs,
        "advantages": torch.randn(16),
        "mask": torch.ones(16, dtype=torch.bool),
        "versions": torch.zeros(16, dtype=torch.long),
    }
    alg = EmbodiedConfig().algorithm
    for level in ("token", "chunk"):
        out = policy.evaluate(step.inputs, step.actions)
        p, _ = chunk_loss_inputs(micro, out, level, version=0)
        loss, info = make_objective(alg).loss(p)
        assert abs(float(info["ratio_mean"]) - 1) < 1e-5 and float(info["ratio_max"]) < 1 + 1e-4
        assert float(info["clip_frac"]) == 0.0
        loss.backward()  # the loss reaches the expert's weights
    assert policy.expert[0].weight.grad.abs().sum() > 0
    assert (policy.noise_head[0].weight.grad is not None) == (noise == "learned")


def test_behaviour_cloning_is_flow_matching_and_imitates_the_demos():
    """The clone's ODE action is the expert's (a function of the state and the words)."""
    torch.manual_seed(0)
    obs = packed(512, seed=1)
    expert = torch.tanh(obs[:, :4] + 0.1 * obs[:, 6:7])  # depends on state and first word
    demos = Demonstrations(
        obs=obs.numpy(),
        actions=expert.numpy(),
        episode=np.arange(512),
        tasks=["t"] * 512,
        instructions=["i"] * 512,
        successes=np.ones(512, dtype=bool),
    )
    policy = flow_policy(chunks=1)
    engine = TrainEngine(policy, ActorConfig(lr=3e-3, max_grad_norm=1.0), 400, name="bc")
    history = train_bc(policy, demos, engine, steps=400, batch_size=128, log_every=200)
    assert history[-1]["bc/loss"] < 0.5 * history[0]["bc/loss"], history
    assert history[-1]["bc/action_error"] < 0.1, history


class TargetReach(gym.Env):
    """One step: reach the target the observation shows; reward minus the distance."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = self.np_random.uniform(-0.6, 0.6, 2).astype(np.float32)
        return self.target.copy(), {}

    def step(self, action):
        reward = -float(np.linalg.norm(np.asarray(action) - self.target))
        return self.target.copy(), reward, True, False, {}


gym.register("TidalTargetReach-v0", entry_point=TargetReach, max_episode_steps=1)
REACH = [
    "env.id=TidalTargetReach-v0",
    "env.total_num_envs=16",
    "env.eval_num_envs=16",
    "rollout.num_steps=8",
    "model.name=flow",
    "model.hidden_sizes=[64,64]",
    "model.activation=gelu",
    "model.init_log_std=0.0",
    "model.obs_norm=false",
    "model.kwargs={expert_sizes: [64, 64]}",
    "algorithm.gamma=0.0",
    "algorithm.reward_scale=1.0",
    "algorithm.update_epochs=4",
    "actor.global_batch_size=64",
    "actor.micro_batch_size=64",
    "actor.lr=1e-3",
    "actor.lr_schedule=constant",
    "runner.eval_interval=5",
    "runner.target_value=null",
]


GRPO = [
    "algorithm.adv_type=grpo",
    "env.group_size=4",
    "env.auto_reset=false",
    "env.total_num_envs=64",
    "rollout.num_steps=1",
    "algorithm.vf_coef=0.0",
]
ASYNC = ["rollout.max_staleness=1", "algorithm.use_decoupled_loss=true"]


@pytest.mark.parametrize(
    "variant",
    [[], [*GRPO], [*ASYNC, "model.flow.noise=learned"]],
    ids=["ppo-sde", "grpo-sde", "async-decoupled-ppo-learned"],
)
def test_rl_after_behaviour_cloning_corrects_a_biased_clone(tmp_path, variant):
    """Demonstrations that miss every target by 0.3 clone into a policy that misses by about
    as much; PPO or GRPO on the flow chain, synchronous or asynchronous (the decoupled loss),
    closes most of the gap."""
    rng = np.random.default_rng(0)
    targets = rng.uniform(-0.6, 0.6, (1024, 2)).astype(np.float32)
    biased = np.clip(targets + [0.3, 0.0] + rng.normal(0, 0.05, targets.shape), -1, 1)
    demos = Demonstrations(
        obs=targets,
        actions=biased.astype(np.float32),
        episode=np.arange(1024),
        tasks=["reach"] * 1024,
        instructions=["reach"] * 1024,
        successes=np.ones(1024, dtype=bool),
    )
    torch.manual_seed(0)
    cfg = load_config(EmbodiedConfig, EXAMPLES / "pendulum_ppo.yaml", REACH)
    from tidal.models.factory import build_from_config

    space = TargetReach.observation_space
    policy = build_from_config(cfg.model, space, TargetReach.action_space, 1)
    engine = TrainEngine(policy, ActorConfig(lr=3e-3, max_grad_norm=1.0), 300, name="bc")
    train_bc(policy, demos, engine, steps=300, batch_size=256, log_every=300)
    save_policy(policy, tmp_path / "clone")
    summary = run(
        EXAMPLES / "pendulum_ppo.yaml",
        tmp_path,
        *REACH,
        f"model.path={tmp_path / 'clone'}",
        "runner.max_steps=10",
        *variant,
    )
    rows = read_metrics(summary["run_dir"])
    evals = [r["eval/return_mean"] for r in rows if "eval/return_mean" in r]
    # measured: -0.36 (the clone), -0.08 to -0.15 after 5 updates, -0.03 after 10
    assert evals[0] < -0.25 and evals[-1] > -0.08, evals
    assert max(r.get("staleness/max", 0) for r in rows) == (1 if ASYNC[0] in variant else 0)


def test_a_flow_run_resumes_exactly(tmp_path):
    assert_resume_is_exact(
        tmp_path,
        EXAMPLES / "pendulum_ppo.yaml",
        [*REACH, "model.flow.noise=learned", "runner.eval_interval=1"],
        resume_at=2,
        max_steps=3,
    )


def test_a_training_step_does_not_depend_on_the_micro_batch_size(tmp_path):
    from safetensors.torch import load_file

    def weights(micro):
        summary = run(
            EXAMPLES / "pendulum_ppo.yaml",
            tmp_path / f"micro{micro}",
            *REACH,
            f"actor.micro_batch_size={micro}",
            "algorithm.update_epochs=1",
            "runner.max_steps=1",
            "runner.eval_interval=0",
        )
        assert read_metrics(summary["run_dir"])[0]["train/grad_norm"] > 0
        return load_file(f"{summary['checkpoint']}/model.safetensors")

    whole, split = weights(64), weights(16)
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-5, atol=1e-6)


def test_a_cloned_policy_acts_with_the_runs_flow_settings(tmp_path):
    """``model.flow`` is how the chain samples, not what it learned: RL from a saved clone
    takes the run's (a noise head is always there, so sde and learned load each other)."""
    saved = flow_policy(steps=10, noise="sde", sigma=0.5)
    save_policy(saved, tmp_path / "p")
    loaded = load_policy(
        tmp_path / "p",
        run_settings={"flow": {"steps": 4, "noise": "learned", "sigma": 0.2}, "critic": False},
    )
    assert (loaded.steps, loaded.noise, loaded.sigma) == (4, "learned", 0.2)
    assert loaded.critic is not None  # not a run setting: the saved folder's
    for k, v in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


FLOW = ["model.name=flow", "model.init_log_std=0.0"]


@pytest.mark.parametrize(
    "overrides,key",
    [
        ([*FLOW, "model.flow.steps=0"], "model.flow.steps"),
        ([*FLOW, "model.flow.sigma=0.0"], "model.flow.sigma"),
        ([*FLOW, "model.flow.noise=ode"], "model.flow.noise"),
        ([*FLOW, "model.kwargs={flow: {steps: 4}}"], "model.kwargs.flow"),
        (["model.flow.steps=4"], "model.flow"),  # the mlp policy has no chain
    ],
)
def test_bad_flow_settings_name_their_key(overrides, key):
    cfg = load_config(EmbodiedConfig, EXAMPLES / "pendulum_ppo.yaml", overrides)
    with pytest.raises(ConfigError, match=key):
        check_embodied(cfg)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"hidden_sizes": ()}, "model.hidden_sizes"),
        ({"time_dim": 7}, "model.kwargs.time_dim"),
        ({"flow": {"step": 4}}, "model.flow.step"),
    ],
)
def test_bad_constructor_arguments_name_their_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build_policy("flow", STATE, ACTIONS, 1, **kwargs)


@pytest.mark.parametrize(
    "config,overrides,key",
    [
        ("cartpole_ppo.yaml", [], "model.name"),
        ("pendulum_sac.yaml", [], "algorithm.name"),
        ("pendulum_ppo.yaml", ["algorithm.entropy_bonus=0.01"], "algorithm.entropy_bonus"),
    ],
)
def test_a_flow_policy_with_what_it_cannot_train_is_a_config_error(config, overrides, key):
    with pytest.raises(ConfigError, match=key):
        probe_env(load_config(EmbodiedConfig, EXAMPLES / config, [*FLOW, *overrides]))


def test_an_entropy_bonus_is_allowed_with_a_learned_noise():
    learned = [*FLOW, "algorithm.entropy_bonus=0.01", "model.flow.noise=learned"]
    probe_env(load_config(EmbodiedConfig, EXAMPLES / "pendulum_ppo.yaml", learned))


def test_pixels_reach_the_expert_through_the_cnn_encoder():
    """Observations with pixels: the chain's log-prob depends on the image (its gradient
    reaches the convolutions) and is recomputed exactly from the stored chain."""
    pixels = LayoutBox(ObsLayout(state_dim=3, num_tokens=4, vocab_size=50, image_size=16))
    policy = build_policy("flow", pixels, ACTIONS, 1, channels=(8,), feature_dim=32, **SMALL)
    g = torch.Generator().manual_seed(0)
    obs = torch.cat(
        [
            torch.randn(4, 3, generator=g),
            torch.randint(1, 50, (4, 4), generator=g).float(),
            torch.randint(0, 256, (4, 16 * 16 * 3), generator=g).float(),
        ],
        1,
    )
    inputs = policy.prepare(obs)
    with torch.no_grad():
        step = policy.act(inputs)
    out = policy.evaluate(step.inputs, step.actions)
    torch.testing.assert_close(out["logprobs"], step.logprobs, rtol=1e-5, atol=1e-5)
    out["logprobs"].sum().backward()
    assert policy.encoder[0].weight.grad.abs().sum() > 0
