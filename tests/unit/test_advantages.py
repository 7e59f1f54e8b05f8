"""Exact numbers for the advantage math of DESIGN.md §1, with the arithmetic beside them."""

import math
import zlib
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch

from gdpo_ray.advantages import (
    ESTIMATORS,
    compute_advantage_details,
    compute_advantages,
    informative_groups,
)
from gdpo_ray.normalization import RESIDUE_ULPS

getcontext().prec = 50  # the plain-loop reference's decimal arithmetic


def D(value):
    return Decimal(float(value))  # exact: every float is a finite decimal

SQRT2, SQRT3 = math.sqrt(2), math.sqrt(3)
H = 1 / SQRT2  # 0.70710678...: (0, 1) normalized with the unbiased std


def adv(rewards, groups, estimator, **kw):
    return compute_advantages(np.asarray(rewards, float), np.asarray(groups), estimator=estimator, **kw)


def summed(rewards, groups, estimator, **kw):
    """Before batch normalization (the paper's Fig. 2 and 3 show these)."""
    return compute_advantage_details(
        np.asarray(rewards, float), np.asarray(groups), estimator=estimator, **kw
    ).summed


# ----------------------------------------------------------------------------------------------
# The paper's worked examples (§3.1, Fig. 2): two rollouts, two binary rewards, eps = 0.


def test_paper_totals_0_1():
    # r1 = (0, 0), r2 = (0, 1): totals (0, 1); mean 0.5, std = sqrt(2 * 0.25 / 1) = 0.7071
    r = [[0, 0], [0, 1]]
    np.testing.assert_allclose(adv(r, [0, 0], "grpo", eps=0), [-H, H], rtol=1e-15)
    # GDPO: r1 has zero spread (contributes 0); r2 = (0, 1) -> (-0.7071, 0.7071)
    np.testing.assert_allclose(summed(r, [0, 0], "gdpo", eps=0), [-H, H], rtol=1e-15)
    # GRPO w/o std: (0, 1) - 0.5
    np.testing.assert_allclose(adv(r, [0, 0], "grpo_no_std", eps=0), [-0.5, 0.5], rtol=0)


def test_paper_totals_0_2():
    # r1 = (0, 1), r2 = (0, 1): totals (0, 2); GRPO sees the same (-0.7071, 0.7071) as for (0, 1)
    r = [[0, 0], [1, 1]]
    np.testing.assert_allclose(adv(r, [0, 0], "grpo", eps=0), [-H, H], rtol=1e-15)
    # GDPO keeps the difference: each reward gives (-0.7071, 0.7071), summed (-1.4142, 1.4142)
    np.testing.assert_allclose(summed(r, [0, 0], "gdpo", eps=0), [-SQRT2, SQRT2], rtol=1e-15)
    # GRPO w/o std: (0, 2) - 1
    np.testing.assert_allclose(adv(r, [0, 0], "grpo_no_std", eps=0), [-1, 1], rtol=0)
    # batch normalization of one group: S = (-1.4142, 1.4142), mean 0, std = sqrt(2 * 2 / 1) = 2
    np.testing.assert_allclose(adv(r, [0, 0], "gdpo", eps=0), [-H, H], rtol=1e-15)


def test_erratum_three_rollouts_total_1_1_1_is_zero():
    # r1 = (1, 1, 0), r2 = (0, 0, 1): r2 = 1 - r1 so A2 = -A1 and S = 0 (DESIGN.md §1 erratum)
    r = [[1, 0], [1, 0], [0, 1]]
    assert summed(r, [0, 0, 0], "gdpo", eps=0).tolist() == [0.0, 0.0, 0.0]
    assert adv(r, [0, 0, 0], "grpo", eps=0).tolist() == [0.0, 0.0, 0.0]


