"""Each off-policy option's loss and gradient against the formula computed by hand, token by
token in plain Python (docs/training.md "Off-policy correction"), on one small batch."""

import math

import pytest
import torch

from gdpo_ray.losses import PolicyLossConfig, policy_loss
from gdpo_ray.off_policy import OffPolicy, Tally, correct

L = math.log
EPS_LOW, EPS_HIGH = 0.2, 0.28
# two rollouts of up to 4 tokens; row 1's last token is padding, row 0's third a tool turn's
RATIO = [[1.5, 0.9, 1.0, 1.1], [0.7, 1.2, 1.35, 1.0]]  # r = exp(logp - old), old = 0
RHO = [[3.0, 0.8, 9.0, 1.25], [0.4, 1.1, 6.0, 1.0]]  # exp(old - rollout): rollout = -log(rho)
MASK = [[1, 1, 0, 1], [1, 1, 1, 0]]
ADV = [1.0, -1.0]


def tensors():
    logp = torch.tensor([[L(r) for r in row] for row in RATIO], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-L(p) for p in row] for row in RHO], dtype=torch.float64)
    return logp, torch.zeros(2, 4, dtype=torch.float64), rollout, torch.tensor(MASK), torch.tensor(ADV, dtype=torch.float64)


def hand_weights(c: OffPolicy) -> list[list[float]]:
    """w_it by the documented formula, one token at a time."""
    out = []
    for rho_row, m_row in zip(RHO, MASK):
        logs = [L(p) for p, m in zip(rho_row, m_row) if m]
        seq = {"sequence": math.exp(sum(logs) / len(logs)), "product": math.exp(sum(logs))}.get(c.level)
        dropped = any(m and ((c.outlier_low is not None and p < c.outlier_low)
                             or (c.outlier_high is not None and p > c.outlier_high)) for p, m in zip(rho_row, m_row))
        row = []
        for p, m in zip(rho_row, m_row):
            u = p if seq is None else seq
            if c.mode == "truncate":
                w = min(u, c.cap)
            elif c.mode == "mask":
                w = u if (c.low is None or u >= c.low) and (c.high is None or u <= c.high) else 0.0
            else:
                w = 1.0
            row.append(0.0 if not m or dropped else w)
        out.append(row)
    return out


def hand_loss_and_grad(weights):
    """token_mean of max(-A r, -A clip(r)) * w, and d loss / d logp (r = exp(logp - old))."""
    n = sum(map(sum, MASK))
    loss, grad = 0.0, [[0.0] * 4 for _ in RATIO]
    for i, (row, a) in enumerate(zip(RATIO, ADV)):
        for t, r in enumerate(row):
            if not MASK[i][t]:
                continue
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            loss += max(-a * r, -a * clipped) * weights[i][t] / n
            flat = (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW)  # the clipped branch wins
            grad[i][t] = 0.0 if flat else -a * r * weights[i][t] / n
    return loss, grad


OPTIONS = [
    {"level": "token", "mode": "truncate", "cap": 2.0},
    {"level": "sequence", "mode": "truncate", "cap": 1.5},
    {"level": "product", "mode": "truncate", "cap": 4.0},
    {"level": "token", "mode": "mask", "low": 0.5, "high": 2.0},
    {"level": "sequence", "mode": "mask", "high": 1.4},
    {"level": "product", "mode": "mask", "low": 0.1, "high": 30.0},
    {"level": "token", "mode": "truncate", "cap": 2.0, "outlier_low": 0.5},
    {"level": "sequence", "mode": "none", "outlier_high": 8.0},
    "none",
]


@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_loss_and_gradient_equal_the_formula_by_hand(option):
    c = OffPolicy.parse(option)
    logp, old, rollout, mask, adv = tensors()
    cfg = PolicyLossConfig(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, off_policy=c)
    loss, _ = policy_loss(logp, old, adv, mask, cfg, rollout_logprobs=rollout)
    loss.backward()
    weights = hand_weights(c)
    expected, grad = hand_loss_and_grad(weights)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert logp.grad.flatten().tolist() == pytest.approx([g for row in grad for g in row], abs=1e-12)
    assert correct(old, rollout, mask, c).flatten().tolist() == pytest.approx(sum(weights, []), abs=1e-12)


