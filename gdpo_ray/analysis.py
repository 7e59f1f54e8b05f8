"""The paper's Fig. 3 experiment: how many distinct advantage groups each method can produce.

For K binary rewards and G rollouts, every possible group is a multiset of G reward vectors drawn
from {0, 1}^K. Each group is normalized by a method exactly (eps = 0, batch normalization
skipped, as in the paper's figure); two groups coincide when their sorted advantage vectors are
equal after rounding to 6 decimals.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from gdpo_ray.advantages import ESTIMATORS, compute_advantage_details

#: Groups one request may enumerate (all methods together stay within about a minute).
MAX_GROUPS = 3_000_000


@dataclass(frozen=True)
class DistinctCount:
    method: str
    rewards: int  # K
    rollouts: int  # G
    distinct: int  # distinct advantage groups
    groups: int  # groups enumerated: C(2^K + G - 1, G)


def num_groups(rewards: int, rollouts: int) -> int:
    """Multisets of ``rollouts`` vectors from {0,1}^rewards: C(2^K + G - 1, G)."""
    return math.comb(2**rewards + rollouts - 1, rollouts)


def all_groups(rewards: int, rollouts: int) -> np.ndarray:
    """[M * G, K] float64 rewards: every multiset of G binary reward vectors, group by group."""
    vectors = (np.arange(2**rewards)[:, None] >> np.arange(rewards)[::-1]) & 1  # [2^K, K]
    m = num_groups(rewards, rollouts)
    picks = np.fromiter(
        itertools.chain.from_iterable(
            itertools.combinations_with_replacement(range(2**rewards), rollouts)
        ),
        dtype=np.int32,
        count=m * rollouts,
    )
    return vectors[picks].astype(np.float64)


def count_distinct(advantages: np.ndarray, rollouts: int) -> int:
    """Distinct rows of the [M, G] advantage groups, sorted and rounded to 6 decimals."""
    rows = np.sort(advantages.reshape(-1, rollouts), axis=1)
    rows = np.round(rows, 6) + 0.0  # + 0.0 turns -0.0 into 0.0
    return len(np.unique(rows, axis=0))


def check_request(rewards: list[int], rollouts: list[int], methods: list[str]) -> None:
    """Raises ValueError for a request that cannot run, or would take more than about a minute."""
    for name in methods:
        ESTIMATORS.get(name)
    if not rewards or min(rewards) < 1:
        raise ValueError(f"--rewards must be >= 1; got {rewards}")
    if not rollouts or min(rollouts) < 2:
        raise ValueError(f"--rollouts must be >= 2 (a group needs two rollouts); got {rollouts}")
    total = sum(num_groups(k, g) for k in rewards for g in rollouts)
    if total > MAX_GROUPS:
        worst = max(((k, g) for k in rewards for g in rollouts), key=lambda kg: num_groups(*kg))
        raise ValueError(
            f"this request enumerates {total:,} groups (K={worst[0]}, G={worst[1]} alone needs "
            f"C({2 ** worst[0] + worst[1] - 1}, {worst[1]}) = {num_groups(*worst):,}); the limit "
            f"is {MAX_GROUPS:,} (about a minute). Use fewer rewards or rollouts."
        )


def distinct_groups(
    rewards: list[int], rollouts: list[int], methods: list[str]
) -> list[DistinctCount]:
    """Counts for every (K, G) of the cross product and every method."""
    check_request(rewards, rollouts, methods)
    counts = []
    for k in rewards:
        for g in rollouts:
            table = all_groups(k, g)
            index = np.repeat(np.arange(len(table) // g), g)
            for name in methods:
                details = compute_advantage_details(table, index, estimator=name, eps=0.0)
                counts.append(
                    DistinctCount(name, k, g, count_distinct(details.summed, g), len(index) // g)
                )
    return counts


def plot(counts: list[DistinctCount], path: str) -> None:
    """Counts against G (or against K when only K varies), one line per method (and K)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({c.rewards for c in counts})
    gs = sorted({c.rollouts for c in counts})
    along_k = len(gs) == 1 and len(ks) > 1
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    series: dict[str, list[tuple[int, int]]] = {}
    for c in counts:
        label = c.method if along_k or len(ks) == 1 else f"{c.method} (K={c.rewards})"
        series.setdefault(label, []).append((c.rewards if along_k else c.rollouts, c.distinct))
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    if along_k:
        ax.set_xlabel("number of rewards K")
        ax.set_title(f"Distinct advantage groups, G = {gs[0]} rollouts")
    else:
        ax.set_xlabel("number of rollouts G")
        title = f"K = {ks[0]} binary rewards" if len(ks) == 1 else "binary rewards"
        ax.set_title(f"Distinct advantage groups, {title}")
    ax.set_ylabel("distinct advantage groups")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