def test_weighted_grpo_and_gdpo():
    r = [[1, 0], [0, 1], [1, 1]]
    w = [2.0, 1.0]
    # GRPO: t = 2 r1 + r2 = (2, 1, 3); mean 2; std = sqrt((0 + 1 + 1) / 2) = 1 -> (0, -1, 1)
    np.testing.assert_allclose(adv(r, [0] * 3, "grpo", weights=w, eps=0), [0, -1, 1], atol=1e-15)
    # GDPO: r1 = (1, 0, 1): mean 2/3, std = sqrt((1/9 + 4/9 + 1/9) / 2) = 1/sqrt(3)
    #   A1 = (1/3, -2/3, 1/3) * sqrt(3) = (0.5774, -1.1547, 0.5774)
    #   r2 = (0, 1, 1): A2 = (-1.1547, 0.5774, 0.5774)
    #   S = 2 A1 + A2 = (0, -sqrt(3), sqrt(3)); weights act on the normalized advantages
    np.testing.assert_allclose(
        summed(r, [0] * 3, "gdpo", weights=w, eps=0), [0, -SQRT3, SQRT3], atol=1e-15
    )
    # batch: mean 0, std = sqrt((0 + 3 + 3) / 2) = sqrt(3) -> (0, -1, 1)
    np.testing.assert_allclose(adv(r, [0] * 3, "gdpo", weights=w, eps=0), [0, -1, 1], atol=1e-15)


def test_batch_of_two_groups():
    # group 0: totals (0, 2) -> S = (-1.4142, 1.4142); group 1: totals (0, 1) -> S = (-0.7071, 0.7071)
    r = [[0, 0], [1, 1], [0, 0], [0, 1]]
    g = [0, 0, 1, 1]
    np.testing.assert_allclose(summed(r, g, "gdpo", eps=0), [-SQRT2, SQRT2, -H, H], rtol=1e-15)
    # batch mean 0; var = (2 + 2 + 0.5 + 0.5) / 3 = 5/3; std = 1.2910 -> S / 1.2910
    s = math.sqrt(5 / 3)
    expected = [-SQRT2 / s, SQRT2 / s, -H / s, H / s]  # (-1.0954, 1.0954, -0.5477, 0.5477)
    np.testing.assert_allclose(adv(r, g, "gdpo", eps=0), expected, rtol=1e-15)
    # gdpo_no_std: centred r1 = (-0.5, 0.5), r2 = (-0.5, 0.5) in group 0; (0, 0), (-0.5, 0.5)
    # in group 1: S = (-1, 1, -0.5, 0.5); var = (1 + 1 + 0.25 + 0.25) / 3 = 5/6
    s = math.sqrt(5 / 6)
    np.testing.assert_allclose(
        adv(r, g, "gdpo_no_std", eps=0), [-1 / s, 1 / s, -0.5 / s, 0.5 / s], rtol=1e-15
    )


def test_eps_is_added_to_every_std():
    # group std 0.70710678 + 0.5 and batch std of S = (-0.4142.., +0.4142..) ...
    eps = 0.5
    r = [[0.0], [1.0]]
    a = summed(r, [0, 0], "gdpo", eps=eps)
    np.testing.assert_allclose(a, [-0.5 / (H + eps), 0.5 / (H + eps)], rtol=1e-15)
    # batch: mean 0, std of (-x, x) with ddof 1 = x * sqrt(2)
    x = 0.5 / (H + eps)
    np.testing.assert_allclose(
        adv(r, [0, 0], "gdpo", eps=eps), [-x / (x * SQRT2 + eps), x / (x * SQRT2 + eps)], rtol=1e-15
    )
    np.testing.assert_allclose(adv(r, [0, 0], "grpo", eps=eps), [-x, x], rtol=1e-15)


# ----------------------------------------------------------------------------------------------
# Every row of DESIGN.md §1's convention table.


@pytest.mark.parametrize("g", [3, 5, 7])
@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, -2.9, 1e-8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_spread_contributes_exactly_zero(g, value, dtype):
    # Reward 0 is constant in the group (mean computed in floats is not exactly `value` for most
    # of these), reward 1 varies. eps = 0 would turn any rounding residue into +-1 or nan.
    r = np.zeros((g, 2), dtype)
    r[:, 0] = value
    r[:, 1] = np.arange(g)
    for name in ESTIMATORS:
        d = compute_advantage_details(r, np.zeros(g, int), estimator=name, eps=0.0)
        assert np.isfinite(d.summed).all()
    d = compute_advantage_details(r, np.zeros(g, int), estimator="gdpo", eps=0.0)
    assert (d.reward_advantages[:, 0] == 0).all()
    assert d.zero_spread[0].tolist() == [True, False]
    # only reward 1 moves S: S = A_1
    np.testing.assert_allclose(d.summed, d.reward_advantages[:, 1], rtol=1e-6)
    # a group where every reward is constant gives S = 0 exactly; GRPO of it too
    r[:, 1] = value
    for name in ESTIMATORS:
        out = compute_advantage_details(r, np.zeros(g, int), estimator=name, eps=0.0)
        assert (out.summed == 0).all() and (out.advantages == 0).all()


