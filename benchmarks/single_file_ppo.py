"""A single-file PPO for CartPole-v1 with the widely published defaults (CleanRL's ppo.py):
4 envs x 128 steps, lr 2.5e-4 annealed, 4 epochs, 4 minibatches, gamma 0.99, lambda 0.95,
clip 0.2, entropy 0.01, value 0.5, grad norm 0.5. It is the baseline the time-to-solve
benchmark measures tidal against; it evaluates exactly as tidal does (deterministic policy,
8 eval envs, one episode each) so "solved" means the same for both.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical


def layer(n_in, n_out, std=2**0.5):
    lin = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.zeros_(lin.bias)
    return lin


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.critic = nn.Sequential(
            layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0)
        )
        self.actor = nn.Sequential(
            layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, n_actions, 0.01)
        )

    def act(self, x, action=None):
        dist = Categorical(logits=self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x).squeeze(-1)


def evaluate(agent, seed, num_envs=8):
    envs = gym.make_vec(
        "CartPole-v1",
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED},
    )
    obs, _ = envs.reset(seed=[seed + i for i in range(num_envs)])
    returns, alive = np.zeros(num_envs), np.ones(num_envs, dtype=bool)
    while alive.any():
        with torch.no_grad():
            action = agent.actor(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()
        obs, reward, term, trunc, _ = envs.step(action)
        returns += reward * alive
        alive &= ~(term | trunc)
        if (term | trunc).any():  # DISABLED mode: restart finished copies to keep stepping
            obs, _ = envs.reset(options={"reset_mask": term | trunc})
    envs.close()
    return returns.mean()


def train(
    seed=1,
    total_timesteps=500_000,
    num_envs=4,
    num_steps=128,
    lr=2.5e-4,
    epochs=4,
    minibatches=4,
    gamma=0.99,
    lam=0.95,
    clip=0.2,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.5,
    eval_every=2,
    target=475.0,
):
    torch.manual_seed(seed)
    np.random.seed(seed)
    start = time.perf_counter()
    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")
    agent = Agent(4, 2)
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    batch = num_envs * num_steps
    updates = total_timesteps // batch
    obs_buf = torch.zeros(num_steps, num_envs, 4)
    act_buf = torch.zeros(num_steps, num_envs, dtype=torch.long)
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros(num_steps, num_envs) for _ in range(4))
    obs = torch.as_tensor(envs.reset(seed=seed)[0])
    done = torch.zeros(num_envs)
    steps = 0
    for update in range(1, updates + 1):
        optimizer.param_groups[0]["lr"] = lr * (1.0 - (update - 1.0) / updates)
        for t in range(num_steps):
            obs_buf[t], done_buf[t] = obs, done
            with torch.no_grad():
                action, logp, _, value = agent.act(obs)
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            next_obs, reward, term, trunc, _ = envs.step(action.numpy())
            rew_buf[t] = torch.as_tensor(reward)
            obs, done = (
                torch.as_tensor(next_obs),
                torch.as_tensor(term | trunc, dtype=torch.float32),
            )
        steps += batch
        with torch.no_grad():
            next_value = agent.critic(obs).squeeze(-1)
            adv = torch.zeros_like(rew_buf)
            last = 0
            for t in reversed(range(num_steps)):
                nonterminal = 1.0 - (done if t == num_steps - 1 else done_buf[t + 1])
                next_v = next_value if t == num_steps - 1 else val_buf[t + 1]
                delta = rew_buf[t] + gamma * next_v * nonterminal - val_buf[t]
                adv[t] = last = delta + gamma * lam * nonterminal * last
            ret = adv + val_buf
        b_obs, b_act, b_logp = obs_buf.reshape(-1, 4), act_buf.reshape(-1), logp_buf.reshape(-1)
        b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), val_buf.reshape(-1)
        mb = batch // minibatches
        for _ in range(epochs):
            perm = torch.randperm(batch)
            for s in range(0, batch, mb):
                i = perm[s : s + mb]
                _, logp, ent, v = agent.act(b_obs[i], b_act[i])
                ratio = (logp - b_logp[i]).exp()
                a = b_adv[i]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_clipped = b_val[i] + (v - b_val[i]).clamp(-clip, clip)
                v_loss = 0.5 * torch.max((v - b_ret[i]) ** 2, (v_clipped - b_ret[i]) ** 2).mean()
                loss = pg - ent_coef * ent.mean() + vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
                optimizer.step()
        if update % eval_every == 0 and evaluate(agent, seed + 10**6 + update) >= target:
            return {"solved": True, "env_steps": steps, "wall_time": time.perf_counter() - start}
    return {"solved": False, "env_steps": steps, "wall_time": time.perf_counter() - start}


if __name__ == "__main__":
    print(train())
