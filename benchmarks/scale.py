"""The control plane as the run grows: N simulated rollout actors (``generation.engine:
simulated``) and N/4 simulated learners on one machine, everything else the real system
(docs/scale.md). Per N, steps of ``groups_per_actor x N`` groups of ``group_size`` responses
(lognormal lengths, mean 1,100 tokens: about 1.1M tokens a step at N = 64), one step of
staleness, the timing model of Llama-3.1-8B on H100s, every modelled second times
``time_scale``:

- ``driver_overhead_frac_N``: the driver's CPU time per step (its process: RLlib, the buffer,
  advantages, the push's calls, metrics) over the step's wall time (aim <= 0.03 at 64);
- ``async_efficiency_N``: the timing model's ideal step over the measured one: the same run
  with no framework overhead at all (``gdpo_ray.pipeline_model``: admission, continuous
  batching, updates, pushes, the long tail of the responses included), times ``time_scale``
  (aim >= 0.9 at 64);
- ``push_fanout_64_over_1``: the time from a push's start until every actor has loaded and
  attested it (``PushLedger.settle``), at 64 actors over 1 (aim <= 4), and the machine's CPU
  seconds meanwhile (``push_cpu_s``: each actor fetches and digests the payload, which a
  cluster does on 64 nodes at once and 2 cores do one after another); the pushes of these runs
  leave out the engines' modelled load pause (the same for 1 or 64, and the engine's own);
- ``group_latency_p95_s_N``: from a group's last token to the start of the update that trains
  it (its scoring, its way to the buffer, its wait there);
- ``object_store_peak_bytes_N``: the most the object store held, polled every 0.2 s;
- the rollout side's CPU per step (every other process of the machine), which on a cluster is
  each rollout node's own: on 2 cores it bounds what 64 actors can do here.

    python benchmarks/scale.py [--json] [--actors 1 4 16 64] [--steps 4] [--warmup 2]
                               [--groups-per-actor 2] [--group-size 8] [--time-scale 1.0]
                               [--plot scale.png] [--nodes] [--smoke]

``--nodes``: the same harness on a multi-node cluster started on this machine, 20 to 24 elastic
rollout actors, a rollout node lost mid-run and two added (``run_nodes``).

It ends with the model of a large run (``large_run``: Llama-3.1-8B on 256 H100s split between
rollout engines and learners; 16 GPUs under ``--smoke``), from the pipeline model and this run's
measured driver costs.

``--smoke``: 1 and 2 actors, one step each after none of warm-up, short responses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402

PROFILE = "llama3-8b-h100"
WEIGHT_BYTES = 64 << 20
MAX_TOKENS = 4096
NODES_GROW_S = 180.0  # how long --nodes trains on, at most, for the lost actors' replacements to be placed
SMOKE = {"actors": [1, 2], "steps": 1, "warmup": 0, "groups_per_actor": 1, "group_size": 2,
         "lengths": "{dist: uniform, low: 4, high: 32}", "time_scale": 0.05}


def overrides(actors: int, args: argparse.Namespace) -> list[str]:
    learners = learners_for(actors)
    return ["llm.model_path=tiny", "llm.max_prompt_tokens=256", "generation.engine=simulated",
            "learners.backend=simulated", f"training.prompts_per_step={args.groups_per_actor * actors}",
            f"training.group_size={args.group_size}", f"generation.max_tokens={MAX_TOKENS}", "training.max_staleness=1",
            f"env_runners.num_env_runners={actors}", "env_runners.num_cpus_per_env_runner=0.01",
            f"learners.num_learners={learners}", "learners.num_cpus_per_learner=0.01",
            "generation.reward_workers=1", f"simulation.time_scale={args.time_scale}",
            f"simulation.timing={{profile: {PROFILE}, load_bytes_per_s: 1.0e+15}}",
            f"simulation.weight_bytes={WEIGHT_BYTES}", f"simulation.response_lengths={args.lengths}"]


class StorePeak:
    """The object store's bytes in use, polled on a thread; ``peak`` the most seen."""

    def __init__(self, period_s: float = 0.2) -> None:
        import ray
        from ray._private.internal_api import node_stats

        self.nodes = [(n["NodeManagerAddress"], n["NodeManagerPort"]) for n in ray.nodes() if n["Alive"]]
        self._stats, self.peak, self.period_s = node_stats, 0, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                used = sum(self._stats(a, p, include_memory_info=False).store_stats.object_store_bytes_used
                           for a, p in self.nodes)
            except Exception:  # noqa: BLE001 - a node going away mid-poll
                continue
            self.peak = max(self.peak, used)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def other_cpu_s() -> float:
    """CPU seconds of every process on this machine but this one (the actors, Ray's daemons)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                continue
    return total / tick


def ideal_step_s(actors: int, args: argparse.Namespace, prompt_tokens: float, seeds: int = 3) -> float:
    """The timing model's ideal step of this run (``gdpo_ray.pipeline_model``: no framework
    overhead), in modelled seconds: the mean over ``seeds`` of 24 modelled updates' steady state."""
    from gdpo_ray.pipeline_model import pipeline, step_s
    from gdpo_ray.simulation import ResponseLengths, timing_model

    timing = timing_model({"profile": PROFILE, "load_bytes_per_s": 1.0e15})
    lengths = ResponseLengths.of(yaml_mapping(args.lengths))
    return float(np.mean([step_s(pipeline(timing, lengths, actors, learners_for(actors),
                                          args.groups_per_actor * actors, args.group_size, 1, 24, MAX_TOKENS,
                                          round(prompt_tokens), seed=seed)) for seed in range(seeds)]))


