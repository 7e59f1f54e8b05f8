"""pass@k: the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models
Trained on Code", from n samples per item of which c are correct.

Per item, pass@k = 1 - C(n-c, k) / C(n, k): one minus the chance that k samples drawn without
replacement from the n are all wrong (1 when n - c < k: any k of them hold a correct one); a
suite's pass@k is the mean over its items. The ratio of binomials is computed as the product
C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), c factors each in [0, 1), so no binomial
is formed and nothing overflows. At k = 1 it is c/n, the avg@n mean of ``pass@1``.

A sample is correct when it scores 1 on its suite's correct metric (``Suite.correct_metric``:
``pass@1``, or ``accuracy`` where a suite has no ``pass@1``); samples the scorer could not score
(NaN) are not counted in n; an item with fewer than k scored samples has no pass@k (NaN).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one item of ``n`` samples, ``c`` of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0  # C(n-c, k) / C(n, k)
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over items, each given as (n, c)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    return sum(values) / len(values) if values else math.nan


def key(k: int) -> str:
    """The metric name of pass@k: ``pass@4``."""
    return f"pass@{k}"


def item_pass_at_k(samples: Sequence[Mapping[str, Any]], metric: str, ks: Sequence[int]) -> dict[str, float]:
    """An item's ``pass@k`` for every k of ``ks``, its samples judged by ``metric`` (correct:
    it scores 1; NaN: not counted); NaN for a k over its number of scored samples."""
    scored = [float(s[metric]) for s in samples if not math.isnan(float(s[metric]))]
    n, c = len(scored), sum(v == 1.0 for v in scored)
    return {key(k): pass_at_k(n, c, k) if k <= n else math.nan for k in ks}


def parse_ks(value: Any, where: str) -> tuple[int, ...]:
    """The ks of ``--pass-k 1,4,16`` (a comma-separated string) or of a list of integers,
    sorted, each once; a ValueError naming ``where`` for anything but integers >= 1."""
    text = isinstance(value, str)
    parts = [p.strip() for p in value.split(",")] if text else value
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"{where} must be a list of integers >= 1, e.g. 1,4,16; got {value!r}")
    ks = []
    for part in parts:
        k = int(part) if text and part.isdecimal() else part
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where} must be integers >= 1 (the k of pass@k), e.g. 1,4,16; got {part!r}")
        ks.append(k)
    return tuple(sorted(set(ks)))


def check_ks(ks: Sequence[int], n: int, where: str, n_where: str) -> None:
    """Every k is at most ``n`` samples per item (``n_where`` names the setting of n)."""
    over = [k for k in ks if k > n]
    if over:
        raise ValueError(f"{where} asks for pass@{over[0]} but {n_where} is {n}: pass@k needs at least k "
                         f"samples per item; raise {n_where} to {max(over)} or leave k <= {n} in {where}")
