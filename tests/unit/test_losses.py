"""Exact policy-loss values on tiny hand-made tensors, with the arithmetic beside them."""

import math

import pytest
import torch

from gdpo_ray.losses import PolicyLossConfig, aggregate, kl_penalty, policy_loss

L = math.log


def batch():
    # old logprobs 0, so the ratios are exp(logp): row 0 (A = +1) 1.5, 0.5; row 1 (A = -1) 1.1, 0.7
    logp = torch.tensor([[L(1.5), L(0.5)], [L(1.1), L(0.7)]], dtype=torch.float64, requires_grad=True)
    return logp, torch.zeros(2, 2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)


def test_clipping_on_both_sides_token_mean():
    logp, old, adv = batch()
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 2), PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    # row 0: r = 1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); r = 0.5 -> max(-0.5, -0.8) = -0.5
    # row 1: r = 1.1 -> max(1.1, 1.1) = 1.1; r = 0.7 -> max(0.7, 0.8) = 0.8 (clipped low)
    # token_mean = (-1.28 - 0.5 + 1.1 + 0.8) / 4 = 0.03
    assert loss.item() == pytest.approx(0.03, abs=1e-12)
    assert m["clip_frac/high"] == 0.25 and m["clip_frac/low"] == 0.25
    loss.backward()
    # d/dlogp of -A r = -A r: only the unclipped tokens move: (-0.5) / 4 and (+1.1) / 4
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.275, 0.0], abs=1e-12)


def test_token_and_sequence_aggregations():
    logp, old, adv = batch()
    mask = torch.tensor([[1, 1], [1, 0]])
    # per-token terms as above: row 0 (-1.28, -0.5), row 1 (1.1, masked)
    expect = {"token_mean": (-1.28 - 0.5 + 1.1) / 3,              # -0.22667
              "seq_mean_token_mean": ((-1.28 - 0.5) / 2 + 1.1) / 2,  # 0.105
              "seq_mean_token_sum": ((-1.28 - 0.5) + 1.1) / 2}       # -0.34
    for mode, value in expect.items():
        loss, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(loss_agg=mode))
        assert loss.item() == pytest.approx(value, abs=1e-12), mode


def test_micro_batches_sum_to_the_batch_loss():
    torch.manual_seed(0)
    logp, old = torch.randn(6, 5, dtype=torch.float64) * 0.1, torch.zeros(6, 5, dtype=torch.float64)
    adv, mask = torch.randn(6, dtype=torch.float64), (torch.rand(6, 5) > 0.3)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        cfg = PolicyLossConfig(loss_agg=mode)
        whole, _ = policy_loss(logp, old, adv, mask, cfg)
        parts = sum(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, num_tokens=int(mask.sum()),
                                num_sequences=6)[0] for s in (slice(0, 2), slice(2, 6)))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-12), mode


def test_dual_clip():
    logp = torch.tensor([[L(5.0), L(2.0)]], dtype=torch.float64)
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)
    loss, m = policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([-1.0]), torch.ones(1, 2), cfg)
    # A = -1: r = 5 -> max(5, 1.28) = 5, bounded by -A c = 3; r = 2 -> 2 (< 3); mean = 2.5
    assert loss.item() == pytest.approx(2.5, abs=1e-12) and m["clip_frac/dual"] == 0.5


def test_off_policy_weight_is_truncated():
    # logp = old = 0 (r = 1, pg = -A = -1); rollout logprobs log 0.25 and log 2:
    # w = exp(old - rollout) = 4 -> truncated to the cap 2, and 0.5: loss = (-2 - 0.5) / 2
    rollout = torch.tensor([[L(0.25), L(2.0)]], dtype=torch.float64)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = policy_loss(zero, zero, torch.tensor([1.0]), torch.ones(1, 2),
                          PolicyLossConfig(off_policy={"mode": "truncate", "cap": 2.0}), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.25, abs=1e-12)
    assert m["is/weight_mean"] == pytest.approx(1.25) and m["is/truncated_frac"] == 0.5
    loss_no, _ = policy_loss(zero, zero, torch.tensor([1.0]), torch.ones(1, 2), PolicyLossConfig(off_policy="none"),
                             rollout_logprobs=rollout)
    assert loss_no.item() == -1.0  # no correction asked for


def test_kl_estimators():
    logp, ref = torch.tensor([L(0.5)]), torch.tensor([L(0.25)])
    # d = log 2 = 0.693147: k1 = d; k2 = d^2 / 2 = 0.240227; k3 = exp(-d) + d - 1 = 0.193147
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(L(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(L(2) ** 2 / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + L(2) - 1)
    loss, m = policy_loss(torch.full((1, 1), L(0.5)), torch.full((1, 1), L(0.5)), torch.tensor([0.0]),
                          torch.ones(1, 1), PolicyLossConfig(kl_coef=0.1, kl_estimator="k3"),
                          ref_logprobs=torch.full((1, 1), L(0.25)))
    # A = 0: pg = 0; loss = 0.1 * k3
    assert loss.item() == pytest.approx(0.1 * (0.5 + L(2) - 1)) and m["kl"] == pytest.approx(0.5 + L(2) - 1)


def test_gspo_sequence_ratio():
    logp, old, adv = batch()
    # s_0 = exp(mean(log 1.5, log 0.5)) = sqrt(0.75) = 0.866025; s_1 = sqrt(0.77) = 0.877496
    s0, s1 = math.sqrt(0.75), math.sqrt(0.77)
    wide = PolicyLossConfig(ratio_level="sequence", clip_eps_low=0.2, clip_eps_high=0.28)
    loss, _ = policy_loss(logp, old, adv, torch.ones(2, 2), wide)
    # A = +1: -s0 (inside the clip range); A = -1: s1 -> mean over the 2 rollouts
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    tight = PolicyLossConfig(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 2), tight)
    # row 1 is clipped low: max(s1, 1 - 3e-4) = 0.9997
    assert loss.item() == pytest.approx((-s0 + 0.9997) / 2, abs=1e-12) and m["clip_frac/low"] == 0.5


def test_empty_batch_and_bad_config():
    assert aggregate(torch.zeros(2, 3), torch.zeros(2, 3), "token_mean").item() == 0.0
    with pytest.raises(ValueError, match="loss_agg 'mean' is not one of"):
        PolicyLossConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_estimator 'k4'"):
        PolicyLossConfig(kl_estimator="k4")
