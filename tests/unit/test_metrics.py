"""Per-reward signal metrics (gdpo_ray/metrics.py), exact numbers with the arithmetic beside them."""

import math

import numpy as np
import pytest

from gdpo_ray.advantages import compute_advantage_details
from gdpo_ray.metrics import advantage_metrics, cancelling_pairs, rollout_metrics, sampled_reward_metrics, signal_metrics

H = 1 / math.sqrt(2)


def details(rewards, groups, estimator="gdpo", **kw):
    return compute_advantage_details(np.asarray(rewards, float), np.asarray(groups),
                                     estimator=estimator, eps=0.0, **kw)


def test_gdpo_shares_and_zero_spread_groups():
    # weights (2, 1). group 0 = ((0, 0), (1, 1)): A1 = A2 = (-H, H); c1 = 2 A1 = (-1.414, 1.414),
    # c2 = (-H, H), S = (-3H, 3H). group 1 = ((0, 1), (0, 0)): reward 1 has zero spread, c2 =
    # (H, -H) = S. sum S^2 = 2 * 9/2 + 2 * 1/2 = 10; sum c1 S = 2 * sqrt2 * 3H = 6 -> share 0.6;
    # sum c2 S = 2 * H * 3H + 2 * H * H = 3 + 1 = 4 -> share 0.4
    r = [[0, 0], [1, 1], [0, 1], [0, 0]]
    d = details(r, [0, 0, 1, 1], weights=[2.0, 1.0])
    m = signal_metrics(np.array(r, float), d, ["a", "b"])
    assert m["adv/a/share"] == pytest.approx(0.6, rel=1e-12)
    assert m["adv/b/share"] == pytest.approx(0.4, rel=1e-12)
    # reward a is constant in group 1 (1 of 2 groups), reward b varies in both
    assert m["rewards/a/zero_spread_groups"] == 0.5 and m["rewards/b/zero_spread_groups"] == 0.0
    assert m["adv/cancelled_groups"] == 0.0


def test_grpo_shares_split_the_weighted_total():
    # weights (2, 1), one group ((1, 0), (0, 1), (1, 1)): t = (2, 1, 3), mean 2, std 1 ->
    # A = (0, -1, 1). Reward parts: c1 = 2 ((1, 0, 1) - 2/3) = (2/3, -4/3, 2/3), c2 = (0, 1, 1) -
    # 2/3 = (-2/3, 1/3, 1/3) (c1 + c2 = A). share1 = (0 + 4/3 + 2/3) / 2 = 1, share2 = 0 / 2 = 0
    r = [[1, 0], [0, 1], [1, 1]]
    d = details(r, [0, 0, 0], "grpo", weights=[2.0, 1.0])
    np.testing.assert_allclose(d.contributions, [[2 / 3, -2 / 3], [-4 / 3, 1 / 3], [2 / 3, 1 / 3]],
                               atol=1e-15)
    m = signal_metrics(np.array(r, float), d, ["a", "b"])
    assert m["adv/a/share"] == pytest.approx(1.0, rel=1e-12)
    assert m["adv/b/share"] == pytest.approx(0.0, abs=1e-15)


def test_no_signal_gives_zero_shares_and_gate_rates():
    # every group has zero spread: no S to share
    r = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, np.nan], [0.0, np.nan]])
    d = details(r, [0, 0, 1, 1])
    # gate: reward b is paid only when a >= 1; the gate column a = (1, 1, 0, 0) -> open 2/4
    m = signal_metrics(r, d, ["a", "b"], gates={"b": (0, 1.0)})
    assert m["adv/a/share"] == 0.0 and m["adv/b/share"] == 0.0
    assert m["rewards/a/zero_spread_groups"] == 1.0
    assert m["rewards/b/zero_spread_groups"] == 1.0  # (0, 0) and fewer than two valid values
    assert m["rewards/b/gate_open"] == 0.5
    # a gate reward that could not be computed is left out: (1, NaN, 0, 1) -> 2 of 3
    r[:, 0] = [1.0, np.nan, 0.0, 1.0]
    assert signal_metrics(r, details(r, [0, 0, 1, 1]), ["a", "b"],
                          gates={"b": (0, 1.0)})["rewards/b/gate_open"] == pytest.approx(2 / 3)