def test_fewer_than_two_valid_values_contribute_zero():
    nan = np.nan
    # reward 0 has one valid value (0.5) in the group: contributes 0; reward 1 = (0, 1, 2):
    # mean 1, std 1 -> (-1, 0, 1)
    r = [[nan, 0], [0.5, 1], [nan, 2]]
    d = compute_advantage_details(np.array(r), np.zeros(3, int), estimator="gdpo", eps=0)
    assert d.zero_spread[0].tolist() == [True, False]
    assert d.group_count[0].tolist() == [1, 3]
    np.testing.assert_array_equal(d.summed, [-1, 0, 1])


def test_nan_is_left_out_of_group_statistics():
    nan = np.nan
    # r = (0, 1, NaN, 1): statistics of (0, 1, 1): mean 2/3, std = sqrt((4/9 + 1/9 + 1/9) / 2)
    #   = 1/sqrt(3); A = (-2/3, 1/3, -, 1/3) * sqrt(3) = (-1.1547, 0.5774, 0, 0.5774)
    r = np.array([[0.0], [1.0], [nan], [1.0]])
    d = compute_advantage_details(r, np.zeros(4, int), estimator="gdpo", eps=0)
    np.testing.assert_allclose(d.summed, [-2 / SQRT3, 1 / SQRT3, 0, 1 / SQRT3], rtol=1e-15)
    assert d.summed[2] == 0.0 and not d.scored[2]
    np.testing.assert_allclose(d.group_mean, [[2 / 3]], rtol=1e-15)
    np.testing.assert_allclose(d.group_std, [[1 / SQRT3]], rtol=1e-15)


def test_rollout_without_valid_reward_is_out_of_batch_statistics():
    nan = np.nan
    # group 0 = ((0, 0), (1, 1), (NaN, NaN)): S = (-1.4142, 1.4142, 0) with row 2 unscored
    # group 1 = ((0, 0), (0, 1)): S = (-0.7071, 0.7071)
    # batch over the 4 scored rows: mean 0, std sqrt(5/3) (as in test_batch_of_two_groups)
    r = [[0, 0], [1, 1], [nan, nan], [0, 0], [0, 1]]
    g = [0, 0, 0, 1, 1]
    d = compute_advantage_details(np.array(r), np.array(g), estimator="gdpo", eps=0)
    s = math.sqrt(5 / 3)
    np.testing.assert_allclose(d.advantages, [-SQRT2 / s, SQRT2 / s, 0, -H / s, H / s], rtol=1e-15)
    assert d.advantages[2] == 0.0 and d.scored.tolist() == [True, True, False, True, True]
    assert d.batch_mean == pytest.approx(0, abs=1e-15) and d.batch_std == pytest.approx(s, rel=1e-15)


def test_grpo_nan_makes_rollout_unscorable():
    nan = np.nan
    # totals (1, NaN, 2, 0): the NaN row is out (never a nan-sum of 0): stats of (1, 2, 0):
    # mean 1, std 1 -> (0, 0, 1, -1)
    r = [[1, 0], [0, nan], [1, 1], [0, 0]]
    d = compute_advantage_details(np.array(r), np.zeros(4, int), estimator="grpo", eps=0)
    np.testing.assert_array_equal(d.advantages, [0, 0, 1, -1])
    assert d.scored.tolist() == [True, False, True, True]
    np.testing.assert_array_equal(
        adv(r, [0] * 4, "grpo_no_std", eps=0), [0, 0, 1, -1]
    )


def test_batch_std_zero_gives_zero_without_division():
    # every group has zero spread in every reward: S = 0 everywhere, batch std 0 -> exactly 0
    r = [[0.1, 1], [0.1, 1], [0.3, 0], [0.3, 0], [0.3, 0]]
    for eps in (0.0, 1e-6):
        out = adv(r, [0, 0, 1, 1, 1], "gdpo", eps=eps)
        assert out.tolist() == [0.0] * 5


def test_all_nan_batch_is_all_zero():
    r = np.full((4, 2), np.nan)
    for name in ESTIMATORS:
        out = compute_advantage_details(r, np.array([0, 0, 1, 1]), estimator=name, eps=0)
        assert out.advantages.tolist() == [0.0] * 4 and not out.scored.any()


