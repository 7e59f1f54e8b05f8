"""Degeneracy diagnostics (issue 51; gdpo_ray/diagnostics.py, RewardWatch.diagnose) on constructed
batches: each diagnostic's metric with the arithmetic beside it, its warning logged once naming
the rewards, and none of them on a healthy batch."""

import logging
import math

import numpy as np
import pytest

from gdpo_ray import diagnostics
from gdpo_ray.advantages import compute_advantage_details
from gdpo_ray.diagnostics import diagnose, share_ratios
from gdpo_ray.metrics import signal_metrics
from gdpo_ray.reward_watch import RewardWatch

H = 1 / math.sqrt(2)  # (0, 1) normalized with the unbiased std


def details(rewards, groups, **kw):
    return compute_advantage_details(np.asarray(rewards, float), np.asarray(groups), estimator="gdpo",
                                     eps=0.0, **kw)


def watch(names, **kw):
    return RewardWatch(names, limit=0.5, steps=3, **kw)


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "gdpo_ray.reward_watch"]


# a healthy batch: two groups of four, a and b vary in both, independently (A_a . A_b = 0 in each),
# and the judge j on [0, 10] spreads by 6 and 8 (far above 0.05 * 10 = 0.5), orthogonally to both
HEALTHY = np.array([[1, 1, 8], [1, 0, 2], [0, 1, 2], [0, 0, 8],
                    [1, 1, 9], [1, 0, 1], [0, 1, 1], [0, 0, 9]], np.float32)
FOUR = [0, 0, 0, 0, 1, 1, 1, 1]


def test_nothing_fires_on_a_healthy_batch(caplog):
    w = watch(["a", "b", "j"], scales={"j": (0, 10)})
    with caplog.at_level(logging.WARNING):
        for step in range(8):  # past the share baseline: the shares stay where they began
            m = w.diagnose(step, HEALTHY, details(HEALTHY, FOUR))
    assert {k: v for k, v in m.items() if k.startswith("diag/")} == {
        "diag/cancelling_pairs": 0.0, "diag/no_spread_columns": 0.0, "diag/near_tie_columns": 0.0,
        "diag/collapsed_shares": 0.0}
    assert m["rewards/j/near_tie_groups"] == 0.0
    assert "rewards/a/near_tie_groups" not in m  # no scale, no near-tie count
    # every column varies in every group, orthogonally within each group: equal shares 1/3,
    # their own baseline, so each ratio is 1
    assert [m[f"adv/{k}/share_ratio"] for k in "abj"] == pytest.approx([1.0, 1.0, 1.0])
    assert warnings(caplog) == []


def test_a_cancelling_pair_is_counted_each_step_and_named_once(caplog):
    # b = 1 - a in every group (a constant total): A_b = -A_a, so with equal weights they cancel;
    # c varies, so the batch has signal. group 0: a = (1, 0), group 1: a = (0, 1), c = (0, 1) in both
    r = np.array([[1, 0, 0], [0, 1, 1], [0, 1, 0], [1, 0, 1]], np.float32)
    g = [0, 0, 1, 1]
    d = diagnose(r, details(r, g), ["a", "b", "c"])
    assert d.cancelling == [("a", "b")]
    # S = A_c = (-H, H) in both groups, sum S^2 = 2; c_a . S = H(-H) + (-H)H + (-H)(-H) + H H = 0:
    # a and b carry nothing; c all of it
    assert d.shares == pytest.approx([0.0, 0.0, 1.0], abs=1e-12)
    w = watch(["a", "b", "c"])
    with caplog.at_level(logging.WARNING):
        first = w.diagnose(0, r, details(r, g))
        second = w.diagnose(1, r, details(r, g))
    assert first["diag/cancelling_pairs"] == second["diag/cancelling_pairs"] == 1.0
    [message] = warnings(caplog)  # once, not once per step
    assert "rewards 'a' and 'b' cancel in every group of step 0" in message
    assert "drop one" in message and "diag/cancelling_pairs" in message
    # weights (2, 1): no longer one the other's negative
    assert diagnose(r, details(r, g, weights=[2.0, 1.0, 1.0]), ["a", "b", "c"]).metrics()[
        "diag/cancelling_pairs"] == 0.0


