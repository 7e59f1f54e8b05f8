"""How fast is the GDPO advantage step, next to a per-group loop and to a plain memory copy?

Times `compute_advantages(estimator="gdpo")` on N = 8,192 and N = 1,048,576 rollouts (G = 16,
K = 4 float32 rewards, contiguous groups, as a training step hands them over) side by side with
  (a) a straightforward per-group Python loop (numpy per group and reward),
  (b) one copy of the reward matrix: the physical floor (the data must be read at least once),
  (c) for context, a vectorized torch version in the style of today's frameworks
      (reshape to [groups, G, K], mean/std over G, weighted sum, batch normalization).
Every timing is the best of several runs, measured in one process, interleaved.

    python benchmarks/advantages.py [--json] [--repeats 7] [--smoke]

``--smoke``: one repeat of each timing (the sizes stay: the 1M-row batch is what goes through
the chunked path, and it takes a second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._smoke import parse_args  # noqa: E402
from gdpo_ray.advantages import compute_advantages  # noqa: E402

G, K = 16, 4


def rewards_table(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    r = np.empty((n, K), np.float32)
    r[:, 0] = rng.integers(0, 2, n)  # format-like: binary
    r[:, 1] = rng.integers(0, 2, n) * (rng.random(n) < 0.3)  # correctness-like: rare
    r[:, 2] = rng.random(n) < 0.9  # length-like: easy
    r[:, 3] = rng.uniform(-3, 3, n)  # continuous (ToolRL correctness range)
    return r, np.repeat(np.arange(n // G), G)


def gdpo_loop(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """The straightforward way: one Python iteration per group and reward."""
    s = np.zeros(len(rewards))
    for label in np.unique(groups):
        rows = np.flatnonzero(groups == label)
        for k in range(rewards.shape[1]):
            v = rewards[rows, k].astype(np.float64)
            if v.max() != v.min():
                s[rows] += (v - v.mean()) / (v.std(ddof=1) + eps)
    return (s - s.mean()) / (s.std(ddof=1) + eps)


def gdpo_torch_style(rewards, eps: float = 1e-6):
    """Vectorized the usual way (no NaN handling, no exact zero-spread rule)."""
    v = rewards.view(-1, G, K)
    a = (v - v.mean(dim=1, keepdim=True)) / (v.std(dim=1, keepdim=True) + eps)
    s = a.sum(dim=-1).reshape(-1)
    return (s - s.mean()) / (s.std() + eps)


def best_of(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7)
    args = parse_args(parser, {"repeats": 1})

    import torch

    torch.set_num_threads(1)
    results: dict[str, float] = {}
    small_r, small_g = rewards_table(8_192)
    np.testing.assert_allclose(
        compute_advantages(small_r, small_g, estimator="gdpo"), gdpo_loop(small_r, small_g),
        rtol=1e-4, atol=1e-4,
    )
    t_loop = best_of(lambda: gdpo_loop(small_r, small_g), max(1, args.repeats // 3))
    t_small = best_of(lambda: compute_advantages(small_r, small_g, estimator="gdpo"), args.repeats)
    results["gdpo_ms_8192"] = t_small * 1e3
    results["loop_ms_8192"] = t_loop * 1e3
    results["speedup_vs_loop_8192"] = t_loop / t_small

    big_r, big_g = rewards_table(1_048_576)
    big_t = torch.from_numpy(big_r)
    t_copy = t_big = t_torch = float("inf")
    for _ in range(args.repeats):  # interleaved, so that machine noise hits all three alike
        t_copy = min(t_copy, best_of(lambda: big_r.copy(), 1))
        t_big = min(t_big, best_of(lambda: compute_advantages(big_r, big_g, estimator="gdpo"), 1))
        t_torch = min(t_torch, best_of(lambda: gdpo_torch_style(big_t), 1))
    results["gdpo_ms_1m"] = t_big * 1e3
    results["memcpy_ms_1m"] = t_copy * 1e3
    results["torch_style_ms_1m"] = t_torch * 1e3
    results["ratio_to_memcpy_1m"] = t_big / t_copy
    results["torch_style_ratio_to_memcpy_1m"] = t_torch / t_copy

    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in results.items()} | {"smoke": args.smoke}))
        return
    print(f"GDPO advantages, G = {G}, K = {K} float32 rewards, contiguous groups (best of runs)")
    print(f"  N = 8,192:     gdpo {t_small * 1e3:8.3f} ms   per-group loop {t_loop * 1e3:9.1f} ms"
          f"   -> {results['speedup_vs_loop_8192']:.0f}x faster than the loop")
    print(f"  N = 1,048,576: gdpo {t_big * 1e3:8.2f} ms   memcpy of rewards {t_copy * 1e3:6.2f} ms"
          f"   -> {results['ratio_to_memcpy_1m']:.1f}x the physical floor")
    print(f"                 torch-style vectorized {t_torch * 1e3:8.2f} ms"
          f"   -> {results['torch_style_ratio_to_memcpy_1m']:.1f}x the floor")


if __name__ == "__main__":
    main()
