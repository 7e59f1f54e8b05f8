"""GDPO against GRPO on the CPU demo: the paper's claim, small. Same preset, same seeds, same
resources; only ``training.estimator`` differs. The demo has three rewards of different
difficulty (format, correctness, a length limit paid only when correct), as the paper's math and
code settings do.

For each estimator and seed: the mean of every reward over the last ``--window`` steps, and the
number of distinct advantage groups per step (the paper's Fig. 3: GRPO maps different reward
combinations to the same advantages, GDPO keeps them apart). Printed: the mean over seeds, and
GDPO minus GRPO per reward with the number of seeds in which GDPO was ahead.

    python benchmarks/gdpo_vs_grpo.py [--json] [--seeds 0 1 2] [--steps 40] [--window 5]

Each run takes about a minute on 2 cores (the demo's 40 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ESTIMATORS = ("grpo", "gdpo")


def run(estimator: str, seed: int, steps: int, window: int) -> dict:
    from gdpo_ray.algorithm import GDPOConfig
    from gdpo_ray.config import apply_sections, load_preset

    config = apply_sections(GDPOConfig(), load_preset("demo", [
        f"training.estimator={estimator}", f"debugging.seed={seed}"]))
    algo = config.build_algo()
    rows = []
    try:
        for _ in range(steps):
            rows.append(algo.train())
        names = algo.reward_names
    finally:
        algo.stop()
    last = rows[-window:]
    out = {name: float(np.mean([r[f"rewards/{name}/mean"] for r in last])) for name in names}
    out["distinct_groups"] = float(np.mean([r["distinct_advantage_groups"] for r in rows]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    results = {e: [run(e, s, args.steps, args.window) for s in args.seeds] for e in ESTIMATORS}
    ray.shutdown()
    keys = list(results["gdpo"][0])
    mean = {e: {k: float(np.mean([r[k] for r in results[e]])) for k in keys} for e in ESTIMATORS}
    ahead = {k: int(sum(g[k] > r[k] for g, r in zip(results["gdpo"], results["grpo"]))) for k in keys}
    if args.json:
        print(json.dumps({f"{e}_{k}": round(mean[e][k], 4) for e in ESTIMATORS for k in keys}
                         | {f"gdpo_ahead_{k}": ahead[k] for k in keys} | {"seeds": len(args.seeds)}))
        return
    print(f"demo, {args.steps} steps, seeds {args.seeds}: reward means over the last "
          f"{args.window} steps (mean over seeds)")
    print(f"{'':16}{'grpo':>8}{'gdpo':>8}{'gdpo-grpo':>11}  gdpo ahead")
    for k in keys:
        print(f"{k:16}{mean['grpo'][k]:8.3f}{mean['gdpo'][k]:8.3f}"
              f"{mean['gdpo'][k] - mean['grpo'][k]:+11.3f}  {ahead[k]}/{len(args.seeds)} seeds")


if __name__ == "__main__":
    main()
