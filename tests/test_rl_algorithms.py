"""Tests for nla.rl.algorithms: hand-derived values and loop references."""

from __future__ import annotations

import math

import pytest
import torch

from nla.rl import algorithms as A

# --------------------------------------------------------------- advantages


def test_grpo_advantages_2x3_by_hand():
    # Group 0: r = [1, 2, 3]; mean 2, unbiased var ((1+0+1)/2) = 1, std 1
    #   -> A = [-1, 0, 1] / (1 + eps)
    # Group 1: r = [0, 0, 3]; mean 1, deviations [-1, -1, 2],
    #   unbiased var (1+1+4)/2 = 3, std sqrt(3) -> A = [-1, -1, 2] / sqrt(3)
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    adv = A.grpo_advantages(r, 3, eps=0.0)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3])
    torch.testing.assert_close(adv, expected)
    # eps enters the denominator: group 0 divides by 1 + 0.5
    adv_eps = A.grpo_advantages(r, 3, eps=0.5)
    torch.testing.assert_close(adv_eps[:3], torch.tensor([-1.0, 0.0, 1.0]) / 1.5)


def test_drgrpo_and_reinforce_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    # Dr.GRPO: deviations from group means 2 and 1
    torch.testing.assert_close(A.drgrpo_advantages(r, 3), torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0]))
    # REINFORCE baseline: batch mean = 9/6 = 1.5
    torch.testing.assert_close(
        A.reinforce_baseline_advantages(r), torch.tensor([-0.5, 0.5, 1.5, -1.5, -1.5, 1.5])
    )


def test_grpo_equal_group_gives_zero_and_group_of_one_is_raw_reward():
    r = torch.tensor([0.7, 0.7, 0.7, -1.0, 1.0, 0.0])
    adv = A.grpo_advantages(r, 3)
    torch.testing.assert_close(adv[:3], torch.zeros(3))
    # G = 1: no group baseline (departure 1) -> advantage == reward
    torch.testing.assert_close(A.grpo_advantages(r, 1), r)


