"""Multi-turn tool rollouts against single-turn generation of the same length, and the engine's
idle time while tools run.

- ``multi_over_single`` (aim >= 0.85; 1.0 is the limit, where a tool turn costs what decoding its
  tokens would): tokens/s of multi-turn rollouts of the ``agent`` preset (``demo-agent`` in its
  calculator environment, the rollout loop of ``actors.tool_loop`` on the hf engine, G rollouts
  of P questions, every token of the trajectories counted: sampled and tool turns) over tokens/s
  of single-turn generation of the same number of rollouts, each as long as the multi-turn
  trajectories' mean, by the same architecture and tokenizer (the untrained model of the same
  recipe, which does not stop early), on the same prompts. Each round of the loop prefills what
  follows the KV the hf engine kept of each rollout's earlier turns (``actors/kv_store.py``) and
  waits for its longest turn: that is the gap to 1.0. ``prefill_saved`` is the share of the
  contexts' tokens whose prefill the kept KV saved.
- ``engine_idle_fraction`` (batched): the share of the loop's wall time in which the engine is not
  generating, with tools that take ``--tool-ms`` each (the calculator's tools, slowed down). On
  the batch engine a round's tools run after its generation, so the engine waits for them; the
  streaming engine hides them behind other rollouts' decoding (``tool_delay_hidden``, below).

Alternating repeats in one process, best of each. ``--engine vllm`` (in the vllm install set,
``.venv-vllm/bin/python benchmarks/agent.py --engine vllm``): vLLM's batched engine, whose
prefix cache serves a round's conversations without prefilling them again; and
``tool_delay_hidden``: the rollout actors themselves (Ray actors, vLLM, batched and streaming)
generate the same groups with instant tools and with ``--tool-ms`` tools; the extra wall time
the slow tools cost the streaming actor over the extra they cost the batched one, subtracted
from 1 (1: the tools are hidden behind other rollouts' decoding; 0: they cost what they cost
the batch engine, which waits for them).

    python benchmarks/agent.py [--json] [--engine hf|vllm] [--prompts 16] [--group-size 8] [--repeats 3] [--tool-ms 20]
        [--smoke]

``--smoke``: 2 questions x 2 rollouts of up to 32 tokens, 1 ms tools, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._smoke import parse_args  # noqa: E402 - after the path above
from gdpo_ray.environments.arithmetic import Arithmetic  # noqa: E402

SLOW = "benchmarks.agent:SlowArithmetic"


class SlowArithmetic:
    """The agent preset's calculator whose tools each take ``DELAY_S`` (``$SLOW_TOOL_MS``, read
    where the environment processes import the class); each tool keeps ``Arithmetic``'s
    docstring, which its schema is built from."""

    DELAY_S = float(__import__("os").environ.get("SLOW_TOOL_MS", 20)) / 1000

    def __init__(self) -> None:
        self.inner = Arithmetic()

    def reset(self, **row):
        return self.inner.reset(**row)

    def add(self, a: int, b: int) -> int:
        time.sleep(self.DELAY_S)
        return self.inner.add(a, b)

    def multiply(self, a: int, b: int) -> int:
        time.sleep(self.DELAY_S)
        return self.inner.multiply(a, b)

    add.__doc__, multiply.__doc__ = Arithmetic.add.__doc__, Arithmetic.multiply.__doc__


class TimedEngine:
    """An engine whose ``generate`` calls are timed (the rest of the loop's time is idle)."""

    def __init__(self, engine) -> None:
        self.engine, self.tokenizer, self.busy_s = engine, engine.tokenizer, 0.0
        self.traits = getattr(engine, "traits", None)  # kv_reuse: the engine keeps KV across turns

    def release(self, keys) -> None:
        self.engine.release(keys)

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


def rollouts(engine, tools, rows: list[dict], g: int, max_tokens: int) -> tuple[float, int, float]:
    """(wall seconds, trajectory tokens, engine busy seconds) of G multi-turn rollouts per row,
    through the rollout actors' turn loop and a batched round, on ``tools`` (an
    ``actors.tool_loop.ToolEnvironment``: its processes serve the next call, as in training)."""
    import asyncio

    from actors.engines import SamplingParams
    from actors.samplers import Round
    from actors.turn_loop import Rollout, TurnLoop

    timed = TimedEngine(engine)
    start = time.perf_counter()
    todo = [Rollout(k, dict(r), r["prompt"]) for k, r in enumerate(r for r in rows for _ in range(g))]
    loop = TurnLoop(Round(timed, len(todo)), engine.tokenizer, lambda p, schemas: _prompt(engine.tokenizer, p, schemas),
                    tools, SamplingParams(temperature=1.0, max_tokens=max_tokens))
    asyncio.run(loop.run(todo))
    wall = time.perf_counter() - start
    tools.release([r.trajectory for r in todo])
    return wall, sum(len(r.trajectory.tokens) for r in todo), timed.busy_s


def _prompt(tokenizer, messages, schemas) -> list[int]:
    from gdpo_ray.models.demo_agent import prompt_ids

    return prompt_ids(tokenizer, messages, schemas)


def single_turn(engine, prompts: list[list[int]], g: int, length: int) -> tuple[float, int]:
    from actors.engines import SamplingParams

    start = time.perf_counter()
    out = engine.generate(prompts, g, SamplingParams(temperature=1.0, max_tokens=length))
    return time.perf_counter() - start, sum(len(s.token_ids) for group in out for s in group)


def actor_walls(args, environment: str) -> dict[str, float]:
    """Best wall seconds of one ``generate`` call of the agent's groups on a batched and a
    streaming vLLM rollout actor with ``environment``."""
    import ray

    from actors.prompts import PromptSource
    from actors.rollout import RolloutActor
    from gdpo_ray.tasks import tool_arithmetic
    from gdpo_ray.models.demo_agent import agent_model_dir

    source = PromptSource(tool_arithmetic(args.prompts, seed=7))
    out = {}
    for mode in ("batched", "streaming"):
        extra = {"max_staleness": 1} if mode == "streaming" else {}
        actor = ray.remote(RolloutActor).options(num_cpus=1).remote(
            str(agent_model_dir()), rewards=[{"name": "short", "fn": "length", "params": {"limit": 64}}],
            group_size=args.group_size, engine="vllm", sampling={"temperature": 1.0, "max_tokens": args.max_tokens},
            engine_kwargs={"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}, max_prompt_tokens=512,
            environment=environment, max_turns=4, mode=mode, **extra)
        try:
            ray.get(actor.generate.remote(source.take(2)))  # warm up
            walls = []
            for _ in range(args.repeats):
                prompts = source.take(args.prompts)
                start = time.perf_counter()
                ray.get(actor.generate.remote(prompts))
                walls.append(time.perf_counter() - start)
            out[mode] = min(walls)
        finally:
            ray.get(actor.shutdown.remote())
            ray.kill(actor)
    return out


def tool_delay_hidden(args) -> dict[str, float]:
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = str(Path(__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": root, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SLOW_TOOL_MS": str(args.tool_ms)}})
    try:
        from gdpo_ray.models.demo_agent import ENVIRONMENT

        fast, slow = actor_walls(args, ENVIRONMENT), actor_walls(args, SLOW)
    finally:
        ray.shutdown()
    extra = {mode: slow[mode] - fast[mode] for mode in fast}
    return {"batched_wall_s": fast["batched"], "streaming_wall_s": fast["streaming"],
            "batched_tool_extra_s": extra["batched"], "streaming_tool_extra_s": extra["streaming"],
            "tool_delay_hidden": 1 - extra["streaming"] / extra["batched"] if extra["batched"] > 0 else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96, help="the agent preset's trajectory budget")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tool-ms", type=float, default=20.0)
    args = parse_args(parser, {"prompts": 2, "group_size": 2, "max_tokens": 32, "repeats": 1, "tool_ms": 1.0})

    import torch

    from actors.engines import make_engine
    from gdpo_ray.environments.spec import load_environment
    from gdpo_ray.tasks import tool_arithmetic
    from gdpo_ray.models.demo_agent import ENVIRONMENT, RECIPE, agent_model_dir, build_untrained

    torch.set_num_threads(1)
    os.environ["SLOW_TOOL_MS"] = str(args.tool_ms)  # read where the environment processes import the class
    rows = tool_arithmetic(args.prompts, seed=7)
    kwargs = ({"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "enable_prefix_caching": True}
              if args.engine == "vllm" else {})
    trained = make_engine(args.engine, str(agent_model_dir()), mode="batched", seed=0, **kwargs)
    untrained_dir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    build_untrained(untrained_dir, RECIPE)
    untrained = make_engine(args.engine, str(untrained_dir), mode="batched", seed=0, **kwargs)
    schemas = list(load_environment(ENVIRONMENT).schemas)
    prompts = [_prompt(untrained.tokenizer, r["prompt"], schemas) for r in rows]
    from actors.tool_loop import ToolEnvironment

    tools = {path: ToolEnvironment(path, trained.tokenizer, 4, 30.0) for path in (ENVIRONMENT, SLOW)}
    for environment in tools.values():  # warm up: the engines, and a process per rollout
        rollouts(trained, environment, rows, args.group_size, args.max_tokens)
    single_turn(untrained, prompts[:2], 2, 8)
    multi, single, idle, lengths, whole, saved = [], [], [], [], [], [0, 0]
    reuse = getattr(trained, "reuse_kv", None)  # the hf engine: its turns measured without kept KV too
    for _ in range(args.repeats):
        if reuse:
            trained.reuse_kv = False
            wall, tokens, _ = rollouts(trained, tools[ENVIRONMENT], rows, args.group_size, args.max_tokens)
            whole.append(tokens / wall)
            trained.reuse_kv = True
            before = (trained.kv.reused_tokens, trained.kv.prefilled_tokens)
        wall, tokens, _ = rollouts(trained, tools[ENVIRONMENT], rows, args.group_size, args.max_tokens)
        multi.append(tokens / wall)
        if reuse:
            saved[0] += trained.kv.reused_tokens - before[0]
            saved[1] += trained.kv.prefilled_tokens - before[1]
        length = max(1, round(tokens / (len(rows) * args.group_size)))
        lengths.append(length)
        wall_1, tokens_1 = single_turn(untrained, prompts, args.group_size, length)
        single.append(tokens_1 / wall_1)
        wall_s, _, busy = rollouts(trained, tools[SLOW], rows, args.group_size, args.max_tokens)
        idle.append(1 - busy / wall_s)
    for environment in tools.values():
        environment.close()
    out = {"multi_turn_tokens_per_s": max(multi), "single_turn_tokens_per_s": max(single),
           "multi_over_single": max(multi) / max(single), "mean_trajectory_tokens": float(sum(lengths) / len(lengths)),
           "engine_idle_fraction_batched": min(idle), "tool_ms": args.tool_ms,
           "engine": args.engine, "smoke": args.smoke}
    if reuse:  # kept KV against prefilling every turn's whole context, and the prefill it saved
        out |= {"kv_reuse_speedup": max(multi) / max(whole), "multi_over_single_no_kv_reuse": max(whole) / max(single),
                "prefill_saved": saved[0] / max(sum(saved), 1)}
    if args.engine == "vllm":
        out |= tool_delay_hidden(args)
    if args.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))
        return
    print(f"agent preset, {args.prompts} questions x {args.group_size} rollouts, {args.engine} engine, "
          f"best of {args.repeats}")
    print(f"multi-turn  {out['multi_turn_tokens_per_s']:8.0f} tokens/s (trajectories of {out['mean_trajectory_tokens']:.0f} tokens)")
    print(f"single-turn {out['single_turn_tokens_per_s']:8.0f} tokens/s (the same length)")
    print(f"multi_over_single {out['multi_over_single']:.3f} (aim >= 0.85; limit 1.0)")
    if "kv_reuse_speedup" in out:
        print(f"kept KV across turns: {out['kv_reuse_speedup']:.2f}x the multi-turn tokens/s of prefilling whole "
              f"contexts ({out['prefill_saved']:.2f} of the contexts' tokens not prefilled again)")
    print(f"engine idle with {args.tool_ms:g} ms tools (batched): {out['engine_idle_fraction_batched']:.3f}")
    if "tool_delay_hidden" in out:
        print(f"rollout actors, {args.tool_ms:g} ms tools: extra wall {out['batched_tool_extra_s']:.3f} s batched, "
              f"{out['streaming_tool_extra_s']:.3f} s streaming (instant tools: {out['batched_wall_s']:.3f} s, "
              f"{out['streaming_wall_s']:.3f} s); tool_delay_hidden {out['tool_delay_hidden']:.3f} (1: hidden)")


if __name__ == "__main__":
    main()
