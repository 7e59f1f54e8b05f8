"""Weights out: a ~100M-parameter model from a DeepSpeed learner to 1 and 2 rollout actors.

The push (``LearnerGroup.push_weights``: buckets of the learner's parameters written once into
Ray's object store, read zero-copy by every actor and copied into its engine) is timed until the
actors report the new version, against one plain memory copy of the model's bytes. Keys
(``--json``): ratio_to_memcpy_1 (aim <= 3), ratio_to_memcpy_2, and two_over_one (aim < 1.5);
the same with the prefix ``broadcast_`` for the collective path (``broadcast_weights``: gloo). One untimed push first warms
the object store's memory.

    python benchmarks/weight_sync.py [--json] [--layers 20] [--hidden 768] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout import RolloutGroup
    from gdpo_ray.tiny_model import build_tiny_model
    from learners.deepspeed_learner import LearnerConfig, LearnerGroup

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, layers=args.layers))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        learners = LearnerGroup(LearnerConfig(model_path=model, zero_stage=2), num_learners=1)
        params = sum(v.size for v in learners.call("get_weights")[0].values())
        model_bytes = params * 4
        source = np.ones(model_bytes, np.uint8)
        target = np.empty_like(source)
        results: dict[str, float] = {"params_m": params / 1e6, "model_mb": model_bytes / 1e6}
        version = 0
        for n in (1, 2):
            rollouts = RolloutGroup(dict(model_path=model, group_size=2,
                                         rewards=[{"name": "l", "fn": "length"}]),
                                    n, PromptSource([{"prompt": "hi"}]), ArrowBuffer(groups_per_step=1))
            ray.get([s.starting for s in rollouts.slots])
            for method, prefix in ((learners.push_weights, ""), (learners.broadcast_weights, "broadcast_")):
                version += 1
                method(rollouts, version, bucket_bytes=args.bucket_mb << 20)  # warm-up
                push, copy = [], []
                for _ in range(args.repeats):
                    version += 1
                    start = time.perf_counter()
                    method(rollouts, version, bucket_bytes=args.bucket_mb << 20)
                    assert ray.get([s.handle.policy_version.remote() for s in rollouts.slots]) == [version] * n
                    push.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    np.copyto(target, source)
                    copy.append(time.perf_counter() - start)
                results[f"{prefix}push_s_{n}"] = min(push)
                results[f"{prefix}memcpy_s_{n}"] = min(copy)
                results[f"{prefix}ratio_to_memcpy_{n}"] = min(push) / min(copy)
            rollouts.shutdown()
        learners.shutdown()
        ray.shutdown()
    results["two_over_one"] = results["push_s_2"] / results["push_s_1"]
    results["broadcast_two_over_one"] = results["broadcast_push_s_2"] / results["broadcast_push_s_1"]
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in results.items()}))
        return
    print(f"Push of a {results['params_m']:.0f}M-parameter model ({results['model_mb']:.0f} MB fp32), "
          f"best of {args.repeats}:")
    for prefix, label in (("", "object store"), ("broadcast_", "gloo broadcast")):
        for n in (1, 2):
            print(f"  {label:14s} {n} actor(s): {results[f'{prefix}push_s_{n}']:.3f} s = "
                  f"{results[f'{prefix}ratio_to_memcpy_{n}']:.1f}x one memcpy of the bytes "
                  f"({results[f'{prefix}memcpy_s_{n}']:.3f} s)")
        print(f"  {label:14s} 2 actors cost {results[f'{prefix}two_over_one']:.2f}x one actor (aim < 1.5)")


if __name__ == "__main__":
    main()
