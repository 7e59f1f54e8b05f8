"""GDPO against GRPO on the CPU demo: the paper's claim, small. Same preset, same seeds, same
resources; only ``training.estimator`` differs. The demo has three rewards of different
difficulty (format, correctness, a length limit paid only when correct), as the paper's math and
code settings do.

Judged as the paper judges: by evaluation of the final policy on held-out items, not by
training rewards. Each run trains on ``--train-sums`` of the 100 single-digit sums (the first of
its seed's order, ``data.num_prompts``); after ``--steps`` steps the policy is evaluated on the
other sums (``task:addition``, ``gdpo-ray eval``'s suite, on the run's rollout actors; the eval
leaves out every training prompt): ``--samples`` completions per sum at
the paper's eval sampling (``paper_``: temperature 0.6, top-p 0.95) and at the demo's training
temperature (``t1_``: 1.0, no top-p), avg@n of ``pass@1`` (the right sum),
``format_ratio`` and ``exceed_ratio`` (over the demo's 16-token limit). Also the number of distinct advantage groups per step (the paper's Fig. 3: GRPO
maps different reward combinations to the same advantages, GDPO keeps them apart). Printed: the
mean over seeds, GDPO minus GRPO, and the number of seeds in which GDPO was ahead (behind, for
exceed_ratio, where lower is better).

    python benchmarks/gdpo_vs_grpo.py [--json] [--seeds 0 1 2] [--steps 40] [--samples 8] [--train-sums 50]
        [--set KEY=VALUE ...] [--smoke]

Each run takes about a minute and a half on 2 cores (the demo's 40 steps and the eval).

``--preset agent``: the same comparison on the multi-turn ``agent`` preset (a calculator's tools,
three rewards: the turns' format, the environment's end state ``tool_success``, the answer):
trained on ``task:tool_arithmetic`` (seed 0), evaluated on the 128 held-out questions of its
suite (``EVAL_SEED``; any training question left out), generated through the same tool loop:
avg@n of ``accuracy``, ``format_ratio`` and ``tool_success``.

``--smoke``: seed 0, one step of 2 prompts x 2 per run, one sample on each of 4 held-out sums
(``--train-sums 96``); with ``--preset agent``, on the first 4 held-out questions.
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

from benchmarks._smoke import parse_args  # noqa: E402

SMOKE = {"seeds": [0], "steps": 1, "samples": 1, "train_sums": 96,
         "overrides": ["training.prompts_per_step=2", "training.group_size=2", "training.eval_limit=4"]}


def run(preset: str, estimator: str, seed: int, steps: int, samples: int, train_sums: int,
        overrides: list[str]) -> dict:
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    own = ([f"data.num_prompts={train_sums}", "training.eval_suite=task:addition"] if preset == "demo"
           else ["training.eval_suite=task:tool_arithmetic"])
    config = apply_sections(GDPOConfig(), load_preset(preset, [
        f"training.estimator={estimator}", f"debugging.seed={seed}", f"training.eval_samples={samples}", *own,
        *overrides]))
    algo = config.build_algo()
    rows = []
    try:
        for _ in range(steps):
            rows.append(algo.train())
        reports = {}
        for name, (temperature, top_p) in SAMPLINGS.items():
            reports[name] = algo.evaluate_policy(temperature=temperature, top_p=top_p)
    finally:
        algo.stop()
    out = {f"{name}_{m}": float(v) for name, report in reports.items() for m, v in report["overall"].items()}
    out["eval_items"] = float(reports["paper"]["counts"]["items"])
    out["distinct_groups"] = float(np.mean([r["distinct_advantage_groups"] for r in rows]))
    return out


#: the paper's eval sampling, and the demo's training sampling (the temperature its rewards saw)
SAMPLINGS = {"paper": (0.6, 0.95), "t1": (1.0, 1.0)}
LOWER_IS_BETTER = ("paper_exceed_ratio", "t1_exceed_ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--preset", choices=("demo", "agent"), default="demo")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--samples", type=int, default=8, help="eval completions per sum (n of avg@n)")
    parser.add_argument("--train-sums", type=int, default=50, help="sums trained on; the rest are held out")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset override for every run (repeatable), e.g. generation.max_tokens=32")
    args = parse_args(parser, SMOKE)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    from gdpo_ray.run.presets import load_preset

    args.steps = args.steps or load_preset(args.preset)["run"]["steps"]
    results = {e: [run(args.preset, e, s, args.steps, args.samples, args.train_sums, args.overrides)
                   for s in args.seeds] for e in ESTIMATORS}
    ray.shutdown()
    keys = list(results["gdpo"][0])
    mean = {e: {k: float(np.mean([r[k] for r in results[e]])) for k in keys} for e in ESTIMATORS}
    pairs = list(zip(results["gdpo"], results["grpo"]))
    ahead = {k: int(sum((g[k] < r[k]) if k in LOWER_IS_BETTER else (g[k] > r[k]) for g, r in pairs))
             for k in keys}
    tied = {k: int(sum(g[k] == r[k] for g, r in pairs)) for k in keys}
    if args.json:
        print(json.dumps({f"{e}_{k}": round(mean[e][k], 4) for e in ESTIMATORS for k in keys}
                         | {f"gdpo_ahead_{k}": ahead[k] for k in keys} | {f"tied_{k}": tied[k] for k in keys}
                         | {"seeds": len(args.seeds), "smoke": args.smoke}))
        return
    if args.preset == "demo":
        print(f"demo on {args.train_sums} sums, {args.steps} steps, seeds {args.seeds}: eval of the final "
              f"policy on the {100 - args.train_sums} held-out sums of task:addition, {args.samples} samples "
              f"per sum; paper_: temperature 0.6, top-p 0.95; t1_: temperature 1.0 (mean over seeds)")
    else:
        print(f"agent, {args.steps} steps, seeds {args.seeds}: eval of the final policy on the "
              f"{int(mean['gdpo']['eval_items'])} held-out questions of task:tool_arithmetic (multi-turn, "
              f"{args.samples} samples each); paper_: temperature 0.6, top-p 0.95; t1_: temperature 1.0 "
              f"(mean over seeds)")
    print(f"{'':20}{'grpo':>8}{'gdpo':>8}{'gdpo-grpo':>11}  seeds gdpo ahead / tied")
    for k in keys:
        print(f"{k:20}{mean['grpo'][k]:8.3f}{mean['gdpo'][k]:8.3f}"
              f"{mean['gdpo'][k] - mean['grpo'][k]:+11.3f}  {ahead[k]} / {tied[k]} of {len(args.seeds)}")

if __name__ == "__main__":
    main()