def test_k1_gdpo_is_grpo_followed_by_batch_normalization():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(60, 1))
    g = np.repeat(np.arange(10), 6)
    a = adv(r, g, "grpo", eps=1e-6)
    # batch normalization by hand: unbiased std over the batch
    expected = (a - a.mean()) / (a.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv(r, g, "gdpo", eps=1e-6), expected, rtol=1e-12, atol=1e-12)


def test_group_of_one_rollout_is_an_error():
    with pytest.raises(ValueError, match=r"group_index: group 1 has 1 rollout.*group_size >= 2"):
        adv([[0.0], [1.0], [1.0]], [0, 0, 1], "gdpo")


# ----------------------------------------------------------------------------------------------
# Weights, float32 and eps = 0: rounding never becomes signal.


def test_grpo_identical_rows_give_exactly_zero_under_float32_weights():
    # three identical rows (0.9, 0.8, 0.4), weights (2, 1, 0.3), float32 as the driver has them:
    # t = 1.8 + 0.8 + 0.12 = 2.72 for every row. A BLAS product rounded equal rows differently:
    # (0.140, -0.070, -0.070) at eps 1e-6 and (1.155, -0.577, -0.577) at eps 0.
    r = np.array([[0.9, 0.8, 0.4]] * 3, np.float32)
    w = np.array([2.0, 1.0, 0.3], np.float32)
    for name in ("grpo", "grpo_no_std"):
        for eps in (1e-6, 0.0):
            out = compute_advantages(r, np.zeros(3, int), estimator=name, weights=w, eps=eps)
            assert out.tolist() == [0.0, 0.0, 0.0]
    # 256 groups of 16 identical random rows each: wherever a row sits in a BLAS block
    rng = np.random.default_rng(0)
    rows = rng.random((256, 5)).astype(np.float32)
    r = np.repeat(rows, 16, axis=0)
    for name in ESTIMATORS:
        out = compute_advantages(r, np.repeat(np.arange(256), 16), estimator=name,
                                 weights=rng.uniform(-2, 3, 5), eps=0.0)
        assert (out == 0).all(), name


def test_rounding_residue_is_zero_spread_and_real_small_spread_is_signal():
    # GRPO: totals 0.1 + 0.5 = 0.6 and 0.2 + 0.4 = 0.6 differ by 1.1e-16 in float64 (and 0.1f +
    # 0.5f, 0.2f + 0.4f by 7.5e-9 in float32's own values); at eps 0 that was (-0.7071, 0.7071)
    for dtype in (np.float64, np.float32):
        r = np.array([[0.1, 0.5], [0.2, 0.4]], dtype)
        for name in ("grpo", "grpo_no_std"):
            assert compute_advantages(r, [0, 0], estimator=name, eps=0).tolist() == [0.0, 0.0]
    # GDPO: r2 = 1 - r1 in group 0 (A2 = -A1, S = +-1e-16), an all-zero group 1; the batch std
    # of S was 1e-16 and eps 0 gave (0.5, -1.5, 0.5, 0.5)
    r = np.array([[0.1, 0.9], [0.7, 0.3], [0.0, 0.0], [0.0, 0.0]])
    d = compute_advantage_details(r, [0, 0, 1, 1], estimator="gdpo", eps=0)
    assert d.advantages.tolist() == [0.0] * 4 and d.summed.tolist() == [0.0] * 4
    assert d.cancelled.tolist() == [True, False]  # group 0's rewards vary but cancel
    np.testing.assert_allclose(d.reward_advantages[:2], [[-H, H], [H, -H]], rtol=1e-12)
    # a real small spread stays signal: (0, 1e-6) at eps 0 -> (-0.7071, 0.7071)
    for dtype in (np.float64, np.float32):
        r = np.array([[0.0], [1e-6]], dtype)
        np.testing.assert_allclose(compute_advantages(r, [0, 0], estimator="grpo", eps=0),
                                   [-H, H], rtol=1e-6)


