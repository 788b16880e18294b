"""Advantage estimators against plain float64 NumPy loops written independently here."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.algorithms import (
    compute_gae,
    episode_scores,
    get_advantage,
    group_normalize,
    list_advantages,
    loss_mask_from_dones,
    masked_whiten,
    reduce_chunk_level,
    register_advantage,
)

RNG = np.random.default_rng(0)


# ----------------------------------------------------------------------------- references


def ref_gae(r, v, d, gamma, lam):
    T, B = r.shape
    adv = np.zeros((T, B))
    for b in range(B):
        nxt = 0.0
        for t in range(T - 1, -1, -1):
            nonterm = 1.0 - d[t + 1, b]
            delta = r[t, b] + gamma * v[t + 1, b] * nonterm - v[t, b]
            nxt = delta + gamma * lam * nonterm * nxt
            adv[t, b] = nxt
    return adv, adv + v[:-1]


def ref_reward_to_go(r, d):
    T, B = r.shape
    out = np.zeros((T, B))
    for b in range(B):
        acc = 0.0
        for t in range(T - 1, -1, -1):
            if d[t + 1, b]:
                acc = 0.0
            acc += r[t, b]
            out[t, b] = acc
    return out


def ref_group_norm(s, g, std=True, loo=False, unbiased=True, eps=1e-6):
    out = np.zeros(len(s))
    for start in range(0, len(s), g):
        grp = s[start : start + g]
        for i, x in enumerate(grp):
            if loo and g > 1:
                base = (sum(grp) - x) / (g - 1)
            else:
                base = sum(grp) / g
            val = x - base
            if std:
                if g > 1:
                    mu = sum(grp) / g
                    var = sum((y - mu) ** 2 for y in grp) / (g - 1 if unbiased else g)
                    sd = var**0.5
                else:
                    sd = 0.0
                val = val / (sd + eps)
            out[start + i] = val
    return out


def ref_first_done_mask(d):
    T1, B = d.shape
    mask = np.zeros((T1 - 1, B), dtype=bool)
    for b in range(B):
        for t in range(T1 - 1):
            mask[t, b] = True
            if d[t + 1, b]:
                break
    return mask


def random_dones(T, B, p=0.2):
    return torch.from_numpy(RNG.random((T + 1, B)) < p)


# ----------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("T,B", [(1, 1), (1, 5), (7, 3), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gae_matches_reference(T, B, dtype):
    r = torch.randn(T, B, dtype=torch.float64)
    v = torch.randn(T + 1, B, dtype=torch.float64)
    d = random_dones(T, B)
    adv, ret = compute_gae(r.to(dtype), v.to(dtype), d, gamma=0.97, lam=0.9)
    # the reference sees the inputs at the precision the function received them
    ra, rr = ref_gae(
        r.to(dtype).double().numpy(), v.to(dtype).double().numpy(), d.numpy(), 0.97, 0.9
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    np.testing.assert_allclose(adv.double().numpy(), ra, atol=tol, rtol=tol)
    np.testing.assert_allclose(ret.double().numpy(), rr, atol=tol, rtol=tol)


def test_gae_done_every_step_is_one_step_td():
    r, v = torch.randn(5, 3), torch.randn(6, 3)
    d = torch.ones(6, 3, dtype=torch.bool)
    adv, ret = compute_gae(r, v, d, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, r - v[:-1])
    torch.testing.assert_close(ret, r)


def test_gae_without_values_is_reward_to_go_reset_at_dones():
    r = torch.randn(20, 4, dtype=torch.float64)
    d = random_dones(20, 4, p=0.3)
    adv, ret = compute_gae(r, None, d, gamma=0.5, lam=0.5)  # gamma, lam ignored: critic-free
    np.testing.assert_allclose(adv.numpy(), ref_reward_to_go(r.numpy(), d.numpy()), atol=1e-12)
    torch.testing.assert_close(adv, ret)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_gae_unit_discount_no_dones_is_rtg_minus_values(T, B, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, B, generator=g, dtype=torch.float64)
    v = torch.randn(T + 1, B, generator=g, dtype=torch.float64)
    d = torch.zeros(T + 1, B, dtype=torch.bool)
    adv, ret = compute_gae(r, v, d, 1.0, 1.0)
    rtg = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0]) + v[-1]
    torch.testing.assert_close(adv, rtg - v[:-1])
    torch.testing.assert_close(ret, rtg)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 3), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_gae_lambda_zero_is_td_error(T, B, gamma, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, B, generator=g, dtype=torch.float64)
    v = torch.randn(T + 1, B, generator=g, dtype=torch.float64)
    d = torch.rand(T + 1, B, generator=g) < 0.3
    adv, _ = compute_gae(r, v, d, gamma, 0.0)
    torch.testing.assert_close(adv, r + gamma * v[1:] * (~d[1:]) - v[:-1])


def test_gae_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match=r"values: expected shape \(4, 2\), got \(3, 2\)"):
        compute_gae(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(4, 2), 0.99, 0.95)
    with pytest.raises(ValueError, match="dones"):
        compute_gae(torch.zeros(3, 2), torch.zeros(4, 2), torch.zeros(3, 2), 0.99, 0.95)


# ----------------------------------------------------------------------------- group normalisation


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "std,loo,unbiased",
    [
        (True, False, True),
        (False, False, True),
        (False, True, True),
        (True, True, False),
        (True, False, False),
    ],
)
def test_group_normalize_matches_reference(g, std, loo, unbiased):
    s = torch.randn(32, dtype=torch.float64)
    out = group_normalize(s, g, std=std, leave_one_out=loo, unbiased=unbiased)
    ref = ref_group_norm(s.numpy(), g, std, loo, unbiased)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-9)


def test_group_normalize_degenerate_groups_give_zero_not_nan():
    same = torch.tensor([3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    for kwargs in ({}, {"leave_one_out": True}, {"std": False}):
        assert torch.equal(group_normalize(same, 4, **kwargs), torch.zeros(8))
    assert torch.equal(group_normalize(torch.randn(5), 1), torch.zeros(5))
    assert torch.equal(group_normalize(torch.randn(5), 1, leave_one_out=True), torch.zeros(5))


@pytest.mark.parametrize("std,loo", [(True, False), (False, False), (False, True)])
def test_group_normalize_by_ids_normalises_each_group_apart_whatever_its_size(std, loo):
    """An agent's episodes give a row per call: groups of uneven sizes, rows interleaved."""
    ids = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2, 1, 1, 3])
    s = torch.randn(len(ids), dtype=torch.float64)
    out = group_normalize(s, 4, std=std, leave_one_out=loo, groups=ids)
    for g in range(4):
        rows = (ids == g).nonzero().squeeze(1)
        ref = ref_group_norm(s[rows].numpy(), len(rows), std, loo)
        np.testing.assert_allclose(out[rows].numpy(), ref, atol=1e-9)
    # contiguous groups of group_size rows (every RLVR batch): bit for bit as without ids
    even = torch.arange(12) // 3
    s = torch.randn(12)
    assert torch.equal(
        group_normalize(s, 3, std=std, leave_one_out=loo, groups=even),
        group_normalize(s, 3, std=std, leave_one_out=loo),
    )
    with pytest.raises(ValueError, match=r"groups: expected shape \(12,\), got \(4,\)"):
        group_normalize(s, 3, groups=even[:4])


