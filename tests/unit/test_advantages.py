"""Exact numbers for the advantage math of DESIGN.md §1, with the arithmetic beside them."""

import math

import numpy as np
import pytest
import torch

from gdpo_ray.advantages import ESTIMATORS, compute_advantage_details, compute_advantages

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
# Invariances and equivalences.


def reference(rewards, groups, estimator, weights=None, eps=1e-6):
    """A plain loop over groups and rewards, written straight from DESIGN.md §1."""
    n, k = rewards.shape
    w = np.ones(k) if weights is None else np.asarray(weights, float)

    def normalize(values, use_std):
        out = np.zeros(len(values))
        ok = ~np.isnan(values)
        v = values[ok]
        if len(v) < 2 or v.max() == v.min():
            return out
        centred = values[ok] - v.mean()
        out[ok] = centred / (v.std(ddof=1) + eps) if use_std else centred
        return out

    use_std = not estimator.endswith("no_std")
    result = np.zeros(n)
    if estimator.startswith("grpo"):
        total = np.array([np.nan if np.isnan(row).any() else float(row @ w) for row in rewards])
        for label in np.unique(groups):
            rows = np.flatnonzero(groups == label)
            result[rows] = normalize(total[rows], use_std)
        return result
    s = np.zeros(n)
    for label in np.unique(groups):
        rows = np.flatnonzero(groups == label)
        for j in range(k):
            s[rows] += w[j] * normalize(rewards[rows, j], use_std)
    scored = ~np.isnan(rewards).all(axis=1)
    v = s[scored]
    if len(v) < 2 or v.max() == v.min():
        return result
    result[scored] = (v - v.mean()) / (v.std(ddof=1) + eps)
    return result


def random_table(rng, num_groups, k, nan_fraction, uniform):
    sizes = np.full(num_groups, 4) if uniform else rng.integers(2, 9, num_groups)
    groups = np.repeat(rng.permutation(num_groups * 3)[:num_groups], sizes)
    # binary, three-level and continuous rewards, so that zero spread occurs
    kinds = [rng.integers(0, 2, len(groups)), rng.integers(0, 3, len(groups)) / 2,
             rng.normal(size=len(groups))]
    r = np.stack([kinds[j % 3] for j in range(k)], axis=1).astype(float)
    r[rng.random(r.shape) < nan_fraction] = np.nan
    return r, groups


@pytest.mark.parametrize("estimator", ["gdpo", "gdpo_no_std", "grpo", "grpo_no_std"])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("nan_fraction", [0.0, 0.15])
@pytest.mark.parametrize("shuffled", [False, True])
def test_vectorized_equals_plain_loop(estimator, uniform, nan_fraction, shuffled):
    rng = np.random.default_rng(hash((estimator, uniform, nan_fraction, shuffled)) % 2**32)
    for k in (1, 2, 3, 5):
        r, g = random_table(rng, 40, k, nan_fraction, uniform)
        if shuffled:
            order = rng.permutation(len(g))
            r, g = r[order], g[order]
        w = rng.uniform(-1, 3, k)
        got = adv(r, g, estimator, weights=w, eps=1e-6)
        np.testing.assert_allclose(got, reference(r, g, estimator, w, 1e-6), rtol=1e-9, atol=1e-12)


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