def test_residue_threshold_is_sixteen_ulps_of_the_magnitude():
    # float64 totals 1 and 1 + k ulp (ulp = 2^-52): M = |mean| + std (n-1)/sqrt(n) = (1 + k/2 ulp)
    # + (k ulp / sqrt2) / sqrt2 = 1 + k ulp; tol = 16 ulp M: 16 ulp is residue, 17 ulp signal
    ulp = 2.0 ** -52
    for k, expected in ((16, [0.0, 0.0]), (17, [-H, H])):
        r = np.array([[1.0], [1.0 + k * ulp]])
        np.testing.assert_allclose(adv(r, [0, 0], "grpo", eps=0), expected, rtol=1e-12)
    # relative to the magnitude: at 1000 (its ulp is 2^-43), tol = 16 * 2^-52 * 1000 = 3.553e-12;
    # 31 of its ulps = 3.524e-12 are residue, 32 = 3.638e-12 are signal
    for k, expected in ((31, [0.0, 0.0]), (32, [-H, H])):
        r = np.array([[1000.0], [1000.0 + k * 2.0 ** -43]])
        np.testing.assert_allclose(adv(r, [0, 0], "grpo", eps=0), expected, rtol=1e-12)
    assert RESIDUE_ULPS == 16


def test_zero_signal_rollouts_stay_exactly_zero_after_batch_normalization():
    # the batch mean of S is 0 by construction (S sums to 0 in every group); it is not
    # subtracted, so group 1 (no spread) keeps exactly 0 while group 0 = (0, 1, 1):
    # A = (-2/3, 1/3, 1/3) * sqrt(3) = (-1.1547, 0.5774, 0.5774); batch std over the 5 rollouts
    # = sqrt((4/3 + 1/3 + 1/3) / 4) = sqrt(1/2) -> S / 0.7071
    r = np.array([[0.0], [1.0], [1.0], [0.3], [0.3]], np.float32)
    out = compute_advantages(r, [0, 0, 0, 1, 1], estimator="gdpo", eps=0)
    assert out[3:].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(out[:3], np.array([-2, 1, 1]) / SQRT3 / H, rtol=1e-6)


def test_informative_groups_use_the_weights():
    # GRPO (1, 0), (0, 1) with weights (2, 1): totals (2, 1) -> trains at (0.7071, -0.7071);
    # with equal weights the totals (1, 1) are equal -> not informative
    r = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert informative_groups(r, [0, 0], estimator="grpo", weights=[2, 1]).tolist() == [True]
    assert informative_groups(r, [0, 0], estimator="grpo").tolist() == [False]
    np.testing.assert_allclose(adv(r, [0, 0], "grpo", weights=[2, 1], eps=0), [H, -H], rtol=1e-12)
    # weights (0, 1): in group "b" only the weight-0 reward varies -> S = 0, not informative;
    # in "a" and "c" reward 1 varies. Weights (1, 1): "b" informative, "c" has r2 = 1 - r1
    # (they cancel, S = 0) -> not. One bool per group, in the order the groups first appear.
    r = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.2, 0.8], [0.9, 0.1]])
    labels = ["b", "b", "a", "a", "c", "c"]
    for name in ("gdpo", "gdpo_no_std"):
        got = informative_groups(r, labels, estimator=name, weights=[0.0, 1.0], eps=0)
        assert got.tolist() == [False, True, True], name
        got = informative_groups(r, labels, estimator=name, weights=[1.0, 1.0], eps=0)
        assert got.tolist() == [True, True, False], name


# ----------------------------------------------------------------------------------------------
# Invariances and equivalences.