def test_a_column_without_spread_in_most_groups_is_named_once(caplog):
    # four groups of two. format: (1, 1) (1, 1) (1, 1) (0, 1): no spread in 3 of 4 > 0.5 -> named.
    # correct varies in every group. tool applies to groups 2 and 3 only (NaN in 0 and 1, another
    # environment's rows): it varies in both groups where it was computed -> not named, though
    # rewards/tool/zero_spread_groups counts the NaN groups (2 of 4)
    nan = np.nan
    r = np.array([[1, 0, nan], [1, 1, nan], [1, 1, nan], [1, 0, nan],
                  [1, 0, 0], [1, 1, 1], [0, 0, 1], [1, 1, 0]], np.float32)
    g = [0, 0, 1, 1, 2, 2, 3, 3]
    names = ["format", "correct", "tool"]
    d = diagnose(r, details(r, g), names)
    assert d.computed_groups.tolist() == [4, 4, 2] and d.no_spread_groups.tolist() == [3, 0, 0]
    assert d.no_spread_columns() == ["format"]
    assert signal_metrics(r, details(r, g), names)["rewards/tool/zero_spread_groups"] == 0.5
    w = watch(names)
    with caplog.at_level(logging.WARNING):
        m = w.diagnose(4, r, details(r, g))
        w.diagnose(5, r, details(r, g))
    assert m["diag/no_spread_columns"] == 1.0
    [message] = warnings(caplog)
    # format's mean over its 8 values: 7/8
    assert "reward 'format' has no spread in 3 of the 4 groups of step 4" in message
    assert "mean in the step 0.875" in message
    for advice in ("harder prompts", "partial-credit reward", "training.group_size", "training.dynamic_sampling",
                   "rewards/format/zero_spread_groups"):
        assert advice in message
    # exactly half the groups is not most: format constant in groups 0 and 1 only
    r[5] = [0, 1, 1]
    assert diagnose(r, details(r, g), names).no_spread_columns() == []


def test_near_ties_within_a_judges_scale(caplog):
    # judge j on [0, 10]: a near tie spreads by less than 0.05 * 10 = 0.5. Groups: (7.3, 7.4) tie
    # (0.1), (2, 8) no (6), (5, 5) no spread (not a tie: it does not vary), (7.0, 7.45) tie (0.45),
    # (3.0, 3.5) no (0.5 is not below 0.5). a varies everywhere; u (no scale) has the same values as j
    j = [7.3, 7.4, 2, 8, 5, 5, 7.0, 7.45, 3.0, 3.5]
    r = np.array([[x, i % 2, x] for i, x in enumerate(j)], np.float32)
    g = np.repeat(np.arange(5), 2)
    d = details(r, g)
    # the premise: per-group normalization makes 7.3 vs 7.4 as large as 2 vs 8
    np.testing.assert_allclose(d.reward_advantages[:4, 0], [-H, H, -H, H], rtol=1e-6)
    w = watch(["j", "a", "u"], scales={"j": [0, 10]})
    with caplog.at_level(logging.WARNING):
        m = w.diagnose(0, r, d)
    # 2 ties of 5 groups; 2 of the 4 groups where j varies is not more than half: not named
    assert m["rewards/j/near_tie_groups"] == 0.4 and m["diag/near_tie_columns"] == 0.0
    assert "rewards/u/near_tie_groups" not in m and warnings(caplog) == []
    # without the (3.0, 3.5) group: 2 ties of the 3 groups where j varies -> named, once
    r4, g4 = r[:8], g[:8]
    with caplog.at_level(logging.WARNING):
        m = w.diagnose(1, r4, details(r4, g4))
        w.diagnose(2, r4, details(r4, g4))
    assert m["rewards/j/near_tie_groups"] == 0.5 and m["diag/near_tie_columns"] == 1.0
    [message] = warnings(caplog)
    assert "reward 'j' varies by less than 5% of its scale [0, 10] in 2 of the 3 groups of step 1" in message
    assert "gdpo_no_std" in message and "rewards/j/near_tie_groups" in message
    # the no-std estimators only center: the ties stay small there, counted but not warned about
    caplog.clear()
    quiet = watch(["j", "a", "u"], scales={"j": (0, 10)}, estimator="gdpo_no_std")
    with caplog.at_level(logging.WARNING):
        assert quiet.diagnose(0, r4, details(r4, g4))["diag/near_tie_columns"] == 1.0
    assert warnings(caplog) == []


