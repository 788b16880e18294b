"""Losses, KL estimators and the proximal approximation against float64 NumPy references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.algorithms import (
    aggregate_loss,
    decoupled_ppo_loss,
    kl_estimate,
    loglinear_prox_logp,
    ppo_policy_loss,
    reshape_logprobs,
    value_loss,
)

# ----------------------------------------------------------------------------- references


def ref_surrogate(r, a, lo, hi, dual):
    out = np.zeros_like(r)
    for i in np.ndindex(r.shape):
        u = -a[i] * r[i]
        c = -a[i] * min(max(r[i], 1 - lo), 1 + hi)
        loss = max(u, c)
        if dual is not None and a[i] < 0:
            loss = min(loss, -dual * a[i])
        out[i] = loss
    return out


def ref_agg(L, mask, agg, mask_sums=None, max_steps=None):
    if agg == "token-mean":
        n = mask.sum()
        return (L * mask).sum() / max(n, 1)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        vals = []
        for i in range(L.shape[0]):
            n = mask[i].sum()
            if n == 0:
                continue
            s = (L[i] * mask[i]).sum()
            vals.append(s / n if agg == "seq-mean-token-mean" else s)
        return float(np.mean(vals)) if vals else 0.0
    if agg == "embodied-ratio":
        return float(np.mean(L / (mask_sums / max_steps) * mask))
    raise AssertionError


def make_batch(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.25
    return logp.to(dtype), old.to(dtype), adv.to(dtype), mask


# ----------------------------------------------------------------------------- PPO


@pytest.mark.parametrize("shape", [(1,), (7,), (4, 9), (3, 5, 6)])
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_policy_loss_matches_reference(shape, dual, lo, hi):
    logp, old, adv, mask = make_batch(shape)
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, lo, hi, dual_clip=dual)
    r = np.exp(logp.numpy() - old.numpy())
    ref = ref_surrogate(r, adv.numpy(), lo, hi, dual)
    m = mask.numpy()
    assert abs(loss.item() - ref_agg(ref, m, "token-mean")) < 1e-10
    clipped = np.array(
        [-a * min(max(x, 1 - lo), 1 + hi) > -a * x for x, a in zip(r.ravel(), adv.numpy().ravel())]
    ).reshape(r.shape)
    assert abs(metrics["clip_frac"].item() - (clipped * m).sum() / max(m.sum(), 1)) < 1e-10
    if m.any():
        assert abs(metrics["ratio_max"].item() - r[m].max()) < 1e-10
        kl = (r - 1) - np.log(r)
        assert abs(metrics["approx_kl"].item() - kl[m].mean()) < 1e-10


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_aggregations(agg):
    logp, old, adv, mask = make_batch((6, 10), seed=3)
    mask[2] = False  # a sequence with no valid token is left out of the sequence mean
    loss, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, agg=agg)
    ref = ref_surrogate(np.exp(logp.numpy() - old.numpy()), adv.numpy(), 0.2, 0.2, None)
    assert abs(loss.item() - ref_agg(ref, mask.numpy(), agg)) < 1e-10


def test_embodied_ratio_aggregation():
    L = torch.rand(8, 4, dtype=torch.float64)
    mask = torch.rand(8, 4) > 0.3
    mask_sums = mask.sum(0, keepdim=True).expand(8, 4).double()
    out = aggregate_loss(L, mask, "embodied-ratio", loss_mask_sum=mask_sums, max_episode_steps=8)
    assert (
        abs(out.item() - ref_agg(L.numpy(), mask.numpy(), "embodied-ratio", mask_sums.numpy(), 8))
        < 1e-12
    )
    with pytest.raises(ValueError, match="loss_mask_sum and max_episode_steps"):
        aggregate_loss(L, mask, "embodied-ratio")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ppo_low_precision_inputs(dtype):
    logp, old, adv, mask = make_batch((5, 8), seed=1)
    loss64, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    loss, _ = ppo_policy_loss(logp.to(dtype), old.to(dtype), adv.to(dtype), mask, 0.2, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    assert abs(loss.item() - loss64.item()) < tol


def test_ppo_gradient_flows_and_vanishes_when_clipped():
    logp = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.0, -1.0, 1.0], dtype=torch.float64)  # ratios 1, e, 1/e
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, _ = ppo_policy_loss(logp, old, adv, None, 0.2, 0.2)
    loss.backward()
    # the first element is inside the trust region; the other two are clipped (no gradient)
    np.testing.assert_allclose(logp.grad.numpy(), [-1 / 3, 0.0, 0.0], atol=1e-12)


def test_ppo_edge_cases_no_nan():
    logp = torch.tensor([0.0, -80.0, 50.0, float("nan"), float("-inf")], requires_grad=True)
    old = torch.tensor([-60.0, 0.0, 0.0, 0.0, 0.0])
    adv = torch.tensor([1.0, -1.0, -2.0, 1.0, 1.0])
    mask = torch.tensor([True, True, True, False, False])
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    none = torch.zeros(5, dtype=torch.bool)
    loss, metrics = ppo_policy_loss(logp, old, adv, none, 0.2, 0.2)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    zero_adv, _ = ppo_policy_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), None, 0.2, 0.2)
    assert zero_adv.item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([5.0], dtype=torch.float64)
    old = torch.tensor([0.0], dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    plain, _ = ppo_policy_loss(logp, old, adv, None, 0.2, 0.2)
    capped, metrics = ppo_policy_loss(logp, old, adv, None, 0.2, 0.2, dual_clip=3.0)
    assert abs(plain.item() - math.exp(5.0)) < 1e-9
    assert capped.item() == 3.0 and metrics["dual_clip_frac"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip: expected a value > 1"):
        ppo_policy_loss(logp, old, adv, None, 0.2, 0.2, dual_clip=0.5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(
        ValueError, match=r"old_logp: expected the shape of logp \(3,\), got \(4,\)"
    ):
        ppo_policy_loss(torch.zeros(3), torch.zeros(4), torch.zeros(3), None, 0.2, 0.2)
    with pytest.raises(ValueError, match="agg: expected one of token-mean"):
        ppo_policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), None, 0.2, 0.2, agg="mean")
    with pytest.raises(ValueError, match="kl kind"):
        kl_estimate(torch.zeros(3), torch.zeros(3), "k4")
    with pytest.raises(ValueError, match="cap_mode"):
        decoupled_ppo_loss(
            *[torch.zeros(3)] * 4, None, 0.2, 0.2, behav_weight_cap=2.0, cap_mode="drop"
        )


# ----------------------------------------------------------------------------- decoupled PPO


@pytest.mark.parametrize("cap,mode", [(None, "mask"), (1.5, "mask"), (1.5, "clamp")])
def test_decoupled_ppo_matches_reference(cap, mode):
    logp, prox, adv, mask = make_batch((6, 7), seed=5)
    behave = prox + torch.randn(6, 7, dtype=torch.float64) * 0.5
    loss, metrics = decoupled_ppo_loss(
        logp, prox, behave, adv, mask, 0.2, 0.25, behav_weight_cap=cap, cap_mode=mode
    )
    r = np.exp(logp.numpy() - prox.numpy())
    w = np.exp(prox.numpy() - behave.numpy())
    m = mask.numpy().copy()
    capped = (w > cap) & m if cap is not None else np.zeros_like(m)
    if cap is not None and mode == "mask":
        w = np.where(capped, 0.0, w)  # out of the sum, still in the denominator (AReaL)
    if cap is not None and mode == "clamp":
        w = np.minimum(w, cap)
    per = ref_surrogate(r, adv.numpy(), 0.2, 0.25, None) * w
    assert abs(loss.item() - ref_agg(per, m, "token-mean")) < 1e-10
    assert abs(metrics["behave_capped_frac"].item() - capped.sum() / mask.numpy().sum()) < 1e-12


def test_decoupled_equals_standard_ppo_when_on_policy():
    logp, old, adv, mask = make_batch((4, 6), seed=7)
    a, _ = decoupled_ppo_loss(logp, old, old, adv, mask, 0.2, 0.2)
    b, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    assert abs(a.item() - b.item()) < 1e-12


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("huber", [None, 1.0])
def test_value_loss_matches_reference(clip, huber):
    g = torch.Generator().manual_seed(11)
    v = torch.randn(5, 6, generator=g, dtype=torch.float64) * 2
    old = v + torch.randn(5, 6, generator=g, dtype=torch.float64) * 0.5
    ret = torch.randn(5, 6, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(5, 6, generator=g) > 0.2

    def err(d):
        if huber is None:
            return 0.5 * d**2
        return np.where(np.abs(d) <= huber, 0.5 * d**2, huber * (np.abs(d) - 0.5 * huber))

    e = err(v.numpy() - ret.numpy())
    if clip is not None:
        vc = old.numpy() + np.clip(v.numpy() - old.numpy(), -clip, clip)
        e = np.maximum(e, err(vc - ret.numpy()))
    loss, metrics = value_loss(v, old, ret, mask, value_clip=clip, huber_delta=huber)
    assert abs(loss.item() - ref_agg(e, mask.numpy(), "token-mean")) < 1e-10
    assert torch.isfinite(metrics["explained_variance"])


def test_value_clip_needs_old_values():
    with pytest.raises(ValueError, match="value_clip: needs old_values"):
        value_loss(torch.zeros(3), None, torch.zeros(3), None, value_clip=0.2)


# ----------------------------------------------------------------------------- KL, prox, reshaping


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-8, 0), min_size=1, max_size=20), st.integers(0, 2**31 - 1))
def test_kl_estimators(logps, seed):
    logp = torch.tensor(logps, dtype=torch.float64)
    ref = logp + torch.randn(
        len(logps), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    d = (logp - ref).numpy()
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1").numpy(), d, atol=1e-12)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2").numpy(), 0.5 * d**2, atol=1e-12)
    np.testing.assert_allclose(
        kl_estimate(logp, ref, "k3").numpy(), np.exp(-d) - 1 + d, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(kl_estimate(logp, ref, "abs").numpy(), np.abs(d), atol=1e-12)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


def test_k3_is_finite_for_extreme_ratios():
    out = kl_estimate(torch.tensor([-500.0, 0.0]), torch.tensor([0.0, -500.0]), "k3")
    assert torch.isfinite(out).all()


def test_loglinear_prox_logp():
    behave = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -2.0], dtype=torch.float64)
    logp = torch.tensor(
        [-3.0, -3.0, -3.0, -3.0, -3.0, -0.5], dtype=torch.float64, requires_grad=True
    )
    versions = torch.tensor([4, 2, 1, 5, -1, 0])
    prox = loglinear_prox_logp(behave, logp, versions, current_version=5)
    alphas = []
    for vb in versions.tolist():
        v = 5
        alphas.append(
            min(max(((v - 1) - vb) / (v - vb), 0), 1) if (v - vb > 0 and vb >= 0) else 0.0
        )
    ref = behave.numpy() + np.array(alphas) * (logp.detach().numpy() - behave.numpy())
    np.testing.assert_allclose(prox.numpy(), ref, atol=1e-12)
    assert not prox.requires_grad
    assert prox[0].item() == -1.0  # one version behind: prox is the behaviour policy


def test_reshape_logprobs_levels():
    lp = torch.randn(4, 3, 2, 7)  # [..., C, action_dim]
    assert torch.equal(reshape_logprobs(lp, "token"), lp)
    torch.testing.assert_close(reshape_logprobs(lp, "action"), lp.sum(-1))
    torch.testing.assert_close(reshape_logprobs(lp, "chunk"), lp.sum((-1, -2)))
    with pytest.raises(ValueError, match="logprob level"):
        reshape_logprobs(lp, "episode")


# ----------------------------------------------------------------------------- the PPO objective


def objective_settings(**overrides):
    from types import SimpleNamespace

    base = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        use_decoupled_loss=False,
        prox_logp_method="recompute",
        behav_weight_cap=5.0,
        cap_mode="mask",
        kl_coef=0.1,
        kl_kind="k3",
        entropy_bonus=0.01,
        vf_coef=0.5,
    )
    return SimpleNamespace(**{**base, **overrides})


def test_the_loglinear_proximal_policy_is_the_one_the_trainer_holds():
    """``PolicyInputs.version`` is the weights the step starts from: the proximal policy itself
    (what ``recompute`` evaluates). A token sampled one version before is interpolated halfway
    from its behaviour log-prob towards the trained policy's, which on the step's first
    minibatch is exactly the proximal one; a token of the held version needs nothing."""
    from tidal.algorithms.objectives import PolicyInputs, make_objective

    logp, behave, adv, mask = make_batch((4, 9), seed=5)
    versions = torch.full((4, 9), 6)
    versions[:2] = 7  # sampled by the held weights: prox == behave up to engine mismatch
    objective = make_objective(
        objective_settings(use_decoupled_loss=True, prox_logp_method="metrics")
    )
    first_minibatch = PolicyInputs(logp, behave, adv, mask, 7, prox=logp, versions=versions)
    _, info = objective.policy_loss(first_minibatch)
    stale = mask & (versions == 6)
    halfway = ((logp - behave).abs() / 2 * stale).sum() / mask.sum()
    fresh = ((logp - behave).abs() * (mask & (versions == 7))).sum() / mask.sum()
    torch.testing.assert_close(info["prox_approx_abs_err"], halfway + fresh)


@pytest.mark.parametrize("decoupled", [False, True])
def test_ppo_objective_sums_its_terms_as_a_float64_reference(decoupled):
    """policy loss - entropy bonus * entropy + kl_coef * KL + vf_coef * value loss, each term
    computed here from numpy; the decoupled policy loss is the reference surrogate around the
    proximal log-probs times the behaviour weights (none over the cap in this batch)."""
    from tidal.algorithms.objectives import PolicyInputs, ValueInputs, make_objective

    logp, behave, adv, mask = make_batch((4, 9), seed=3)
    g = torch.Generator().manual_seed(4)
    prox = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.1
    ref = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.2
    entropy = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    values, returns = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(2))
    alg = objective_settings(use_decoupled_loss=decoupled)
    objective = make_objective(alg)
    assert objective.needs_prox is decoupled
    loss, info = objective.loss(
        PolicyInputs(logp, behave, adv, mask, version=3, prox=prox, ref=ref, entropy=entropy),
        ValueInputs(values, None, returns, torch.ones(4, dtype=torch.bool)),
    )
    lp, b, a, m, px, rf = (x.numpy() for x in (logp, behave, adv, mask, prox, ref))
    if decoupled:
        weight = np.exp(px - b)
        assert weight[m].max() < alg.behav_weight_cap
        pg = ref_agg(ref_surrogate(np.exp(lp - px), a, 0.2, 0.28, None) * weight, m, "token-mean")
    else:
        pg = ref_agg(ref_surrogate(np.exp(lp - b), a, 0.2, 0.28, None), m, "token-mean")
    kl = ref_agg(np.exp(rf - lp) - (rf - lp) - 1, m, "token-mean")
    ent = ref_agg(entropy.numpy(), m, "token-mean")
    v = 0.5 * ((values - returns).numpy() ** 2).mean()
    expected = pg - 0.01 * ent + 0.1 * kl + 0.5 * v
    assert float(loss) == pytest.approx(expected, rel=1e-10)
    assert float(info["policy_loss"]) == pytest.approx(pg, rel=1e-10)
    assert float(info["kl_ref"]) == pytest.approx(kl, rel=1e-10)


def test_ppo_objective_while_the_critic_warms_up_trains_only_the_value():
    from tidal.algorithms.objectives import PolicyInputs, ValueInputs, make_objective

    logp, behave, adv, mask = make_batch((6,), seed=5)
    logp.requires_grad_(True)
    values = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    loss, _ = make_objective(objective_settings()).loss(
        PolicyInputs(logp, behave, adv, mask, version=0, entropy=torch.ones(6)),
        ValueInputs(values, None, torch.ones(6, dtype=torch.float64), mask),
        critic_only=True,
    )
    loss.backward()
    assert logp.grad is None or not logp.grad.any()
    assert values.grad.abs().sum() > 0


def test_an_unknown_objective_names_the_key():
    from tidal.algorithms.objectives import make_objective

    with pytest.raises(ValueError, match=r"algorithm\.name: unknown objective 'td3'"):
        make_objective(objective_settings(name="td3"))


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "embodied-ratio"]
)
@pytest.mark.parametrize("decoupled", [False, True])
def test_a_minibatch_loss_and_gradient_do_not_depend_on_its_micro_batch_split(agg, decoupled):
    """Micro-batches of unequal valid counts (and behaviour-capped tokens) divided by the
    minibatch's counts sum to the loss of the whole minibatch, and so do their gradients."""
    from tidal.algorithms.objectives import (
        PolicyInputs,
        ValueInputs,
        make_objective,
        minibatch_denominators,
    )

    rows, width = 10, 7
    logp, prox, adv, mask = make_batch((rows, width), seed=11)
    mask[3] = False  # a sequence with no valid token
    mask[5, 2:] = False
    behave = prox + torch.randn(rows, width, dtype=torch.float64) * 0.8  # some weights > cap
    lms = mask.sum(-1, keepdim=True).expand(rows, width).double()
    values = torch.randn(rows, dtype=torch.float64)
    returns = torch.randn(rows, dtype=torch.float64)
    step_mask = mask.any(-1)
    objective = make_objective(
        objective_settings(use_decoupled_loss=decoupled, behav_weight_cap=2.0)
    )

    def loss_and_grad(splits):
        leaf = logp.clone().requires_grad_(True)
        v_leaf = values.clone().requires_grad_(True)
        parts = [torch.arange(a, b) for a, b in zip(splits[:-1], splits[1:])]
        norm = minibatch_denominators([mask[i] for i in parts], [step_mask[i] for i in parts], agg)
        total = 0.0
        for i in parts:
            loss, _ = objective.loss(
                PolicyInputs(
                    leaf[i],
                    behave[i],
                    adv[i],
                    mask[i],
                    0,
                    prox=prox[i],
                    ref=prox[i],
                    entropy=-leaf[i],
                ),
                ValueInputs(v_leaf[i], None, returns[i], step_mask[i]),
                norm=norm,
                agg=agg,
                loss_mask_sum=lms[i],
                max_episode_steps=width,
            )
            total = total + loss
        total.backward()
        return float(total.detach()), leaf.grad, v_leaf.grad

    whole, g_whole, gv_whole = loss_and_grad([0, rows])
    split, g_split, gv_split = loss_and_grad([0, 1, 4, 9, rows])
    assert split == pytest.approx(whole, rel=1e-12)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gv_split, gv_whole, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- GSPO, CISPO, corrections