def reference(rewards, groups, estimator, weights=None, eps=1e-6):
    """A plain loop over groups and rewards, written straight from DESIGN.md §1 and the module
    docstring (the rounding-residue rule included), in 50-digit decimal arithmetic: its own
    rounding is far below any tolerance, so the zeros it returns are true zeros."""
    ulp = D(np.finfo(np.float64 if rewards.dtype == np.float64 else np.float32).eps)
    n, k = rewards.shape
    w = [D(v) for v in (np.ones(k) if weights is None else np.asarray(weights, np.float64))]
    e = D(eps)
    table = [[None if np.isnan(v) else D(v) for v in row] for row in rewards]

    def stats(values):  # (mean, std) of the valid values, None for zero spread or < 2 valid
        v = [x for x in values if x is not None]
        if len(v) < 2 or max(v) == min(v):
            return None
        mean = sum(v) / len(v)
        return mean, (sum((x - mean) ** 2 for x in v) / (len(v) - 1)).sqrt()

    def without_residue(values, magnitude):  # spread <= 16 ulp M: exactly 0
        v = [x for x in values if x is not None]
        if v and max(v) - min(v) <= D(RESIDUE_ULPS) * ulp * magnitude:
            return [None if x is None else D(0) for x in values]
        return values

    use_std = not estimator.endswith("no_std")
    out = [D(0)] * n
    for label in np.unique(groups):
        rows = np.flatnonzero(groups == label)
        if estimator.startswith("grpo"):
            totals = [None if None in table[i] else sum(wk * v for wk, v in zip(w, table[i]))
                      for i in rows]
            scorable = [table[i] for i, t in zip(rows, totals) if t is not None]
            magnitude = D(0)
            for j in range(k):
                st = stats([r[j] for r in scorable])
                if st is not None:
                    count = D(len(scorable))
                    magnitude += abs(w[j]) * (abs(st[0]) + st[1] * (count - 1) / count.sqrt())
            totals = without_residue(totals, magnitude)
            st = stats(totals)
            for i, t in zip(rows, totals):
                if st is not None and t is not None:
                    out[i] = (t - st[0]) / (st[1] + e) if use_std else t - st[0]
            continue
        s, magnitude = [D(0)] * len(rows), D(0)
        for j in range(k):
            column = [table[i][j] for i in rows]
            st = stats(column)
            if st is None:
                continue
            scale = 1 / (st[1] + e) if use_std else D(1)
            count = D(sum(x is not None for x in column))
            magnitude += abs(w[j]) * (abs(st[0]) + st[1] * (count - 1) / count.sqrt()) * scale
            s = [a if x is None else a + w[j] * (x - st[0]) * scale for a, x in zip(s, column)]
        for i, a in zip(rows, without_residue(s, magnitude)):
            out[i] = a
    if estimator.startswith("gdpo"):
        scored = [i for i in range(n) if any(v is not None for v in table[i])]
        v = [out[i] for i in scored]
        batch = [D(0)] * n
        if len(v) >= 2 and max(v) != min(v):
            mean = sum(v) / len(v)
            std = (sum((x - mean) ** 2 for x in v) / (len(v) - 1)).sqrt()
            for i in scored:
                batch[i] = (out[i] - mean) / (std + e)
        out = batch
    # |x| < 1e-30: the decimals' own rounding (50 digits) of a true zero, such as t - mean(t)
    return np.array([float(x) if abs(x) > D(1e-30) else 0.0 for x in out])


def random_table(rng, num_groups, k, nan_fraction, uniform):
    sizes = np.full(num_groups, 4) if uniform else rng.integers(2, 9, num_groups)
    groups = np.repeat(rng.permutation(num_groups * 3)[:num_groups], sizes)
    # binary, three-level, continuous and tenths, so that zero spread occurs; from the fourth
    # reward on, every other one is c - (an earlier reward), so rewards cancel (rounding residue)
    n = len(groups)
    kinds = [rng.integers(0, 2, n), rng.integers(0, 3, n) / 2, rng.normal(size=n),
             rng.integers(0, 10, n) / 10]
    columns = []
    for j in range(k):
        if j >= 3 and j % 2:
            columns.append(rng.uniform(0, 2) - columns[rng.integers(0, j)])
        else:
            columns.append(kinds[j % 4])
    r = np.stack(columns, axis=1).astype(float)
    r[rng.random(r.shape) < nan_fraction] = np.nan
    return r, groups


@pytest.mark.parametrize("estimator", ["gdpo", "gdpo_no_std", "grpo", "grpo_no_std"])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("nan_fraction", [0.0, 0.15])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("dtype, eps", [(np.float64, 1e-6), (np.float32, 1e-6), (np.float32, 0.0),
                                        (np.float64, 0.0)])
