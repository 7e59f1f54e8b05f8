"""The demo under each off-policy correction (``training.off_policy``) and under truncated
sampling: does it learn as it does with the default? Same preset, seed and resources; only the
option differs. Printed per option: each reward's mean over the first and the last three steps,
and the correction's own figures averaged over the run (``learner/is/*``: the ratio's extremes,
the weight, the share of tokens out of the loss).

    python benchmarks/off_policy.py [--json] [--steps 40] [--seed 0] [--only NAME ...] [--smoke]

Each run is the demo's (40 steps, ``max_staleness: 1``): about a minute and a half on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402

#: name -> overrides of the demo preset
OPTIONS = {
    "default": [],  # {level: token, mode: truncate, cap: 2}
    "none": ["training.off_policy=none"],
    "sequence_truncate": ["training.off_policy={level: sequence, mode: truncate, cap: 2}"],
    "product_truncate": ["training.off_policy={level: product, mode: truncate, cap: 2}"],
    "token_mask": ["training.off_policy={level: token, mode: mask, low: 0.5, high: 2}"],
    "sequence_mask": ["training.off_policy={level: sequence, mode: mask, low: 0.5, high: 2}"],
    "outlier": ["training.off_policy={mode: truncate, cap: 2, outlier_low: 0.1, outlier_high: 10}"],
    "top_p_truncated": ["generation.top_p=0.9"],
    "top_p_full": ["generation.top_p=0.9", "generation.truncated_logprobs=false"],
}
SMOKE = {"steps": 2, "only": ["default", "sequence_mask"],
         "overrides": ["training.prompts_per_step=2", "training.group_size=2"]}


def run(name: str, steps: int, seed: int, overrides: list[str]) -> dict:
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    config = apply_sections(GDPOConfig(), load_preset("demo", [f"debugging.seed={seed}", *OPTIONS[name],
                                                               *overrides]))
    algo = config.build_algo()
    rows = []
    try:
        for _ in range(steps):
            rows.append(algo.train())
    finally:
        algo.stop()
    rewards = sorted(k[len("rewards/"):-len("/mean")] for k in rows[0] if k.startswith("rewards/")
                     and k.endswith("/mean") and k.count("/") == 2)
    window = min(3, len(rows))
    out = {}
    for r in rewards:
        out[f"{r}_first"] = float(np.mean([row[f"rewards/{r}/mean"] for row in rows[:window]]))
        out[f"{r}_last"] = float(np.mean([row[f"rewards/{r}/mean"] for row in rows[-window:]]))
    for key in ("is/ratio_max", "is/ratio_min", "is/weight_mean", "is/masked_frac", "is/beyond_frac"):
        values = [row[f"learner/{key}"] for row in rows if f"learner/{key}" in row]
        if values:
            out[key.replace("/", "_")] = float(np.max(values) if key.endswith("max") else
                                                 np.min(values) if key.endswith("min") else np.mean(values))
    out["staleness_mean"] = float(np.mean([row["staleness/mean"] for row in rows]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of every run (e.g. training.max_staleness=2)")
    args = parse_args(parser, SMOKE, argv)
    results = {name: run(name, args.steps, args.seed, args.overrides) for name in args.only}
    if args.json:
        print(json.dumps({"runs": results, "steps": args.steps, "seed": args.seed, "smoke": args.smoke}))
        return
    for name, out in results.items():
        print(f"{name:<18} " + "  ".join(f"{k} {v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
