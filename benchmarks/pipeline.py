"""The whole pipeline on the demo setting: how much of a step is the framework's own overhead,
and how much overlap (max_staleness = 1) buys over the synchronous mode.

Two runs of the demo (tiny warm-started model, hf engine, one rollout actor, one DeepSpeed
learner, local Ray), the same seeds and resources, one after the other:

- ``framework_overhead``: in synchronous mode (max_staleness = 0), the share of step wall time
  (``algo.train()``) outside generation, reward scoring (both measured inside the rollout actor)
  and the learner's forward/backward/step (measured inside the learner). What is left is ours:
  orchestration, the object store, advantages, weight sync, metrics, RLlib's wrapper. Aim < 5%.
- ``hosted_framework_overhead``: the same, synchronous with the engine inside the learner
  (``generation.engine_in_learner``: no rollout actor process, no push); ``hosted_over_sync``:
  its step time over the synchronous one's.
- ``async_speedup``: groups/s with max_staleness = 1 over max_staleness = 0;
  ``async_efficiency``: that speedup over the ideal (gen + train) / max(gen, train), with gen and
  train the synchronous run's per-step generation+scoring and learner times. Aim >= 0.8.

    python benchmarks/pipeline.py [--json] [--steps 8] [--warmup 2] [--groups 16] [--group-size 8] [--smoke]

``--smoke``: one step of 2 groups of 2 in each mode, no warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402


def run(staleness: int, steps: int, warmup: int, groups: int, group_size: int, hosted: bool = False) -> dict:
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    config = apply_sections(GDPOConfig(), load_preset("demo", [
        f"training.max_staleness={staleness}", f"training.prompts_per_step={groups}",
        f"training.group_size={group_size}", f"generation.engine_in_learner={str(hosted).lower()}"]))
    algo = config.build_algo()
    try:
        for _ in range(warmup):
            algo.train()
        walls, results = [], []
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            results.append(algo.train())
            walls.append(time.perf_counter() - t)
        total = time.perf_counter() - start
    finally:
        algo.stop()
    gen = np.array([r["rollout/generate_s"] + r["rollout/score_s"] for r in results])
    train = np.array([r["learner/compute_s"] for r in results])
    return {"wall": np.array(walls), "total": total, "gen": gen, "train": train,
            "groups_per_s": steps * groups / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    args = parse_args(parser, {"steps": 1, "warmup": 0, "groups": 2, "group_size": 2})

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "TRANSFORMERS_VERBOSITY": "error"}})
    try:
        sync = run(0, args.steps, args.warmup, args.groups, args.group_size)
        overlap = run(1, args.steps, args.warmup, args.groups, args.group_size)
        hosted = run(0, args.steps, args.warmup, args.groups, args.group_size, hosted=True)
    finally:
        ray.shutdown()

    def overhead_of(r: dict) -> float:
        return float(np.sum(r["wall"] - r["gen"] - r["train"]) / np.sum(r["wall"]))

    overhead = overhead_of(sync)
    gen, train = float(sync["gen"].mean()), float(sync["train"].mean())
    ideal = (gen + train) / max(gen, train)
    speedup = overlap["groups_per_s"] / sync["groups_per_s"]
    out = {
        "framework_overhead": round(overhead, 4),
        "hosted_framework_overhead": round(overhead_of(hosted), 4),
        "hosted_over_sync": round(float(hosted["wall"].mean() / sync["wall"].mean()), 3),
        "hosted_step_s": round(float(hosted["wall"].mean()), 4),
        "async_speedup": round(speedup, 3),
        "async_ideal_speedup": round(ideal, 3),
        "async_efficiency": round(speedup / ideal, 3),
        "sync_step_s": round(float(sync["wall"].mean()), 4),
        "sync_generate_score_s": round(gen, 4),
        "sync_learner_compute_s": round(train, 4),
        "async_step_s": round(float(overlap["wall"].mean()), 4),
        "groups_per_s_sync": round(sync["groups_per_s"], 3),
        "groups_per_s_async": round(overlap["groups_per_s"], 3),
        "steps": args.steps, "groups": args.groups, "group_size": args.group_size, "smoke": args.smoke,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"synchronous step {out['sync_step_s']:.3f} s: generation+scoring {gen:.3f} s, learner "
          f"compute {train:.3f} s -> framework overhead {overhead:.1%} (aim < 5%); with the engine in the "
          f"learner: step {out['hosted_step_s']:.3f} s ({out['hosted_over_sync']:.2f}x), overhead "
          f"{out['hosted_framework_overhead']:.1%}")
    print(f"max_staleness=1: {out['groups_per_s_async']:.2f} groups/s vs {out['groups_per_s_sync']:.2f} "
          f"synchronous = {speedup:.2f}x; ideal {ideal:.2f}x -> efficiency {speedup / ideal:.2f} (aim >= 0.8)")


if __name__ == "__main__":
    main()