def test_vectorized_equals_plain_loop(estimator, uniform, nan_fraction, shuffled, dtype, eps):
    # float32 rewards, non-unit weights and eps = 0 are the driver's and the paper's settings;
    # at eps = 0 any rounding residue that escapes the rule becomes an order-1 advantage
    rng = np.random.default_rng(zlib.crc32(repr((estimator, uniform, nan_fraction, shuffled, eps)).encode()))
    for k in (1, 2, 3, 5, 6):
        r, g = random_table(rng, 30, k, nan_fraction, uniform)
        if shuffled:
            order = rng.permutation(len(g))
            r, g = r[order], g[order]
        r = r.astype(dtype)
        w = np.round(rng.uniform(-1, 3, k), 1) if k < 4 else np.ones(k)  # c - r cancels at w = 1
        got = compute_advantages(r, g, estimator=estimator, weights=w.astype(dtype), eps=eps)
        want = reference(r, g, estimator, w.astype(dtype), eps)
        # the same groups without any signal (all exactly 0), then the same values
        zero = lambda a: [bool((a[g == label] == 0).all()) for label in np.unique(g)]  # noqa: E731
        assert zero(got) == zero(want)
        rtol = 1e-9 if dtype == np.float64 else 1e-6
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def test_row_permutation_permutes_advantages():
    rng = np.random.default_rng(7)
    r, g = random_table(rng, 30, 3, 0.1, uniform=False)
    base = adv(r, g, "gdpo")
    for _ in range(5):
        p = rng.permutation(len(g))
        np.testing.assert_allclose(adv(r[p], g[p], "gdpo"), base[p], rtol=1e-12, atol=1e-12)


def test_permuting_within_a_group_permutes_its_advantages():
    r = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [0.0, 0.0]])
    base = adv(r, [0] * 4, "gdpo")
    p = [2, 0, 3, 1]
    np.testing.assert_allclose(adv(r[p], [0] * 4, "gdpo"), base[p], rtol=1e-12)


def test_sharded_group_statistics_equal_global():
    # S only depends on each group, so computing it shard by shard (groups never split) gives
    # the global values; batch normalization then needs the whole batch (done on the driver).
    rng = np.random.default_rng(3)
    r, g = random_table(rng, 24, 3, 0.1, uniform=False)
    whole = summed(r, g, "gdpo")
    labels = np.unique(g)
    for shard in np.array_split(labels, 3):
        rows = np.isin(g, shard)
        np.testing.assert_allclose(summed(r[rows], g[rows], "gdpo"), whole[rows], rtol=1e-12)


def test_string_group_labels():
    r = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    by_int = adv(r, [0, 0, 1, 1], "gdpo")
    by_str = adv(r, ["p0/g", "p0/g", "p1/g", "p1/g"], "gdpo")
    np.testing.assert_array_equal(by_int, by_str)


def test_float32_matches_float64():
    rng = np.random.default_rng(5)
    r, g = random_table(rng, 100, 4, 0.05, uniform=True)
    for name in ESTIMATORS:
        a64 = adv(r, g, name)
        a32 = compute_advantages(r.astype(np.float32), g, estimator=name)
        assert a32.dtype == np.float32 and a64.dtype == np.float64
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-5)


def test_numpy_and_torch_give_the_same():
    rng = np.random.default_rng(9)
    r, g = random_table(rng, 20, 3, 0.1, uniform=False)
    for name in ESTIMATORS:
        a_np = adv(r, g, name, weights=[1.0, 0.5, 2.0])
        a_t = compute_advantages(
            torch.from_numpy(r), torch.from_numpy(g), estimator=name,
            weights=torch.tensor([1.0, 0.5, 2.0]),
        )
        assert isinstance(a_t, torch.Tensor) and a_t.dtype == torch.float64
        np.testing.assert_array_equal(a_t.numpy(), a_np)
    a32 = compute_advantages(torch.from_numpy(r).float(), torch.from_numpy(g), estimator="gdpo")
    assert a32.dtype == torch.float32


def test_details_per_reward_advantages():
    # group (0, 1) in reward 0, (1, 1) in reward 1 -> per-reward (-0.7071, 0.7071) and (0, 0)
    d = compute_advantage_details(np.array([[0.0, 1.0], [1.0, 1.0]]), [5, 5], estimator="gdpo", eps=0)
    np.testing.assert_allclose(d.reward_advantages, [[-H, 0], [H, 0]], rtol=1e-15)
    assert d.group_labels.tolist() == [5] and d.group_sizes.tolist() == [2]
    np.testing.assert_allclose(d.group_mean, [[0.5, 1.0]])
    np.testing.assert_allclose(d.group_std, [[H, 0.0]], rtol=1e-15)