def test_the_hand_weights_are_what_the_docs_say():
    # spot values of the reference itself, so that a wrong reference cannot agree with wrong code
    w = lambda i: hand_weights(OffPolicy.parse(OPTIONS[i]))
    g0, g1 = (3.0 * 0.8 * 1.25) ** (1 / 3), (0.4 * 1.1 * 6.0) ** (1 / 3)  # 1.442, 1.382
    assert w(0) == [[2.0, 0.8, 0.0, 1.25], [0.4, 1.1, 2.0, 0.0]]
    assert w(1) == [[pytest.approx(g0)] * 2 + [0.0, pytest.approx(g0)], [pytest.approx(g1)] * 3 + [0.0]]
    assert w(2) == [[pytest.approx(3.0)] * 2 + [0.0, pytest.approx(3.0)], [pytest.approx(2.64)] * 3 + [0.0]]
    assert w(3) == [[0.0, 0.8, 0.0, 1.25], [0.0, 1.1, 0.0, 0.0]]
    assert w(4) == [[0.0] * 4, [pytest.approx(g1)] * 3 + [0.0]] and g0 > 1.4
    assert w(6) == [[2.0, 0.8, 0.0, 1.25], [0.0] * 4]  # row 1 holds rho 0.4 < 0.5
    assert w(7) == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]  # the tool turn's 9.0 is not sampled


def test_gspo_takes_the_mean_of_a_rollouts_token_weights():
    # ratio_level sequence: s_i = exp(mean_t log r_it); the term -A_i s_i (inside the clip range
    # of 1e3) times mean_t w_it over the sampled tokens; seq_mean_token_sum over 2 rollouts
    c = OffPolicy.parse({"level": "token", "mode": "truncate", "cap": 2.0})
    logp, old, rollout, mask, adv = tensors()
    cfg = PolicyLossConfig(clip_eps_low=1e3, clip_eps_high=1e3, ratio_level="sequence", off_policy=c)
    loss, _ = policy_loss(logp, old, adv, mask, cfg, rollout_logprobs=rollout)
    w = hand_weights(c)
    s0 = math.exp((L(1.5) + L(0.9) + L(1.1)) / 3)
    s1 = math.exp((L(0.7) + L(1.2) + L(1.35)) / 3)
    expected = (-1.0 * s0 * sum(w[0]) / 3 + 1.0 * s1 * sum(w[1]) / 3) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_metrics_by_hand_and_by_staleness():
    c = OffPolicy.parse({"level": "token", "mode": "mask", "low": 0.5, "high": 2.0, "outlier_high": 5.0})
    logp, old, rollout, mask, _ = tensors()
    staleness = torch.tensor([[1, 1, 1, 2], [0, 0, 1, 1]])
    tally = Tally()
    correct(old, rollout, mask, c, staleness, tally)
    m = tally.metrics()
    # sampled rho: row 0: 3.0 0.8 1.25 (staleness 1 1 2); row 1: 0.4 1.1 6.0 (0 0 1): 6.0 > 5 drops row 1
    assert m["is/ratio_mean"] == pytest.approx((3.0 + 0.8 + 1.25 + 0.4 + 1.1 + 6.0) / 6)
    assert (m["is/ratio_max"], m["is/ratio_min"]) == (pytest.approx(6.0), pytest.approx(0.4))
    assert m["is/weight_mean"] == pytest.approx((0.8 + 1.25) / 6)
    assert m["is/masked_frac"] == pytest.approx(4 / 6)  # 3.0 by the mask; row 1 by the outlier
    assert m["is/beyond_frac"] == pytest.approx(3 / 6)  # 3.0, 0.4, 6.0 outside [0.5, 2]
    assert m["is/staleness_1/ratio_mean"] == pytest.approx((3.0 + 0.8 + 6.0) / 3)
    assert m["is/staleness_1/masked_frac"] == pytest.approx(2 / 3)
    assert m["is/staleness_0/beyond_frac"] == pytest.approx(1 / 2)
    assert m["is/staleness_2/ratio_max"] == pytest.approx(1.25)
    other = Tally()
    other.add_units("is/ratio", torch.tensor([7.0]))
    tally.merge(other)
    assert tally.metrics()["is/ratio_max"] == 7.0 and tally.metrics()["is/ratio_mean"] == pytest.approx(19.55 / 7)