def yaml_mapping(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def learners_for(actors: int) -> int:
    return max(1, actors // 4)


def fanout(algo, pushes: int = 3) -> tuple[float, float]:
    """Median seconds from a push's start until every actor has loaded and attested it, and the
    median CPU seconds the whole machine spent meanwhile (the push's and the generation beside it)."""
    from gdpo_ray.run.transports import push_weights

    times, cpu = [], []
    for k in range(pushes):
        start, before = time.perf_counter(), other_cpu_s() + time.process_time()
        push_weights(algo.transport, algo.rollouts, algo.policy_version + 1 + k)
        algo.rollouts.ledger.settle()
        times.append(time.perf_counter() - start)
        cpu.append(other_cpu_s() + time.process_time() - before)
    return float(np.median(times)), float(np.median(cpu))


def run(actors: int, args: argparse.Namespace) -> dict:
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    started = time.perf_counter()
    algo = apply_sections(GDPOConfig(), load_preset("demo", overrides(actors, args))).build_algo()
    built = time.perf_counter() - started
    try:
        for _ in range(args.warmup):
            algo.train()
        store, rows = StorePeak(), []
        for _ in range(args.steps):
            cpu, others, wall = time.process_time(), other_cpu_s(), time.perf_counter()
            result = algo.train()
            wall = time.perf_counter() - wall
            rows.append(dict(wall_s=wall, driver_cpu_s=time.process_time() - cpu, others_cpu_s=other_cpu_s() - others,
                             tokens=result["tokens"], learner_tokens=result["learner/tokens"],
                             rollouts=result["groups"] * args.group_size,
                             latency_p95_s=result["timing/group_latency_p95_s"],
                             staleness_mean=result["staleness/mean"], staleness_max=result["staleness/max"]))
        peak = store.stop()
        push_s, push_cpu_s = fanout(algo)
    finally:
        algo.stop()
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    # rank 0's tokens are its share, 1/learners, of every prompt and response
    prompt_tokens = max(1.0, (mean["learner_tokens"] * learners_for(actors) - mean["tokens"]) / mean["rollouts"])
    mean["ideal_s"] = ideal_step_s(actors, args, prompt_tokens) * args.time_scale
    return {"actors": actors, "build_s": round(built, 1), "run_s": round(time.perf_counter() - started, 1),
            "step_wall_s": mean["wall_s"], "tokens_per_step": mean["tokens"],
            "driver_cpu_s_per_step": mean["driver_cpu_s"],
            "driver_overhead_frac": mean["driver_cpu_s"] / mean["wall_s"],
            "rollout_side_cpu_s_per_step": mean["others_cpu_s"],
            "ideal_step_s": mean["ideal_s"], "async_efficiency": mean["ideal_s"] / mean["wall_s"],
            "group_latency_p95_s": float(np.mean([r["latency_p95_s"] for r in rows])),
            "staleness_mean": mean["staleness_mean"], "staleness_max": max(r["staleness_max"] for r in rows),
            "push_fanout_s": push_s, "push_cpu_s": push_cpu_s, "object_store_peak_bytes": peak}


def run_nodes(args: argparse.Namespace) -> dict:
    """``--nodes``: rollout actors on rollout nodes of a multi-node cluster on this machine (a
    raylet each, with resources of its own; the driver and the learners on the head), elastic
    within ``[20, 24]``, one per unit of the nodes' ``rollout`` resource: 5 nodes of 4 hold 20.
    After the warm-up one node is removed (its raylet dies with its 4 actors: their groups are
    re-issued, and the 4 replacements wait for room while the 16 others go on), then two nodes
    join (the 4 replacements start there, and the group grows to 24 on 6 nodes). Every step must
    still train its B groups, and every prompt handed out must be trained, filtered or in flight:
    nothing lost."""
    import ray
    from ray.cluster_utils import Cluster

    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    env = {"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    rollout_nodes = [cluster.add_node(num_cpus=2, resources={"rollout": 4}) for _ in range(5)]
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
    groups = args.groups_per_actor * 20
    config = apply_sections(GDPOConfig(), load_preset("demo", overrides(20, args) + [
        "env_runners.num_env_runners=[20,24]", "env_runners.custom_resources_per_env_runner={rollout: 1}"]))
    algo = config.build_algo()
    steps = []
    try:
        for phase, then in (("20 actors on 5 nodes", lambda: cluster.remove_node(rollout_nodes[0], allow_graceful=False)),
                            ("a node lost", lambda: [cluster.add_node(num_cpus=2, resources={"rollout": 4})
                                                     for _ in range(2)]),
                            ("two nodes added", None)):
            deadline = time.monotonic() + NODES_GROW_S
            for k in itertools.count():
                r = algo.train()
                steps.append({k: r[k] for k in ("step", "groups", "rollout/actors", "rollout/nodes",
                                                 "rollout/reissued", "rollout/actor_restarts")} | {"phase": phase})
                if then is not None and k + 1 >= max(args.warmup, 2):
                    break
                if then is None and k >= 1 and (((r["rollout/actors"], r["rollout/nodes"]) == (24, 6)
                                                 and r["rollout/actor_restarts"] >= 4) or time.monotonic() > deadline):
                    break  # the lost node's 4 replaced and every actor placed (a new raylet starts its
                    # workers one or two at a time: on a busy machine that takes tens of seconds)
            if then is not None:
                then()
        p = algo.prompts
        outcomes = [o for e in range(p.epoch + 1) for o in p.outcomes(e).values()]
        accounted = p.in_flight == len(algo.buffer) + algo.rollouts.in_flight
        trained = outcomes.count("trained")
    finally:
        algo.stop()
        ray.shutdown()
        cluster.shutdown()
    every = all(s["groups"] == groups for s in steps)
    last = steps[-1]
    return {"steps": steps, "every_step_trained_B": every, "trained_groups": trained,
            "expected_trained": groups * len(steps), "prompts_accounted": accounted,
            "reissued": last["rollout/reissued"], "actor_restarts": last["rollout/actor_restarts"],
            "grown_to": [last["rollout/actors"], last["rollout/nodes"]],
            "nothing_lost": bool(accounted and every and trained == groups * len(steps)),
            "recovered": bool(accounted and every and trained == groups * len(steps)
                              and last["rollout/actor_restarts"] >= 4
                              and [last["rollout/actors"], last["rollout/nodes"]] == [24, 6])}


#: the modelled large run: B groups of G responses a step, prompts of this many tokens, responses
#: the default lognormal (median 800) capped at max_tokens; the rollout share of the GPUs per row
LARGE = {"groups": 512, "group_size": 16, "prompt_tokens": 128, "max_tokens": 8192}
ROLLOUT_SHARES = (0.5, 0.75, 0.875)


def large_run(results: list[dict], gpus: int, groups: int) -> list[dict]:
    """The model of a large run (docs/scale.md): Llama-3.1-8B on ``gpus`` H100s, split into
    rollout engines (a GPU each) and learner ranks, ``groups`` groups a step, max_staleness 0
    and 1. Per row: the pipeline model's ideal step (``gdpo_ray.pipeline_model``, the push's
    load pause of 16 GB at 20 GB/s included), the learners' share of it, and the framework's
    serial time per step: this run's measured driver CPU per step, extrapolated along a
    least-squares line in the number of rollout actors (assumed all on the critical path); the
    predicted step is their sum."""
    from gdpo_ray.pipeline_model import pipeline, step_s
    from gdpo_ray.simulation import ResponseLengths, timing_model

    timing, lengths = timing_model(PROFILE), ResponseLengths()
    n = np.array([r["actors"] for r in results], dtype=float)
    cpu = np.array([r["driver_cpu_s_per_step"] for r in results])
    slope, intercept = np.polyfit(n, cpu, 1) if len(set(n)) > 1 else (0.0, float(cpu[0]))
    mean_length = float(lengths.draw(np.random.default_rng(0), 200_000, LARGE["max_tokens"]).mean())
    tokens = groups * LARGE["group_size"] * (mean_length + LARGE["prompt_tokens"])
    rows = []
    for share in ROLLOUT_SHARES:
        engines = int(gpus * share)
        learners = gpus - engines
        for eta in (0, 1):
            ends = pipeline(timing, lengths, engines, learners, groups, LARGE["group_size"], eta, 8,
                            LARGE["max_tokens"], LARGE["prompt_tokens"])
            ideal = step_s(ends, warmup=3)
            framework = max(0.0, intercept + slope * engines)
            rows.append({"rollout_gpus": engines, "learner_gpus": learners, "max_staleness": eta,
                         "ideal_step_s": round(ideal, 2), "update_s": round(timing.update_s(tokens / learners), 2),
                         "framework_s": round(framework, 3), "predicted_step_s": round(ideal + framework, 2),
                         "framework_share": round(framework / (ideal + framework), 4)})
    return rows


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("driver_overhead_frac", "driver CPU / step wall"), ("async_efficiency", "ideal step / step"),
              ("push_fanout_s", "push fan-out (s)"), ("group_latency_p95_s", "group latency p95 (s)"),
              ("object_store_peak_bytes", "object store peak (bytes)"),
              ("rollout_side_cpu_s_per_step", "rollout side CPU per step (s)")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    n = [r["actors"] for r in results]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(n, [r[key] for r in results], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout actors")
    fig.suptitle(f"simulated {PROFILE}: the control plane against rollout actors")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--groups-per-actor", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lengths", default="{dist: lognormal, tokens: 800, sigma: 0.8}")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--plot", default="scale.png")
    parser.add_argument("--nodes", action="store_true", help="the multi-node run with a node lost and two added "
                        "(instead of the single-node sizes)")
    args = parse_args(parser, SMOKE)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.nodes:
        out = run_nodes(args) | {"smoke": args.smoke}
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    results = []
    for actors in args.actors:
        results.append(run(actors, args))
        if not args.json:
            print(json.dumps(results[-1]), flush=True)
    ray.shutdown()
    plot(results, args.plot)
    first, last = results[0], results[-1]
    out = {"runs": results, "push_fanout_last_over_first": last["push_fanout_s"] / first["push_fanout_s"],
           "smoke": args.smoke, "plot": args.plot}
    gpus = 16 if args.smoke else 256
    groups = LARGE["groups"] * gpus // 256
    out["large_run"] = dict(LARGE, gpus=gpus, groups=groups, rows=large_run(results, gpus, groups))
    for r in results:
        for key in ("driver_overhead_frac", "async_efficiency", "group_latency_p95_s", "object_store_peak_bytes"):
            out[f"{key}_{r['actors']}"] = r[key]
    if first["actors"] == 1 and last["actors"] == 64:
        out["push_fanout_64_over_1"] = out["push_fanout_last_over_first"]
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
