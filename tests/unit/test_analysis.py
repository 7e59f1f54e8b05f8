"""The distinct-advantage-groups analysis (the paper's Fig. 3) and its command line."""

import json

import numpy as np
import pytest

from gdpo_ray import analysis
from gdpo_ray.run.cli import main, parse_int_range


def test_enumeration_is_every_multiset():
    # K = 1, G = 2: {(0,0), (0,1), (1,1)}
    table = analysis.all_groups(1, 2)
    assert table.reshape(-1, 2).tolist() == [[0, 0], [0, 1], [1, 1]]
    for k, g in [(2, 3), (3, 4), (2, 11)]:
        assert len(analysis.all_groups(k, g)) == g * analysis.num_groups(k, g)
    assert analysis.num_groups(2, 11) == 364  # C(4 + 11 - 1, 11)
    assert analysis.num_groups(5, 4) == 52_360  # C(32 + 4 - 1, 4)


def test_counts_two_rewards_two_rollouts_by_hand():
    # G = 2, K = 2. GRPO: equal totals -> (0, 0), unequal -> (-0.7071, 0.7071): 2 groups.
    # GRPO w/o std: total gaps 0, 1, 2 -> (0, 0), (-0.5, 0.5), (-1, 1): 3 groups.
    # GDPO: each reward either constant (0) or (-0.7071, 0.7071); both varying in the same
    # direction gives (-1.4142, 1.4142), in opposite directions (0, 0): 3 groups.
    counts = {c.method: c.distinct for c in analysis.distinct_groups([2], [2], ["gdpo", "grpo", "grpo_no_std"])}
    assert counts == {"gdpo": 3, "grpo": 2, "grpo_no_std": 3}


def test_gdpo_keeps_more_distinct_groups_as_in_fig3():
    counts = analysis.distinct_groups([2], list(range(4, 12)), ["gdpo", "grpo", "grpo_no_std"])
    by = {(c.method, c.rollouts): c.distinct for c in counts}
    for g in range(4, 12):
        assert by["gdpo", g] > by["grpo_no_std", g] > by["grpo", g]
    # and the gap widens with G
    gaps = [by["gdpo", g] - by["grpo", g] for g in range(4, 12)]
    assert gaps == sorted(gaps)


def test_count_distinct_rounds_and_merges_negative_zero():
    adv = np.array([[0.0, -0.0], [-0.0, 0.0], [0.1234561, -0.1234561], [-0.1234559, 0.1234559]])
    assert analysis.count_distinct(adv, 2) == 2


def test_too_large_request_is_refused_with_its_count():
    with pytest.raises(ValueError, match=r"C\(271, 16\) = 25,751,746,463,640,423,324,267,024"):
        analysis.check_request([8], [16], ["gdpo"])
    with pytest.raises(ValueError, match="unknown advantage estimator 'gpo'"):
        analysis.check_request([2], [4], ["gpo"])


def test_parse_int_range():
    assert parse_int_range("4") == [4]
    assert parse_int_range("2-6") == [2, 3, 4, 5, 6]
    assert parse_int_range("2,4-5") == [2, 4, 5]


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "fig3.png"
    rc = main(["analyze", "distinct-groups", "--rewards", "2-3", "--rollouts", "4",
               "--methods", "gdpo,grpo", "--json", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"counts": [
        {"method": "gdpo", "rewards": 2, "rollouts": 4, "distinct": 14},
        {"method": "grpo", "rewards": 2, "rollouts": 4, "distinct": 7},
        {"method": "gdpo", "rewards": 3, "rollouts": 4, "distinct": 45},
        {"method": "grpo", "rewards": 3, "rollouts": 4, "distinct": 14},
    ]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_up_front(capsys):
    assert main(["analyze", "distinct-groups", "--rewards", "6", "--rollouts", "16"]) == 2
    assert "groups" in capsys.readouterr().err