def test_truncated_frac_counts_units():
    logp, old, rollout, mask, _ = tensors()
    for level, expected in (("token", 2 / 6), ("sequence", 0 / 2), ("product", 2 / 2)):
        tally = Tally()
        correct(old, rollout, mask, OffPolicy.parse({"level": level, "cap": 1.45}), tally=tally)
        assert tally.metrics()["is/truncated_frac"] == pytest.approx(expected), level


def test_a_long_sequences_product_stays_finite():
    old = torch.zeros(1, 4000, dtype=torch.float64)
    w = correct(old, old - 0.1, torch.ones(1, 4000), OffPolicy.parse({"level": "product", "mode": "mask", "high": 1e9}))
    assert float(w.max()) == 0.0  # exp(400) is beyond the bound: the rollout leaves the loss, no inf/NaN


@pytest.mark.parametrize("value, message", [
    ({"mode": "clip"}, "mode must be one of truncate, mask, none"),
    ({"levle": "token"}, "did you mean 'level'"),
    ({"mode": "mask"}, "mode mask needs low and/or high"),
    ({"mode": "mask", "low": 0.5, "cap": 2}, "cap is mode truncate's bound"),
    ({"mode": "truncate", "high": 3}, "low/high are mode mask's bounds"),
    ({"mode": "mask", "low": 2, "high": 1}, "must have low < high"),
    ({"cap": -1}, "cap must be a number >= 0"),
    ({"cap": float("nan")}, "cap must be a number >= 0"),
    ("token", "must be a mapping"),
])
def test_bad_settings_name_the_key_and_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        OffPolicy.parse(value)


def test_settings_in_a_config():
    from gdpo_ray.run.algorithm import GDPOConfig

    assert OffPolicy.parse("none").active is False and OffPolicy.parse(None) == OffPolicy.parse("none")
    assert OffPolicy.parse({"mode": "none", "outlier_low": 0.1}).active
    config = GDPOConfig().training(off_policy={"level": "sequence", "mode": "mask", "low": 0.5, "high": 2})
    assert PolicyLossConfig.of(config).off_policy == OffPolicy("sequence", "mask", None, 0.5, 2)
    with pytest.raises(TypeError, match=r"is_cap.*training.off_policy.*cap: X"):
        GDPOConfig().training(is_cap=3.0)


def test_a_bad_logprob_outside_the_mask_is_never_read_and_a_nan_one_leaves_the_loss():
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[0.1, -float("inf"), float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]])
    for option in ({"cap": 2.0}, {"level": "sequence"}, {"mode": "mask", "low": 0.5, "high": 2}, "none"):
        c = OffPolicy.parse(option)
        tally = Tally()
        w = correct(old, rollout, mask, c, tally=tally)
        assert not w.isnan().any(), option
        if c.active:
            assert w[0, 2] == 0 and w[0, 1] == 0 and tally.metrics()["is/masked_frac"] >= 0.5, option
        loss, _ = policy_loss(old.clone().requires_grad_(), old, torch.tensor([1.0], dtype=torch.float64), mask,
                              PolicyLossConfig(off_policy=c), rollout_logprobs=rollout)
        assert loss.isfinite(), option


@pytest.mark.parametrize("value, message", [
    ({"mode": "mask", "high": 0.5}, "must keep the ratio 1"),
    ({"mode": "mask", "low": 1.5}, "must keep the ratio 1"),
    ({"outlier_low": 2.0}, "must keep the ratio 1"),
    ({"cap": 0.5}, "needs cap >= 1"),
])
def test_bounds_that_would_drop_on_policy_tokens_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        OffPolicy.parse(value)
    with pytest.raises(ValueError, match=message):  # an instance built by hand is checked too
        OffPolicy.parse(OffPolicy(**{"cap": None} | value) if value.get("mode") == "mask" else OffPolicy(**value))