def test_grpo_rejects_ragged_groups_and_2d():
    with pytest.raises(ValueError, match=r"N=5 is not a multiple of group_size=3"):
        A.grpo_advantages(torch.zeros(5), 3)
    with pytest.raises(ValueError, match=r"rewards must be 1-D"):
        A.grpo_advantages(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        A.grpo_advantages(torch.zeros(4), 0)


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(
        A.broadcast_to_tokens(adv, mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    )
    with pytest.raises(ValueError, match="N=2 rows"):
        A.broadcast_to_tokens(adv, torch.ones(3, 2))


def test_sequence_to_token_rewards_last_token_and_empty_row():
    r = torch.tensor([5.0, 7.0, 9.0])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    expected = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    torch.testing.assert_close(A.sequence_to_token_rewards(r, mask), expected)


# -------------------------------------------------------------------- GAE


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain per-row loop: compress each row to its response tokens, run the
    textbook backward recursion with V = 0 after the last token, scatter back."""
    n, L = values.shape
    adv = torch.zeros(n, L, dtype=torch.float64)
    for i in range(n):
        idx = [t for t in range(L) if mask[i, t] > 0]
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            v_next = float(values[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rewards[i, t]) + gamma * v_next - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    returns = (adv + values.double()) * mask.double()
    return adv, returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7), (0.0, 1.0)])
def test_gae_matches_plain_loop_on_ragged_masks(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    n, L = 7, 9
    rewards = torch.randn(n, L, generator=g, dtype=torch.float64)
    values = torch.randn(n, L, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 0, 5, 3, 8, 2])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).double()
    # a hole inside row 5 and left padding in row 6 (mask need not be a prefix)
    mask[5, 3] = 0.0
    mask[6] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float64)
    adv, ret = A.gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.all(adv[mask == 0] == 0)


def test_gae_by_hand_two_tokens():
    # r = [0, 1], V = [0.5, 0.2], gamma = 0.9, lam = 0.5
    # t=1: delta = 1 + 0.9*0 - 0.2 = 0.8; A1 = 0.8
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32; A0 = -0.32 + 0.9*0.5*0.8 = 0.04
    # returns = A + V = [0.54, 1.0]
    adv, ret = A.gae_advantages(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), 0.9, 0.5
    )
    torch.testing.assert_close(adv, torch.tensor([[0.04, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.54, 1.0]]))


def test_gae_rejects_bad_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="values has shape"):
        A.gae_advantages(x, torch.zeros(2, 4), x, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma=1.5"):
        A.gae_advantages(x, x, x, 1.5, 1.0)


def test_masked_whiten_by_hand():
    # masked values [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; padding -> 0
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = A.masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    # shift_mean=False keeps the mean 2: [1, 2, 3]
    out2 = A.masked_whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(out2, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="at least 2 masked positions, found 1"):
        A.masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


# ------------------------------------------------------------ aggregation


def test_aggregation_modes_on_2x3_mask():
    # loss = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 0], [1, 0, 0]]
    # token-mean: (1 + 2 + 4) / 3 = 7/3
    # seq-mean-token-mean: mean(1.5, 4) = 2.75
    # seq-mean-token-sum: mean(3, 4) = 3.5
    # seq-mean-token-sum-norm: 3.5 / norm_len(3) = 7/6
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert A.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert A.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert A.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=3).item() == pytest.approx(7 / 6)


def test_aggregation_skips_empty_rows_and_guards_empty_mask():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    # row 1 empty: seq means use row 0 only -> 1.5 and 3.0
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert A.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert A.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)
    for mode in A.LOSS_AGG_MODES:
        out = A.aggregate_loss(loss, torch.zeros(2, 3), mode, norm_len=3)
        assert out.item() == 0.0
        (g,) = torch.autograd.grad(out, loss)
        assert torch.all(g == 0)


def test_aggregation_unknown_mode_lists_valid_names():
    with pytest.raises(KeyError, match=r"unknown loss aggregation mode 'mean'.*token-mean"):
        A.aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")


# ------------------------------------------------------------ policy loss


def _logp_pair(ratio: float):
    old = torch.tensor([[math.log(0.5)]])
    new = (old + math.log(ratio)).clone().requires_grad_(True)
    return new, old


def test_clip_higher_asymmetry_by_hand():
    # ratio 1.25, A = +1.
    # eps_high = 0.2:  clip(1.25) = 1.2 -> loss = max(-1.25, -1.2) = -1.2, clipped, zero gradient.
    # eps_high = 0.28: 1.25 < 1.28 -> loss = -1.25, unclipped, d loss / d logp = -A * ratio = -1.25.
    adv = torch.ones(1, 1)
    mask = torch.ones(1, 1)
    new, old = _logp_pair(1.25)
    loss, m = A.policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert m["clipfrac"] == 1.0
    (g,) = torch.autograd.grad(loss, new)
    assert g.item() == 0.0

    new, old = _logp_pair(1.25)
    loss, m = A.policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25)
    assert m["clipfrac"] == 0.0
    (g,) = torch.autograd.grad(loss, new)
    assert g.item() == pytest.approx(-1.25)


def test_eps_low_clips_negative_advantage():
    # ratio 0.7, A = -1, eps_low = 0.2: clip -> 0.8; loss = max(0.7, 0.8) = 0.8 (clipped)
    # eps_low = 0.4: clip -> 0.7 (inside [0.6, ...]) -> loss = 0.7
    new, old = _logp_pair(0.7)
    loss, m = A.policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1), eps_low=0.2)
    assert loss.item() == pytest.approx(0.8)
    assert m["clipfrac"] == 1.0
    loss, _ = A.policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1), eps_low=0.4)
    assert loss.item() == pytest.approx(0.7)


def test_dual_clip_by_hand():
    # ratio 5, A = -2, eps = 0.2, c = 3:
    #   pg1 = -A*r = 10; pg2 = -A*clip(5) = 2*1.2 = 2.4; max = 10
    #   dual bound -A*c = 6 -> loss = min(10, 6) = 6 (without dual clip: 10)
    # A positive token (A = +1, ratio 5) is untouched by the dual clip: max(-5, -1.2) = -1.2
    old = torch.log(torch.tensor([[0.1, 0.1]]))
    new = old + math.log(5.0)
    adv = torch.tensor([[-2.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, m = A.policy_loss(new, old, adv, mask, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(6.0, rel=1e-5)
    assert m["clipfrac_dual"] == 1.0
    loss_nodual, _ = A.policy_loss(new, old, adv, mask)
    assert loss_nodual.item() == pytest.approx(10.0, rel=1e-5)
    loss_pos, m_pos = A.policy_loss(new, old, adv, torch.tensor([[0.0, 1.0]]), dual_clip_c=3.0)
    assert loss_pos.item() == pytest.approx(-1.2, rel=1e-5)
    assert m_pos["clipfrac_dual"] == 0.0
    # A negative token on-policy (ratio 1, A = -1): loss -A*r = 1 < c|A|, dual bound inactive
    same = torch.log(torch.tensor([[0.3]]))
    loss_on, m_on = A.policy_loss(same, same, -torch.ones(1, 1), torch.ones(1, 1), dual_clip_c=3.0)
    assert loss_on.item() == pytest.approx(1.0)
    assert m_on["clipfrac_dual"] == 0.0


def test_policy_loss_metrics_and_aggregation():
    # two tokens in one row, ratio 1 (on-policy): loss = -mean(A) = -(1 + 3)/2 = -2
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = A.policy_loss(logp, logp, adv, mask)
    assert loss.item() == pytest.approx(-2.0)
    assert m["approx_kl"] == pytest.approx(0.0)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["clipfrac"] == 0.0
    # seq-mean-token-sum: -(1 + 3) = -4
    loss_sum, _ = A.policy_loss(logp, logp, adv, mask, agg="seq-mean-token-sum")
    assert loss_sum.item() == pytest.approx(-4.0)
    # approx_kl (k3 of old||new) for ratio 2: (2 - 1) - log 2
    new = torch.log(torch.tensor([[0.5]])) + math.log(2.0)
    _, m2 = A.policy_loss(new, torch.log(torch.tensor([[0.5]])), torch.ones(1, 1), torch.ones(1, 1))
    assert m2["approx_kl"] == pytest.approx(1.0 - math.log(2.0), rel=1e-5)
    assert all(isinstance(v, float) for v in m2.values())


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        A.policy_loss(x, x, x, x, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low=1.0"):
        A.policy_loss(x, x, x, x, eps_low=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        A.policy_loss(x, x, torch.zeros(2, 2), x)


def test_value_loss_by_hand():
    # values 1.0, old 0.0, returns 2.0, clip 0.5:
    #   err1 = (1-2)^2 = 1; clipped v = 0.5 -> err2 = (0.5-2)^2 = 2.25
    #   loss = 0.5 * max = 1.125 (vf_clipfrac 1); unclipped: 0.5 * 1 = 0.5
    v = torch.tensor([[1.0]], requires_grad=True)
    old = torch.tensor([[0.0]])
    ret = torch.tensor([[2.0]])
    mask = torch.ones(1, 1)
    loss, m = A.value_loss(v, old, ret, mask, clip_eps=0.5)
    assert loss.item() == pytest.approx(1.125)
    assert m["vf_clipfrac"] == 1.0
    loss2, m2 = A.value_loss(v, old, ret, mask)
    assert loss2.item() == pytest.approx(0.5)
    assert m2["vf_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        A.value_loss(v, old, ret, mask, clip_eps=0.0)


# --------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # logp = log 0.5, ref_logp = log 0.25 -> d = logp - ref = log 2
    # k1 = log 2; k2 = 0.5 (log 2)^2; k3 = exp(-log 2) + log 2 - 1 = 0.5 + log 2 - 1
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    l2 = math.log(2.0)
    torch.testing.assert_close(A.kl_penalty(logp, ref, "k1"), torch.tensor([[l2, 0.0]]))
    torch.testing.assert_close(A.kl_penalty(logp, ref, "k2"), torch.tensor([[0.5 * l2 * l2, 0.0]]))
    torch.testing.assert_close(A.kl_penalty(logp, ref, "k3"), torch.tensor([[l2 - 0.5, 0.0]]))
    # default is k3
    torch.testing.assert_close(A.kl_penalty(logp, ref), A.kl_penalty(logp, ref, "k3"))


def test_k3_is_unbiased_estimate_of_kl():
    # pi = [0.7, 0.2, 0.1], ref = uniform; exact KL(pi || ref) = sum pi log(pi / (1/3))
    pi = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    ref = torch.full((3,), 1 / 3, dtype=torch.float64)
    exact = float((pi * (pi / ref).log()).sum())
    # expectation under pi of each estimator, computed exactly by enumeration
    for kind in ("k1", "k3"):
        est = A.kl_penalty(pi.log()[None], ref.log()[None], kind)[0]
        assert float((pi * est).sum()) == pytest.approx(exact, rel=1e-12)


def test_kl_unknown_kind_lists_valid_names():
    with pytest.raises(KeyError, match=r"unknown KL estimator 'k4'.*'k1', 'k2', 'k3'"):
        A.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ------------------------------------------------------------ diagnostics


def test_entropy_from_logits():
    # uniform over 4 -> log 4; one-hot-ish (huge logit) -> ~0; [0, log 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    h = A.entropy_from_logits(logits)
    expected_last = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(h, torch.tensor([[math.log(4.0), 0.0, expected_last]]), atol=1e-5, rtol=1e-5)


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert A.explained_variance(ret, ret, mask) == pytest.approx(1.0)
    # constant prediction 2 (the mean): residual var == var(returns) -> 0
    assert A.explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0)
    assert math.isnan(A.explained_variance(ret, torch.ones_like(ret), mask))


# ------------------------------------------------------------------- DAPO


def test_dynamic_sampling_mask():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.0, -2.0, -2.0, -1.99])
    torch.testing.assert_close(A.dynamic_sampling_mask(r, 3), torch.tensor([False, True, True]))
    # spread 0.01 of group 2 is within tol 0.05 -> dropped too
    torch.testing.assert_close(A.dynamic_sampling_mask(r, 3, tol=0.05), torch.tensor([False, True, False]))
    with pytest.raises(ValueError, match="N=9 is not a multiple of group_size=2"):
        A.dynamic_sampling_mask(r, 2)


def test_overlong_penalty_boundaries():
    # max_len 100, buffer 20 -> expected 80
    # 79, 80 -> 0; 81 -> (80-81)/20 = -0.05; 90 -> -0.5; 100 -> -1; 101, 500 -> -1
    lengths = torch.tensor([0, 79, 80, 81, 90, 100, 101, 500])
    out = A.overlong_penalty(lengths, max_len=100, buffer_len=20)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]))
    out2 = A.overlong_penalty(lengths, max_len=100, buffer_len=20, factor=2.0)
    torch.testing.assert_close(out2, 2.0 * out)
    with pytest.raises(ValueError, match="buffer_len=0"):
        A.overlong_penalty(lengths, 100, 0)
    with pytest.raises(ValueError, match="buffer_len=101, max_len=100"):
        A.overlong_penalty(lengths, 100, 101)


# --------------------------------------------------------------- registry


def test_advantage_registry_uniform_call():
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0], [1, 0]]).float()
    adv, ret = A.get_advantage_estimator("drgrpo")(r, mask, group_size=3)
    assert ret is None
    torch.testing.assert_close(adv, A.broadcast_to_tokens(A.drgrpo_advantages(r, 3), mask))
    adv, ret = A.get_advantage_estimator("grpo")(r, mask, group_size=3)
    torch.testing.assert_close(adv, A.broadcast_to_tokens(A.grpo_advantages(r, 3), mask))
    # gae with gamma = lam = 1 and V = 0: every response token's advantage is the outcome reward
    gae = A.get_advantage_estimator("gae")
    assert gae.needs_values
    adv, ret = gae(r, mask, group_size=3, values=torch.zeros(6, 2))
    torch.testing.assert_close(adv, r[:, None] * mask)
    torch.testing.assert_close(ret, r[:, None] * mask)
    with pytest.raises(ValueError, match="'gae' needs values"):
        gae(r, mask, group_size=3)
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'ppo'.*'drgrpo', 'gae', 'grpo'"):
        A.get_advantage_estimator("ppo")


def test_entropy_matches_torch_categorical_on_random_logits():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(A.entropy_from_logits(logits), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dual_clip_c", [None, 2.0])
def test_policy_loss_matches_scalar_reference_on_random_data(dual_clip_c):
    # plain per-token Python reference of the clipped (and dual-clipped) surrogate, token-mean
    g = torch.Generator().manual_seed(3)
    n, L = 4, 6
    logp = torch.randn(n, L, generator=g, dtype=torch.float64) * 0.5 - 2
    old = logp + torch.randn(n, L, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(n, L, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, L, generator=g) > 0.3).double()
    eps_low, eps_high = 0.2, 0.28
    total, count, clipped = 0.0, 0, 0
    for i in range(n):
        for t in range(L):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(logp[i, t] - old[i, t]))
            a = float(adv[i, t])
            u = -a * r
            c = -a * min(max(r, 1 - eps_low), 1 + eps_high)
            loss = max(u, c)
            if dual_clip_c is not None and a < 0:
                loss = min(loss, -a * dual_clip_c)
            total += loss
            count += 1
            clipped += c > u
    loss, m = A.policy_loss(
        logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    assert loss.item() == pytest.approx(total / count, rel=1e-12)
    assert m["clipfrac"] == pytest.approx(clipped / count)


# ------------------------------------------------- fp32 groups, padding garbage, Dr.GRPO cap


def test_grpo_all_equal_fp32_groups_give_exactly_zero():
    # The example: fp32 mean of eight -1.7 is off by an ulp and the std is ~1e-7,
    # so (r - mean) / (std + 1e-6) was -0.1057 for every row; equal rewards carry no signal.
    assert torch.equal(A.grpo_advantages(torch.full((8,), -1.7), 8), torch.zeros(8))
    # 500 random fp32 values, each repeated over a group of 8 (about 40% used to fail).
    vals = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 3
    r = vals.repeat_interleave(8)
    for adv in (A.grpo_advantages(r, 8), A.drgrpo_advantages(r, 8), A.grpo_advantages(r.half(), 8)):
        assert torch.count_nonzero(adv) == 0
    # A mixed batch: only the flat groups are zeroed, the others keep their (float64-exact) values.
    mixed = torch.tensor([0.3, 0.3, 0.3, 0.3, 1.0, 2.0, 3.0, 2.0])
    # group 1: mean 2, unbiased var (1 + 0 + 1 + 0) / 3 = 2/3 -> A = [-1, 0, 1, 0] / sqrt(2/3)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(A.grpo_advantages(mixed, 4, eps=0.0),
                               torch.tensor([0.0, 0.0, 0.0, 0.0, -1 / s, 0.0, 1 / s, 0.0]))


def _garbage_like(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with NaN, +inf, -inf and huge values written into the positions outside ``mask``."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30])[torch.randint(0, 4, x.shape, generator=g)]
    return torch.where(mask.bool(), x, junk)


@pytest.mark.parametrize("mode", sorted(A.LOSS_AGG_MODES))
def test_garbage_in_padding_changes_neither_loss_nor_gradient(mode):
    g = torch.Generator().manual_seed(1)
    N, L = 6, 5
    lengths = torch.tensor([5, 3, 1, 4, 0, 2])  # one empty row
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    logp = torch.randn(N, L, generator=g) - 1
    old = logp + 0.3 * torch.randn(N, L, generator=g)
    ref = logp + 0.3 * torch.randn(N, L, generator=g)
    adv = torch.randn(N, L, generator=g)
    values, returns = torch.randn(N, L, generator=g), torch.randn(N, L, generator=g)

    def losses(lp, o, r, a, v, ret):
        lp = lp.clone().requires_grad_(True)
        v = v.clone().requires_grad_(True)
        pg, _ = A.policy_loss(lp, o, a, mask, eps_high=0.28, dual_clip_c=3.0, agg=mode, norm_len=8)
        kl = A.aggregate_loss(A.kl_penalty(lp, r, "k3", mask=mask), mask, mode, norm_len=8)
        vl, _ = A.value_loss(v, o, ret, mask, clip_eps=0.2, agg=mode, norm_len=8)
        total = pg + 0.1 * kl + vl
        total.backward()
        return total.detach(), lp.grad, v.grad

    clean = losses(logp, old, ref, adv, values, returns)
    dirty = losses(*(_garbage_like(t, mask, i) for i, t in enumerate((logp, old, ref, adv, values, returns))))
    assert torch.isfinite(clean[0])
    for c, d in zip(clean, dirty, strict=True):
        assert torch.equal(c, d)
    # masked_mean, masked_whiten and GAE read nothing outside the mask either
    x = torch.randn(N, L, generator=g)
    assert torch.equal(A.masked_mean(_garbage_like(x, mask, 7), mask), A.masked_mean(x, mask))
    assert torch.equal(A.masked_whiten(_garbage_like(x, mask, 8), mask), A.masked_whiten(x, mask))
    tr = A.sequence_to_token_rewards(torch.randn(N, generator=g), mask)
    for a, b in zip(A.gae_advantages(tr, _garbage_like(values, mask, 9), mask, 1.0, 0.95),
                    A.gae_advantages(tr, values, mask, 1.0, 0.95), strict=True):
        assert torch.equal(a, b)


def test_drgrpo_aggregation_divides_by_the_cap_not_the_padded_length():
    # loss = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 0], [1, 0, 0]]: row sums 3 and 4,
    # mean 3.5; with the cap norm_len = 10 -> 0.35, whatever the padded length of the step.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.35)
    wider = torch.nn.functional.pad(loss, (0, 4), value=9.0)  # the same rows padded to L = 7
    wider_mask = torch.nn.functional.pad(mask, (0, 4))
    assert A.aggregate_loss(wider, wider_mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.35)
    with pytest.raises(ValueError, match=r"needs norm_len > 0 \(the generation cap, max_response_len\), found None"):
        A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", sorted(A.LOSS_AGG_MODES))
def test_micro_batch_split_keeps_loss_and_gradient(mode):
    # The loss of a batch equals the sum over its micro-batches of each micro-batch's loss
    # times the mode's micro_batch_weight; so do the gradients. Ragged lengths and an empty
    # row make token and row weights differ.
    g = torch.Generator().manual_seed(2)
    N, L = 7, 6
    lengths = torch.tensor([6, 2, 0, 5, 1, 3, 4])
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    logp0 = torch.randn(N, L, generator=g) - 1
    old, ref = logp0 + 0.2 * torch.randn(N, L, generator=g), logp0 + 0.2 * torch.randn(N, L, generator=g)
    adv = A.broadcast_to_tokens(torch.randn(N, generator=g), mask)
    agg = A.get_loss_agg(mode)

    def loss_of(lp, rows):
        m = mask[rows]
        pg, _ = A.policy_loss(lp[rows], old[rows], adv[rows], m, eps_high=0.28, agg=mode, norm_len=L + 2)
        return pg + 0.05 * A.aggregate_loss(A.kl_penalty(lp[rows], ref[rows], "k2", mask=m), m, mode, norm_len=L + 2)

    whole_lp = logp0.clone().requires_grad_(True)
    whole = loss_of(whole_lp, torch.arange(N))
    whole.backward()
    split_lp = logp0.clone().requires_grad_(True)
    split = torch.zeros(())
    for rows in torch.arange(N).split(3):  # 3 + 3 + 1 rows
        part = loss_of(split_lp, rows) * agg.micro_batch_weight(mask[rows], mask)
        part.backward()
        split = split + part.detach()
    torch.testing.assert_close(split, whole.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-7)
    # the weights are unit shares: tokens 6+2+0 of 21, or non-empty rows 2 of 6
    expected = 8 / 21 if agg.unit == "tokens" else 2 / 6
    assert agg.micro_batch_weight(mask[:3], mask) == pytest.approx(expected)