def test_gspo_takes_the_sequence_ratio_and_each_tokens_gradient():
    """Per sequence s = exp(mean of the valid log-ratios), clipped PPO on s for every token;
    the gradient of token t is A * s * d logp_t / |sequence| where the clip is inactive."""
    logp, old, adv, mask = make_batch((5, 6), seed=21)
    adv = adv[:, :1].expand(5, 6).clone()  # one advantage per sequence, as GRPO gives
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        leaf, old, adv, mask, 0.1, 0.1, agg="seq-mean-token-mean", importance_level="sequence"
    )
    loss.backward()
    lp, o, a, m = logp.numpy(), old.numpy(), adv.numpy(), mask.numpy()
    s = np.exp([(lp[i] - o[i])[m[i]].mean() if m[i].any() else 0.0 for i in range(5)])
    per = np.stack([ref_surrogate(np.full(6, s[i]), a[i], 0.1, 0.1, None) for i in range(5)])
    assert loss.item() == pytest.approx(ref_agg(per, m, "seq-mean-token-mean"), rel=1e-10)
    counts = m.sum(1)
    has = counts > 0
    for i in range(5):
        inside = 0.9 <= s[i] <= 1.1 or (a[i, 0] > 0 and s[i] < 0.9) or (a[i, 0] < 0 and s[i] > 1.1)
        expected = -a[i] * s[i] * m[i] / max(counts[i], 1) / has.sum() if inside else 0 * a[i]
        np.testing.assert_allclose(leaf.grad[i].numpy(), expected * m[i], atol=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(
        float((np.repeat(s, 6).reshape(5, 6) * m).sum() / m.sum()), rel=1e-10
    )


def test_cispo_weights_every_tokens_log_prob_by_its_clipped_ratio():
    logp, old, adv, mask = make_batch((4, 7), seed=22)
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(leaf, old, adv, mask, 0.2, 0.28, surrogate="cispo")
    loss.backward()
    r = np.exp(logp.numpy() - old.numpy())
    w = np.clip(r, 0.8, 1.28)
    m = mask.numpy()
    per = -w * adv.numpy() * np.log(r)
    assert loss.item() == pytest.approx(ref_agg(per, m, "token-mean"), rel=1e-10)
    # no token loses its gradient: d/dlogp = -w A / n on every valid token
    np.testing.assert_allclose(leaf.grad.numpy(), -w * adv.numpy() * m / m.sum(), atol=1e-12)
    assert metrics["clip_frac"].item() == pytest.approx(
        ((r < 0.8) | (r > 1.28))[m].mean(), rel=1e-12
    )


@pytest.mark.parametrize("mode", ["none", "token_tis", "seq_tis", "seq_mis", "icepop"])
def test_rollout_corrections_match_a_float64_reference(mode):
    from tidal.algorithms.correction import mismatch_metrics, rollout_correction

    g = torch.Generator().manual_seed(23)
    rollout = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 2
    trainer = rollout + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(6, 5, generator=g) > 0.2
    weight, dropped = rollout_correction(trainer, rollout, mask, mode, cap=1.5, lower=0.7)
    m = mask.numpy()
    r = np.exp(trainer.numpy() - rollout.numpy())
    seq = np.exp(((trainer - rollout).numpy() * m).sum(1, keepdims=True)) * np.ones((1, 5))
    expected = {
        "none": np.ones_like(r),
        "token_tis": np.minimum(r, 1.5),
        "seq_tis": np.minimum(seq, 1.5),
        "seq_mis": np.where((seq >= 0.7) & (seq <= 1.5), seq, 0.0),
        "icepop": np.where((r >= 0.7) & (r <= 1.5), r, 0.0),
    }[mode] * m
    np.testing.assert_allclose(weight.numpy(), expected, atol=1e-12)
    assert dropped.numpy().tolist() == ((expected == 0) & m).tolist()
    metrics = mismatch_metrics(trainer, rollout, mask)
    assert metrics["mismatch_kl"].item() == pytest.approx((r - 1 - np.log(r))[m].mean(), rel=1e-10)
    assert metrics["mismatch_ratio_max"].item() == pytest.approx(r[m].max(), rel=1e-12)


def test_a_correction_reweights_standard_ppo_and_is_logged():
    from tidal.algorithms.objectives import PolicyInputs, make_objective

    logp, behave, adv, mask = make_batch((4, 6), seed=24)
    prox = behave + 0.2
    alg = objective_settings(
        kl_coef=0.0,
        recompute_logprob=True,
        rollout_correction="token_tis",
        rollout_correction_cap=1.1,
        rollout_correction_lower=0.5,
    )
    objective = make_objective(alg)
    assert objective.needs_prox
    loss, info = objective.loss(PolicyInputs(logp, behave, adv, mask, 0, prox=prox))
    plain, _ = ppo_policy_loss(logp, prox, adv, mask, 0.2, 0.28)
    # every token's weight is min(e^0.2, 1.1) = 1.1
    assert loss.item() == pytest.approx(1.1 * plain.item(), rel=1e-10)
    assert info["mismatch_ratio_mean"].item() == pytest.approx(np.exp(0.2), rel=1e-10)
    assert info["mismatch_masked_frac"].item() == 0.0


def test_the_kl_clamp_bounds_each_estimate():
    logp = torch.tensor([0.0, -30.0])
    ref = torch.tensor([0.0, 0.0])
    assert kl_estimate(logp, ref, "k1", clamp=10.0).tolist() == [0.0, -10.0]
    assert kl_estimate(logp, ref, "k3", clamp=5.0)[1].item() == 5.0