def test_the_sampled_mean_counts_the_dropped_groups():
    # trained: (1, 0), (0, 1); dropped by dynamic sampling: (0, 1), (0, 1), NaN in b.
    # a: (1 + 0 + 0 + 0 + 0) / 5 = 0.2; b over its 4 computed values: (0 + 1 + 1 + 1) / 4 = 0.75
    kept = np.array([[1, 0], [0, 1]], np.float32)
    dropped = np.array([[0, 1], [0, 1], [0, np.nan]], np.float32)
    m = sampled_reward_metrics(kept, dropped, ["a", "b"])
    assert m == {"rewards/a/sampled_mean": pytest.approx(0.2), "rewards/b/sampled_mean": 0.75}
    # nothing dropped (rewards_matrix of no groups is [0, 0]): the trained batch's mean
    assert sampled_reward_metrics(kept, np.zeros((0, 0), np.float32), ["a", "b"]) == {
        "rewards/a/sampled_mean": 0.5, "rewards/b/sampled_mean": 0.5}


def test_rollout_metrics_of_single_and_multi_turn_rollouts():
    lengths, reasons = np.array([4, 10, 7]), ["stop", "length", "stop"]
    single = rollout_metrics(lengths, reasons)
    assert single == {"response_length/mean": 7.0, "response_length/max": 10.0, "response_length/min": 4.0,
                      "response_length/clip_ratio": pytest.approx(1 / 3)}
    # per rollout: turns, tool calls, failed calls, abandoned calls
    turns = np.array([[1, 0, 0, 0], [3, 4, 2, 1], [2, 1, 0, 0]])
    multi = rollout_metrics(lengths, reasons, turns)
    assert {k: v for k, v in multi.items() if k.startswith("rollout/")} == {
        "rollout/turns/mean": 2.0, "rollout/tool_calls/mean": pytest.approx(5 / 3),
        "rollout/tool_errors": 2.0, "rollout/tool_timeouts": 1.0}


def test_cancelling_rewards_are_named_and_counted():
    # the paper's §3.1 case: r2 = 1 - r1 in every group (equal weights): A2 = -A1, S = 0. Reward c
    # varies in group 1 only, so the batch still has signal; a and b still cancel wherever they vary
    r = [[1, 0, 0], [1, 0, 0], [0, 1, 0], [0.3, 0.7, 0], [0.9, 0.1, 1]]
    g = [0, 0, 0, 1, 1]
    d = details(r, g)
    assert d.cancelled.tolist() == [True, False]  # group 1 has c's signal
    assert cancelling_pairs(d, ["a", "b", "c"]) == [("a", "b")]
    m = signal_metrics(np.array(r, float), d, ["a", "b", "c"])
    assert m["adv/cancelled_groups"] == 0.5
    # group 1 alone carries S: A_a = A_c = (-H, H), A_b = (H, -H), S = (-H, H), sum S^2 = 1;
    # share_a = sum A_a S = 1, share_b = -1 (it works against a), share_c = 1; they sum to 1
    assert [m[f"adv/{k}/share"] for k in "abc"] == pytest.approx([1.0, -1.0, 1.0], rel=1e-12)
    assert advantage_metrics(d, ["a", "b", "c"])["zero_advantage_groups"] == 1.0
    # with weights (2, 1) they no longer cancel: no pair
    assert cancelling_pairs(details(r, g, weights=[2.0, 1.0, 1.0]), ["a", "b", "c"]) == []


def test_a_pair_that_cancels_in_only_some_groups_is_not_named():
    # group 0: b = 1 - a (cancel); group 1: a varies, b is constant (no cancellation)
    r = [[1, 0], [0, 1], [1, 0.5], [0, 0.5]]
    assert cancelling_pairs(details(r, [0, 0, 1, 1]), ["a", "b"]) == []


def test_the_training_loop_logs_a_step_whose_metrics_are_nan_or_missing(tmp_path):
    # issue 29 item 2: `gdpo-ray train` died on a step whose metrics were NaN (int(NaN) for the
    # rollout actors' count). A step with NaN and missing (None) values is logged as it is: NaN
    # in metrics.jsonl, left out of TensorBoard, and the next step runs
    from gdpo_ray.run.loggers import RunLog
    from gdpo_ray.run.outputs import read_metrics
    from gdpo_ray.run.train import StopSignals, TrainingRun

    class Algo:  # what the command's loop reads of a GDPO algorithm
        reward_names, counters, policy_version = ["a"], {"learner_recoveries": 0}, 0

        def train(self):
            self.policy_version += 1
            return {"step": float(self.policy_version), "rewards": {"a": {"mean": float("nan")}},
                    "rollout": {"actors": float("nan"), "nodes": None}, "learner": {"lr": None}}

    run = TrainingRun(None, {"steps": 2, "output_dir": str(tmp_path), "name": "x"}, "demo")
    log = RunLog(tmp_path / "x")
    run._loop(Algo(), log, StopSignals())
    log.close()
    rows = read_metrics(tmp_path / "x" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isnan(r["rewards/a/mean"]) and math.isnan(r["rollout/actors"]) for r in rows)
    assert not any("rollout/nodes" in r or "learner/lr" in r for r in rows)
