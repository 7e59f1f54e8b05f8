"""Comparing training methods over seeds, as the paper's figures and tables do.

- ``band``: per step, the median and the interquartile range (25th to 75th percentile) of a
  metric over seeds (NaN where a seed has no value is left out);
- ``sign_test``: the exact two-sided sign test over paired seeds (the same seed for both methods):
  each seed is a win, a loss or a tie for the first method; ties are dropped, and under the null
  hypothesis (neither method better) the wins of n = wins + losses are Binomial(n, 1/2), so
  p = min(1, 2 * P(X <= min(wins, losses))). Five seeds can reach p = 0.0625 at best: it says
  how far a miniature can speak, not more;
- ``plot_bands``: one panel per metric, one line per method with its shaded band;
- ``pareto_front``: the points no other point dominates (two objectives or more), for the
  trade-off of two reward columns across runs and checkpoints (``gdpo-ray plot --pareto``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def band(curves: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(median, 25th percentile, 75th percentile) per step of ``curves`` ([seeds][steps];
    shorter curves are padded with NaN)."""
    width = max((len(c) for c in curves), default=0)
    values = np.full((len(curves), width), np.nan)
    for i, c in enumerate(curves):
        values[i, :len(c)] = np.asarray(c, dtype=float)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a step no seed reached: NaN
            q1, median, q3 = np.nanpercentile(values, [25, 50, 75], axis=0) if width else (np.zeros(0),) * 3
    return median, q1, q3


def sign_test(ours: Sequence[float], theirs: Sequence[float], higher_is_better: bool = True) -> dict:
    """Paired seeds: ``{"wins", "losses", "ties", "p"}`` for ``ours`` against ``theirs``.
    A pair with a NaN counts as a tie (no evidence either way)."""
    if len(ours) != len(theirs):
        raise ValueError(f"sign_test pairs seeds: got {len(ours)} and {len(theirs)} values")
    wins = losses = ties = 0
    for a, b in zip(ours, theirs):
        a, b = float(a), float(b)
        if math.isnan(a) or math.isnan(b) or a == b:
            ties += 1
        elif (a > b) == higher_is_better:
            wins += 1
        else:
            losses += 1
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1))
    return {"wins": wins, "losses": losses, "ties": ties, "p": min(1.0, 2 * tail / 2 ** n) if n else 1.0}


def plot_bands(curves: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], metrics: Sequence[str],
               titles: Mapping[str, str], png: str | Path, title: str = "") -> Path:
    """``curves``: method -> metric -> [seeds][steps]. One panel per metric: each method's
    median over seeds, its interquartile range shaded (the paper's Fig. 4 and 5 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for method, by_metric in curves.items():
            median, q1, q3 = band(by_metric.get(metric, []))
            steps = np.arange(1, len(median) + 1)
            line, = ax.plot(steps, median, label=method, linewidth=1.6)
            ax.fill_between(steps, q1, q3, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(titles.get(metric, metric), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, png, dpi=110)


def save_figure(fig, png: str | Path, dpi: int = 100) -> Path:
    """``fig`` laid out and written to ``png`` (its folder made), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png


#: points compared at once by ``pareto_front`` (a block of them against all: memory block * n * d)
_BLOCK = 1024


def pareto_front(points: Sequence[Sequence[float]], maximize: Sequence[bool] = (True, True)) -> list[int]:
    """The indices, in order, of the non-dominated ``points`` ([n][d], one value per objective;
    ``maximize[k]``: higher is better on objective k, else lower, e.g. a length).

    p dominates q when p is at least as good as q on every objective and strictly better on one.
    Degenerate cases: equal points do not dominate each other (duplicates are all on the front, or
    all off it); a tie on one objective is settled by the others ((1, 3) dominates (1, 2) when both
    are maximized); a point with a NaN value is left out: never on the front and dominating nothing
    (the caller says so: ``incomplete``); +-inf compare as numbers; no points: []. Vectorized by
    blocks of points, each against all (O(n^2 d) comparisons)."""
    d = len(maximize)
    values = np.asarray(points, dtype=float)
    if values.size == 0:
        return []
    if values.ndim != 2 or values.shape[1] != d:
        raise ValueError(f"pareto_front takes [n][{d}] points (one value per objective of maximize="
                         f"{tuple(maximize)}); got shape {values.shape}")
    signed = np.where(np.asarray(maximize, dtype=bool), values, -values)  # higher is better on every axis
    kept = ~np.isnan(signed).any(axis=1)
    pool = signed[kept]
    front = []
    for start in range(0, len(signed), _BLOCK):
        block = signed[start:start + _BLOCK, None, :]  # (b, 1, d) against the pool's (m, d)
        dominated = ((pool >= block).all(axis=2) & (pool > block).any(axis=2)).any(axis=1)
        front += [start + i for i in np.flatnonzero(~dominated & kept[start:start + _BLOCK])]
    return [int(i) for i in front]


def incomplete(points: Sequence[Sequence[float]]) -> list[int]:
    """The indices of the points with a NaN value (``pareto_front`` leaves them out)."""
    return [i for i, p in enumerate(points) if any(math.isnan(float(v)) for v in p)]