def shares_named(caplog):  # (b's no spread in the low steps has its own warning)
    return [m for m in warnings(caplog) if "of the advantage variance" in m]


def test_a_collapsing_share_is_named_after_three_low_steps_once(caplog):
    # one group of four; a = (1, 1, 0, 0), b = (1, 0, 1, 0): A_a . A_b = 0 and |A_a| = |A_b|, so
    # each carries half the variance of S. "low": b constant -> share_b = 0, share_a = 1.
    # "flat": nothing varies -> no signal, all shares 0
    balanced = np.array([[1, 1], [1, 0], [0, 1], [0, 0]], np.float32)
    low = np.array([[1, 1], [1, 1], [0, 1], [0, 1]], np.float32)
    flat = np.ones((4, 2), np.float32)
    g = [0, 0, 0, 0]
    w = watch(["a", "b"])
    ratios, collapsed = [], []
    plan = [balanced, flat, balanced, balanced, balanced, balanced,  # the baseline: 5 steps with signal
            low, low, balanced, low, low, flat, low, low]
    with caplog.at_level(logging.WARNING):
        for step, r in enumerate(plan):
            m = w.diagnose(step, r, details(r, g))
            ratios.append((m["adv/a/share_ratio"], m["adv/b/share_ratio"]))
            collapsed.append(m["diag/collapsed_shares"])
            if step == 11:
                assert shares_named(caplog) == []  # two low steps, a flat one, then ...
    assert w.share_baseline == pytest.approx([0.5, 0.5])  # the flat step 1 is not in it
    assert all(math.isnan(x) for pair in ratios[:5] for x in pair)  # no baseline before step 5
    assert ratios[5] == pytest.approx((1.0, 1.0))
    assert ratios[6] == pytest.approx((2.0, 0.0))  # 1 / 0.5 and 0 / 0.5
    assert all(math.isnan(x) for x in ratios[11])  # no signal, no ratio
    # steps 6-7 low, 8 recovers (the streak restarts), 9-10 low, 11 flat (neither), 12 the third
    assert collapsed == [0.0] * 12 + [1.0, 1.0]
    [message] = shares_named(caplog)  # at step 12, not again at 13
    assert "reward 'b' carries 0 of the advantage variance at step 12" in message
    assert "first 5 steps with signal (0.5), for 3 steps in a row" in message
    assert "adv/b/share_ratio" in message


def test_share_ratios_need_a_baseline_of_some_size():
    # 0.3 / 0.6; a baseline of 0 (weight 0) or under 0.05 (little from the start, or negative) has none
    out = share_ratios(np.array([0.3, 0.0, 0.2, 0.5]), np.array([0.6, 0.0, 0.04, -0.2]))
    assert out[0] == pytest.approx(0.5) and np.isnan(out[1:]).all()
    assert diagnostics.SHARE_BASELINE_MIN == 0.05 and diagnostics.SHARE_COLLAPSE_RATIO == 0.1


def test_scales_are_checked_by_name():
    with pytest.raises(ValueError, match=r"reward 'judge', which is not one of the rewards \['a'\]"):
        watch(["a"], scales={"judge": (0, 10)})
    with pytest.raises(ValueError, match=r"the scale of reward 'a' is \[5, 5\]; a scale is \[lo, hi\] with lo < hi"):
        watch(["a"], scales={"a": [5, 5]})