# ----------------------------------------------------------------------------------------------
# Errors name the argument.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_index=[0, 0, 0]), r"group_index must be \[N\] with N = 4"),
        (dict(estimator="ppo"), r"unknown advantage estimator 'ppo'; known: gdpo, gdpo_no_std, grpo, grpo_no_std"),
        (dict(weights=[1.0]), r"weights must have one entry per reward \(K = 2\); got 1"),
        (dict(weights=[1.0, np.nan]), r"weights must be finite"),
        (dict(weights=[np.inf, 1.0]), r"weights must be finite"),
        (dict(eps=-1.0), r"eps must be a finite number >= 0"),
        (dict(rewards=np.array([[0.0, np.inf]] * 4)), r"rewards\[0, 1\] is inf"),
        (dict(rewards=np.zeros((4, 2, 1))), r"rewards must be \[N, K\]"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = dict(rewards=np.zeros((4, 2)), group_index=[0, 0, 1, 1], estimator="gdpo")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compute_advantages(args.pop("rewards"), args.pop("group_index"), **args)


def test_grpo_rejects_infinite_rewards_too():
    with pytest.raises(ValueError, match=r"rewards\[1, 0\] is -inf"):
        adv([[0.0, 1.0], [-np.inf, 0.0]], [0, 0], "grpo")


def test_a_new_estimator_is_one_registered_function(monkeypatch):
    """An estimator written in the public building blocks: only the first reward, normalized in
    its group, no batch normalization."""
    from gdpo_ray.advantages import ESTIMATORS, EstimatorOutput
    from gdpo_ray.normalization import normalize_in_groups

    def first_only(rewards, groups, weights, eps, ulp):
        norm = normalize_in_groups(rewards[:, :1], groups, use_std=True, eps=eps)
        summed = norm.contributions(groups, np.ones_like(norm.mean_d))
        rest = np.zeros((len(summed), rewards.shape[1] - 1))
        return EstimatorOutput(summed, summed, None, norm, float("nan"), float("nan"),
                               np.zeros(len(groups.sizes), bool), np.zeros_like(norm.ref),
                               lambda: np.concatenate([norm.per_column(groups), rest], axis=1))

    monkeypatch.setitem(ESTIMATORS._entries, "first_only", first_only)
    rewards = np.array([[0.0, 5.0], [1.0, 5.0], [1.0, 1.0], [1.0, 7.0]])
    # group 0: (0, 1) -> -+1/sqrt(2) (unbiased std 0.7071); group 1: (1, 1) has zero spread -> 0
    out = compute_advantages(rewards, np.array([0, 0, 1, 1]), estimator="first_only", eps=0.0)
    np.testing.assert_array_equal(out, [-1 / np.sqrt(2), 1 / np.sqrt(2), 0.0, 0.0])
    details = compute_advantage_details(rewards, np.array([0, 0, 1, 1]), estimator="first_only", eps=0.0)
    np.testing.assert_array_equal(details.contributions[:, 1], 0.0)


@pytest.mark.parametrize("estimator", ["gdpo", "gdpo_no_std", "grpo", "grpo_no_std"])
@pytest.mark.parametrize("nan_fraction", [0.0, 0.15])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_large_batch_computed_in_chunks_equals_the_whole(monkeypatch, estimator, nan_fraction, dtype):
    # compute_advantages takes a large batch of equal contiguous groups chunk by chunk (the
    # temporaries stay in the cache); details take it whole: the same advantages, and the same
    # exactly-zero groups
    import gdpo_ray.advantages as adv

    monkeypatch.setattr(adv, "CHUNK_ROWS", 40)  # 2 * 40 <= N = 92: chunks of 10 groups of 4
    rng = np.random.default_rng(7)
    r, g = random_table(rng, 23, 5, nan_fraction, uniform=True)
    r, g = r.astype(dtype), np.sort(g)
    assert len(r) >= 2 * adv.CHUNK_ROWS and adv._chunked(r, g, estimator, None, 0.0) is not None
    w = np.array([0.5, 1.0, 1.0, 2.0, 1.0], dtype)
    for eps in (0.0, 1e-6):
        got = compute_advantages(r, g, estimator=estimator, weights=w, eps=eps)
        want = compute_advantage_details(r, g, estimator=estimator, weights=w, eps=eps).advantages
        assert got.dtype == want.dtype and ((got == 0) == (want == 0)).all()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    r[85, 2] = np.inf  # named by its row in the whole batch (chunk 3, its row 5)
    with pytest.raises(ValueError, match=r"rewards\[85, 2\] is inf"):
        compute_advantages(r, g, estimator=estimator)