def test_group_estimators_read_group_ids_when_given():
    T, ids = 4, torch.tensor([0, 0, 0, 1, 1])  # 5 rows: group_size 2 does not divide them
    r = torch.randn(T, len(ids), dtype=torch.float64)
    with pytest.raises(ValueError, match="group_size"):
        get_advantage("grpo")(rewards=r, group_size=2)
    adv, _ = get_advantage("grpo")(rewards=r, group_size=2, groups=ids)
    scores = r.sum(0).numpy()
    expected = np.concatenate([ref_group_norm(scores[:3], 3), ref_group_norm(scores[3:], 2)])
    np.testing.assert_allclose(adv[0].numpy(), expected, atol=1e-9)
    # reinpp_baseline subtracts each group's mean score: moving a row to the other group moves
    # its baseline, so the ids (not blocks of 2) decide it
    base = get_advantage("reinpp_baseline")
    one_step = torch.zeros(1, len(ids), dtype=torch.float64)
    one_step[0] = r.sum(0)
    _, returns = base(rewards=one_step, group_size=2, groups=ids)
    means = np.array([scores[:3].mean()] * 3 + [scores[3:].mean()] * 2)
    np.testing.assert_allclose(returns[0].numpy(), scores - means, atol=1e-9)


def test_group_normalize_rejects_non_dividing_group():
    with pytest.raises(
        ValueError, match="group_size: expected a positive divisor of the batch size 10, got 4"
    ):
        group_normalize(torch.zeros(10), 4)


# ----------------------------------------------------------------------------- whitening and masks


def test_masked_whiten_uses_masked_elements_only():
    x = torch.randn(6, 5, dtype=torch.float64)
    mask = torch.rand(6, 5) > 0.4
    x_bad = x.clone()
    x_bad[~mask] = float("nan")  # padding must not matter
    out = masked_whiten(x_bad, mask)
    vals = x.numpy()[mask.numpy()]
    ref = (vals - vals.mean()) / np.sqrt(vals.var() + 1e-8)
    np.testing.assert_allclose(out.numpy()[mask.numpy()], ref, atol=1e-9)
    assert torch.all(out[~mask] == 0)
    assert torch.equal(
        masked_whiten(x, torch.zeros(6, 5, dtype=torch.bool)),
        torch.zeros(6, 5, dtype=torch.float64),
    )


