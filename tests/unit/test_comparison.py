"""Comparing methods over seeds (gdpo_ray.comparison): exact values with the arithmetic beside."""

import math

import numpy as np
import pytest

from gdpo_ray.comparison import band, plot_bands, sign_test


def test_the_sign_test_is_exact():
    # 5 wins of 5: P(X <= 0) = 1/32 under Binomial(5, 1/2); two-sided: 2/32 = 0.0625
    assert sign_test([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]) == {"wins": 5, "losses": 0, "ties": 0, "p": 0.0625}
    # 4 wins, 1 loss: P(X <= 1) = (1 + 5)/32; two-sided 12/32 = 0.375
    assert sign_test([1, 1, 1, 1, 0], [0, 0, 0, 0, 1])["p"] == 0.375
    # lower is better (exceed ratios): 0.1 < 0.2 is a win
    assert sign_test([0.1, 0.1], [0.2, 0.2], higher_is_better=False) == {"wins": 2, "losses": 0, "ties": 0, "p": 0.5}
    # ties and NaN pairs are dropped: 1 win, 0 losses of n = 1: p = min(1, 2 * 1/2) = 1
    assert sign_test([1, 2, math.nan], [0, 2, 1]) == {"wins": 1, "losses": 0, "ties": 2, "p": 1.0}
    # 10 wins of 10: 2 / 1024
    assert sign_test([1] * 10, [0] * 10)["p"] == pytest.approx(2 / 1024, abs=0)
    assert sign_test([], [])["p"] == 1.0
    with pytest.raises(ValueError, match="pairs seeds"):
        sign_test([1, 2], [1])


def test_band_is_the_median_and_interquartile_range_per_step():
    # three seeds: step 1 has 1, 3, 5 (median 3, quartiles 2 and 4 by linear interpolation)
    median, q1, q3 = band([[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(median, [3, 4])
    np.testing.assert_array_equal(q1, [2, 3])
    np.testing.assert_array_equal(q3, [4, 5])
    # a NaN (a step with no value in one seed) and a shorter curve are left out of that step
    median, q1, q3 = band([[1, math.nan, 7], [3, 4]])
    np.testing.assert_array_equal(median, [2, 4, 7])
    assert band([])[0].shape == (0,)


def test_plot_bands_writes_one_panel_per_metric(tmp_path):
    curves = {"gdpo": {"r": [[0, 1, 2], [1, 2, 3]]}, "grpo": {"r": [[0, 0, 1], [0, 1, 1]]}}
    png = plot_bands(curves, ["r"], {"r": "reward"}, tmp_path / "sub" / "study.png", "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
