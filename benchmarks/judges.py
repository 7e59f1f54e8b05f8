"""What judging costs a rollout actor's calls, overlapped with generation and not, through an
endpoint and through the pool gdpo-ray serves; and a judge actor's calls per second.

One rollout actor (a Ray actor, the hf engine, the demo's model, 1 thread) generates ``--calls``
calls of P prompts x G samples, scored by a regex reward and a two-criterion judge:

- sync: one call at a time (the next call starts when the last is scored, its judges included):
  every second of judging adds to the wall time;
- overlapped: two calls in flight (``generation.calls_per_actor`` 2, the default): a call's
  judges answer while the next call generates.

Each against the same without the judge. ``judge_overhead_sync`` and ``judge_overhead_overlapped``
are the wall times' ratios minus 1; ``hidden_fraction`` = 1 - (overlapped extra) / (sync extra):
the share of the judging time that overlap hides (aim >= 0.8 where the judge is faster than
generation; 1 is the limit). The endpoint is a real HTTP server in this process whose every
answer takes ``--endpoint-delay-ms`` (a judge model's latency, without its CPU: a judge on other
hardware); the pool is one judge actor running the demo's model on the hf engine (real compute,
on this machine's other core; its answers are not verdicts, so its criteria are NaN: the time is
what is measured). ``judge_calls_per_s_per_actor``: messages one pool actor answers per second,
``--judge-max-tokens`` each, in batches of ``judges.judge_batch_size``.

    python benchmarks/judges.py [--json] [--calls 8] [--prompts 8] [--group-size 8] [--max-tokens 96]
        [--policy tiny] [--endpoint-delay-ms 100] [--max-in-flight 64] [--judge-max-tokens 16] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._smoke import parse_args  # noqa: E402 - after the path above

CRITERIA = [{"name": "correct", "describe": "states the right sum", "scale": [0, 1]},
            {"name": "concise", "describe": "the number alone", "scale": [0, 1]}]


def walls(args, model: str, judge: dict | None, pool=None) -> dict[str, float]:
    """Wall seconds of ``args.calls`` calls, sync and overlapped, on a new rollout actor."""
    import ray

    from actors.prompts import PromptSource
    from actors.rollout import RolloutActor
    from gdpo_ray.tasks import addition

    rewards = [{"name": "digits", "fn": "regex", "params": {"pattern": r"\d"}}]
    if judge is not None:
        rewards.append({"name": "quality", "fn": "judge", "judge": judge, "criteria": CRITERIA})
    source = PromptSource(addition(4096, seed=3))
    actor = ray.remote(RolloutActor).options(num_cpus=1).remote(
        model, rewards, group_size=args.group_size, sampling={"max_tokens": args.max_tokens},
        judges=pool.handles if pool is not None else None, judge_batch_size=args.judge_batch_size)
    out, stats = {}, []
    try:
        ray.get(actor.generate.remote(source.take(args.prompts)))  # warm up
        for mode, in_flight in (("sync", 1), ("overlapped", 2)):
            start, pending = time.perf_counter(), []
            for _ in range(args.calls):
                pending.append(actor.generate.remote(source.take(args.prompts)))
                if len(pending) >= in_flight:
                    stats.append(ray.get(pending.pop(0))[0].judge)
            stats += [meta.judge for meta, _ in ray.get(pending)]
            out[mode] = time.perf_counter() - start
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    out["judge_calls"] = sum(s["calls"] for s in stats if s)
    return out


def pool_rate(args, pool) -> float:
    """Messages per second one judge actor answers (batches of ``judge_batch_size``)."""
    import ray

    from gdpo_ray.judges.rubric import expand_judges, rubric_of
    from gdpo_ray.judges.verdict import render

    entry = {"name": "q", "fn": "judge", "judge": {"model": "m"}, "criteria": CRITERIA}
    rubric = rubric_of(expand_judges([entry])[0]["params"])
    messages = [render(None, rubric.criteria, f"What is {i} + {i}?", f"<think>{i} and {i}</think> <answer>{2 * i}</answer>",
                       {}) for i in range(args.judge_batch_size * 4)]  # the judge's real messages
    handle = pool.handles[0]
    ray.get(handle.judge.remote(messages[:2], args.judge_max_tokens, 0.0))  # warm up
    start = time.perf_counter()
    ray.get([handle.judge.remote(messages[i:i + args.judge_batch_size], args.judge_max_tokens, 0.0)
             for i in range(0, len(messages), args.judge_batch_size)])
    return len(messages) / (time.perf_counter() - start)


def figures(base: dict, judged: dict, prefix: str) -> dict[str, float]:
    """``judge_overhead_*`` and ``hidden_fraction`` for the endpoint (prefix ``judge_``), ``pool_*``
    for the pool."""
    extra_sync, extra_overlapped = judged["sync"] - base["sync"], judged["overlapped"] - base["overlapped"]
    hidden = "hidden_fraction" if prefix == "judge_" else f"{prefix}hidden_fraction"
    return {f"{prefix}overhead_sync": judged["sync"] / base["sync"] - 1,
            f"{prefix}overhead_overlapped": judged["overlapped"] / base["overlapped"] - 1,
            hidden: 1 - extra_overlapped / extra_sync if extra_sync > 0 else float("nan"),
            f"{prefix}sync_s": judged["sync"], f"{prefix}overlapped_s": judged["overlapped"],
            f"{prefix}calls": judged["judge_calls"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calls", type=int, default=8, help="rollout calls per measurement")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--policy", default="tiny", help="the rollout model: tiny (random: every sample max-tokens long) or demo")
    parser.add_argument("--endpoint-delay-ms", type=float, default=100.0)
    parser.add_argument("--max-in-flight", type=int, default=64, help="the endpoint judge's requests open at once")
    parser.add_argument("--judge-max-tokens", type=int, default=16)
    parser.add_argument("--judge-batch-size", type=int, default=8)
    args = parse_args(parser, {"calls": 2, "prompts": 2, "group_size": 2, "max_tokens": 8,
                               "endpoint_delay_ms": 5.0, "judge_max_tokens": 4, "policy": "demo"})

    import ray

    from actors.judge_pool import JudgePool
    from gdpo_ray.models.demo import demo_model_dir
    from tests.judge_server import JudgeServer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = str(Path(__file__).resolve().parents[1])
    from gdpo_ray.model_files import resolve_model_path

    judge_model = str(demo_model_dir())
    model = str(resolve_model_path(args.policy))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "RAY_AUTH_MODE": "disabled"}})
    try:
        base = walls(args, model, None)
        with JudgeServer(delay_s=args.endpoint_delay_ms / 1000) as server:
            endpoint = walls(args, model, {"url": server.url, "model": "bench", "max_tokens": args.judge_max_tokens,
                                           "max_in_flight": args.max_in_flight})
        pool = JudgePool(judge_model, num_judges=1, num_cpus=1)
        try:
            served = walls(args, model, {"model": judge_model, "max_tokens": args.judge_max_tokens}, pool)
            rate = pool_rate(args, pool)
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
    calls_per_call = args.prompts * args.group_size
    results = {**figures(base, endpoint, "judge_"), **figures(base, served, "pool_"),
               "judge_calls_per_s_per_actor": rate,
               "generation_s_per_call": base["sync"] / args.calls,
               "endpoint_judge_s_per_call": (endpoint["sync"] - base["sync"]) / args.calls,
               "rollouts_per_call": calls_per_call}
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in results.items()} | {"smoke": args.smoke}))
        return
    print(f"{args.calls} calls of {args.prompts} prompts x {args.group_size} samples, up to {args.max_tokens} tokens; "
          f"without a judge: sync {base['sync']:.2f} s, overlapped {base['overlapped']:.2f} s")
    for name, prefix in (("endpoint", "judge_"), ("pool", "pool_")):
        print(f"  {name:8s} sync {results[prefix + 'sync_s']:.2f} s (+{results[prefix + 'overhead_sync']:.0%})  "
              f"overlapped {results[prefix + 'overlapped_s']:.2f} s (+{results[prefix + 'overhead_overlapped']:.0%})  "
              f"hidden {results['hidden_fraction' if prefix == 'judge_' else 'pool_hidden_fraction']:.2f}")
    print(f"  one judge actor: {rate:.1f} messages/s")


if __name__ == "__main__":
    main()