def test_masked_whiten_without_shift_keeps_mean():
    x = torch.randn(50, dtype=torch.float64) + 3.0
    out = masked_whiten(x, None, shift_mean=False)
    assert abs(out.mean().item() - x.mean().item()) < 1e-9
    assert abs(out.std(correction=0).item() - 1.0) < 1e-6


@pytest.mark.parametrize("T,B", [(1, 3), (10, 6), (30, 2)])
def test_loss_mask_from_dones(T, B):
    d = random_dones(T, B, p=0.25)
    mask, mask_sum = loss_mask_from_dones(d)
    ref = ref_first_done_mask(d.numpy())
    np.testing.assert_array_equal(mask.numpy(), ref)
    np.testing.assert_array_equal(mask_sum.numpy(), np.broadcast_to(ref.sum(0), (T, B)))


def test_episode_scores_sum_up_to_first_done():
    r = torch.randn(12, 5, dtype=torch.float64)
    d = random_dones(12, 5, p=0.2)
    ref = (r.numpy() * ref_first_done_mask(d.numpy())).sum(0)
    np.testing.assert_allclose(episode_scores(r, d).numpy(), ref, atol=1e-12)


def test_reduce_chunk_level_and_action_level():
    r = torch.randn(4, 3, 5)
    d = torch.rand(5, 3, 5) > 0.8
    cr, cd = reduce_chunk_level(r, d, "chunk")
    torch.testing.assert_close(cr, r.sum(-1))
    assert torch.equal(cd, d.any(-1))
    ar, ad = reduce_chunk_level(r, d, "action")
    assert ar.shape == (20, 3) and ad.shape == (21, 3)
    for t in range(4):
        for c in range(5):
            torch.testing.assert_close(ar[t * 5 + c], r[t, :, c])
            assert torch.equal(ad[1 + t * 5 + c], d[t + 1, :, c])
    with pytest.raises(ValueError, match="reward_type"):
        reduce_chunk_level(r, d, "episode")


# ----------------------------------------------------------------------------- registry


def test_registry_lists_builtins_and_rejects_unknown():
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinpp", "reinpp_baseline", "raw"):
        assert name in list_advantages()
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; registered: .*grpo"):
        get_advantage("ppo")


def test_register_custom_estimator_and_refuse_duplicates():
    @register_advantage("test_constant_one")
    def _one(*, rewards, **_):
        return torch.ones_like(rewards), torch.ones_like(rewards)

    adv, _ = get_advantage("test_constant_one")(rewards=torch.zeros(2, 2))
    assert torch.equal(adv, torch.ones(2, 2))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(_one)


def test_registry_gae_equals_compute_gae():
    r, v, d = torch.randn(6, 4), torch.randn(7, 4), random_dones(6, 4)
    a1, r1 = get_advantage("gae")(rewards=r, values=v, dones=d, gamma=0.9, lam=0.8, group_size=2)
    a2, r2 = compute_gae(r, v, d, 0.9, 0.8)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


@pytest.mark.parametrize(
    "name,std,loo", [("grpo", True, False), ("dr_grpo", False, False), ("rloo", False, True)]
)
def test_group_estimators_broadcast_over_valid_steps(name, std, loo):
    T, B, g = 9, 8, 4
    r = torch.randn(T, B, dtype=torch.float64)
    mask = torch.from_numpy(ref_first_done_mask(random_dones(T, B, 0.3).numpy()))
    adv, _ = get_advantage(name)(rewards=r, mask=mask, group_size=g)
    scores = (r.numpy() * mask.numpy()).sum(0)
    per_sample = ref_group_norm(scores, g, std=std, loo=loo)
    np.testing.assert_allclose(adv.numpy(), per_sample[None, :] * mask.numpy(), atol=1e-9)


def test_raw_is_unbaselined_score():
    r = torch.randn(5, 3, dtype=torch.float64)
    adv, ret = get_advantage("raw")(rewards=r)
    np.testing.assert_allclose(adv.numpy(), np.broadcast_to(r.numpy().sum(0), (5, 3)), atol=1e-12)
    torch.testing.assert_close(adv, ret)


def ref_reinpp(r, mask, gamma, baseline_group=None):
    """OpenRLHF's REINFORCE++: rewards zeroed off the mask, the group's mean total reward
    subtracted at each sample's last valid token (baseline), return-to-go discounted through
    every position, whitened over the valid tokens."""
    T, B = r.shape
    tok = r * mask
    if baseline_group:
        totals = tok.sum(0)
        means = totals.reshape(-1, baseline_group).mean(1).repeat(baseline_group)
        for b in range(B):
            valid = np.nonzero(mask[:, b])[0]
            if len(valid):
                tok[valid[-1], b] -= means[b]
    ret = np.zeros((T, B))
    for b in range(B):
        run = 0.0
        for t in range(T - 1, -1, -1):
            run = tok[t, b] + gamma * run
            ret[t, b] = run * mask[t, b]
    vals = ret[mask.astype(bool)]
    mu, var = vals.mean(), vals.var()
    adv = np.where(mask, (ret - mu) / np.sqrt(var + 1e-8), 0.0)
    return adv, ret


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_reinforce_plus_plus(baseline, holes, per_token):
    """Outcome rewards on the last token or per-token rewards (a KL shaped in), on a contiguous
    mask or one with holes (multi-turn: tool tokens between two answers)."""
    L, B = 11, 8  # a language batch [B, L] passed time-major
    g = torch.Generator().manual_seed(int(baseline) + 2 * int(holes) + 4 * int(per_token))
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask_bl = torch.arange(L)[None, :] < lengths[:, None]
    if holes:
        mask_bl &= torch.rand(B, L, generator=g) > 0.3
        mask_bl[torch.arange(B), lengths - 1] = True
    r_bl = torch.zeros(B, L, dtype=torch.float64)
    if per_token:
        r_bl = -0.1 * torch.rand(B, L, generator=g, dtype=torch.float64)
    r_bl[torch.arange(B), lengths - 1] += torch.randn(B, generator=g, dtype=torch.float64)
    name = "reinpp_baseline" if baseline else "reinpp"
    adv, ret = get_advantage(name)(rewards=r_bl.T, mask=mask_bl.T, gamma=0.99, group_size=4)
    ra, rr = ref_reinpp(
        r_bl.T.numpy(), mask_bl.T.numpy().astype(float), 0.99, 4 if baseline else None
    )
    np.testing.assert_allclose(adv.numpy(), ra, atol=1e-9)
    np.testing.assert_allclose(ret.numpy(), rr, atol=1e-9)


def test_reinforce_plus_plus_examples_of_issue_30():
    """Earlier turns get the outcome across masked tokens; a per-token penalty stays per token."""
    _, ret = get_advantage("reinpp")(
        rewards=torch.tensor([[0.0], [0.0], [0.0], [1.0]], dtype=torch.float64),
        mask=torch.tensor([[1], [0], [1], [1]], dtype=torch.bool),
    )
    assert ret[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]  # the masked token's 0 is padding
    _, ret = get_advantage("reinpp")(
        rewards=torch.tensor([[-0.3], [0.0], [1.0]], dtype=torch.float64),
        mask=torch.ones(3, 1, dtype=torch.bool),
    )
    np.testing.assert_allclose(ret[:, 0].numpy(), [0.7, 1.0, 1.0], atol=1e-12)


def test_reinforce_plus_plus_restarts_after_an_embodied_episode_ends():
    rewards = torch.ones(4, 1, dtype=torch.float64)
    dones = torch.tensor([[0], [0], [1], [0], [0]], dtype=torch.bool)  # step 1 ends an episode
    _, ret = get_advantage("reinpp")(rewards=rewards, dones=dones)
    assert ret[:, 0].tolist() == [2.0, 1.0, 2.0, 1.0]


def test_estimators_survive_edge_cases():
    """All-masked batches, T = 1 and zero rewards never produce NaN."""
    for name in list_advantages():
        fn = get_advantage(name)
        for r, m in [
            (torch.zeros(1, 4), None),
            (torch.randn(5, 4), torch.zeros(5, 4, dtype=torch.bool)),
            (torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool)),
        ]:
            adv, ret = fn(
                rewards=r, mask=m, group_size=2, dones=torch.zeros(r.shape[0] + 1, 4), values=None
            )
            assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name


def test_estimators_declare_their_needs():
    """Generic code asks the registry: the critic, groups and bootstrap needs are declared."""
    from tidal.algorithms import advantage_spec

    assert advantage_spec("gae").needs_critic and advantage_spec("gae").needs_bootstrap
    assert all(
        advantage_spec(n).needs_groups for n in ("grpo", "dr_grpo", "rloo", "reinpp_baseline")
    )
    assert "gae" not in list_advantages(needs_critic=False)
    ungrouped = set(list_advantages(needs_groups=False))
    assert {"gae", "raw", "reinpp"} <= ungrouped and not ungrouped & {
        "grpo",
        "rloo",
        "reinpp_baseline",
    }
    with pytest.raises(ValueError, match="algorithm.adv_type: unknown advantage estimator 'ppo'"):
        advantage_spec("ppo")
