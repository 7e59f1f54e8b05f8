"""The timing model of simulated runs (gdpo_ray.simulation), the simulated engines
(actors.sim_engine) and the simulated learner (learners.sim_learner), outside Ray."""

import asyncio
import dataclasses
import sys
import time

import numpy as np
import pytest

from actors.engines import SamplingParams, engine_class, engine_settings, traits_of
from gdpo_ray.simulation import PROFILES, ResponseLengths, TimingModel, timing_model

# step 1 s + 0.5 s a sequence; prompts prefilled at 10 tokens/s; two sequences at once
SMALL = TimingModel(step_s=1.0, step_s_per_seq=0.5, prefill_tokens_per_s=10.0, max_num_seqs=2,
                    train_tokens_per_s=100.0, weight_bytes=1000, load_bytes_per_s=1000.0)


def test_a_call_is_scheduled_as_continuous_batching_by_hand():
    # t=0: r0 prefilled (10 tokens: 1 s), r1 prefilled (1 s): t=2, both decode (2 a step: 2 s a step)
    # step 1 (t=4): r1 done (1 token); r2 admitted, prefilled: t=5; step 2 (t=7): r0 done (2 tokens)
    # r2 alone (1.5 s a step) for its last 2 tokens: t=10
    total, finish = SMALL.schedule([10, 10, 10], [2, 1, 3])
    assert total == pytest.approx(10.0) and finish == pytest.approx([7.0, 4.0, 10.0])
    # the second sample of a prompt shares its prefill: r1 decodes from t=1 (finishes at 1 + 2)
    total, finish = SMALL.schedule([10, 10], [2, 1], shared=[False, True])
    assert finish == pytest.approx([1 + 2 + 1.5, 3.0]) and total == pytest.approx(4.5)
    assert SMALL.schedule([], []) == (0.0, [])


def test_the_rates_of_the_model():
    assert SMALL.decode_step_s(4) == 3.0 and SMALL.prefill_s(25) == 2.5
    assert SMALL.update_s(300, epochs=2) == 6.0 and SMALL.load_s() == 1.0
    default = PROFILES["llama3-8b-h100"]
    assert default == TimingModel(name="llama3-8b-h100")
    # 256 sequences a step: 6.5 ms + 256 x 0.075 ms = 25.7 ms (the published TPOT at 256: 25.57 ms)
    assert default.decode_step_s(256) == pytest.approx(0.0257)


def test_timing_settings():
    assert timing_model(None) is PROFILES["llama3-8b-h100"] and timing_model("qwen3-0.6b-h100").step_s == 0.0024
    tuned = timing_model({"profile": "llama3-70b-h100x4", "max_num_seqs": 64})
    assert tuned.max_num_seqs == 64 and tuned.step_s == 0.020 and tuned.name == "llama3-70b-h100x4+max_num_seqs"
    assert timing_model({"step_s": 0.5}).step_s_per_seq == TimingModel().step_s_per_seq
    with pytest.raises(ValueError, match="'gpt5' is not a profile; known: llama3-8b-h100"):
        timing_model("gpt5")
    with pytest.raises(ValueError, match="has no field 'tpot'"):
        timing_model({"tpot": 0.01})
    with pytest.raises(ValueError, match="step_s must be a positive number"):
        timing_model({"step_s": 0})
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        timing_model({"max_num_seqs": 2.5})


def test_response_lengths():
    rng = np.random.default_rng(0)
    assert ResponseLengths.of({"dist": "fixed", "tokens": 7}).draw(rng, 3, 100).tolist() == [7, 7, 7]
    assert ResponseLengths.of({"dist": "fixed", "tokens": 700}).draw(rng, 2, 100).tolist() == [100, 100]
    uniform = ResponseLengths.of({"dist": "uniform", "low": 3, "high": 5}).draw(rng, 1000, 100)
    assert set(uniform.tolist()) == {3, 4, 5}
    tail = ResponseLengths().draw(rng, 100_000, 1 << 20)  # median 800, sigma 0.8
    assert np.median(tail) == pytest.approx(800, rel=0.02)
    assert tail.mean() == pytest.approx(800 * np.exp(0.32), rel=0.02)  # the mean of a lognormal
    with pytest.raises(ValueError, match="dist must be fixed, uniform or lognormal"):
        ResponseLengths.of({"dist": "zipf"})
    with pytest.raises(ValueError, match="has no field 'mean'"):
        ResponseLengths.of({"mean": 3})


def test_the_engines_are_registered_and_take_the_simulation_settings():
    assert engine_class("simulated", "batched").__name__ == "SimulatedEngine"
    assert engine_class("simulated", "streaming").__name__ == "SimulatedStreamingEngine"
    assert not traits_of(engine_class("simulated", "batched")).uses_torch
    simulation = {"timing": "qwen3-0.6b-h100", "response_lengths": {"dist": "fixed"}, "time_scale": 0.5,
                  "weight_bytes": 1}
    assert engine_settings("simulated", None, {"time_scale": 2.0}, simulation) == {
        "timing": "qwen3-0.6b-h100", "response_lengths": {"dist": "fixed"}, "time_scale": 2.0}
    assert engine_settings("hf", None, {"dtype": "float32"}, simulation) == {"dtype": "float32"}


def _engine(cls, model_dir, **kw):
    return cls(model_dir, seed=0, timing={"profile": "llama3-8b-h100", "step_s": 0.01, "step_s_per_seq": 0.0,
                                          "prefill_tokens_per_s": 1e9, "max_num_seqs": 4, "load_bytes_per_s": 1e12},
               response_lengths={"dist": "uniform", "low": 2, "high": 9}, **kw)


def test_the_batched_engine(tiny_model_dir):
    from actors.sim_engine import SimulatedEngine

    engine = _engine(SimulatedEngine, tiny_model_dir)
    eos = engine.tokenizer.eos_token_id
    start = time.perf_counter()
    out = engine.generate([[1, 2, 3], [4, 5]], 3, SamplingParams(max_tokens=6))
    elapsed = time.perf_counter() - start
    samples = [s for group in out for s in group]
    assert [len(g) for g in out] == [3, 3]
    for s in samples:
        assert 2 <= len(s.token_ids) <= 6 and len(s.logprobs) == len(s.token_ids) and max(s.logprobs) <= 0
        assert (s.finish_reason, s.token_ids[-1] == eos) in (("length", False), ("stop", True))
        assert s.finish_reason == "length" or len(s.token_ids) < 6
        assert eos not in s.token_ids[:-1]
    # 6 requests, 4 at a time, 10 ms a step: at least the longest's steps
    assert elapsed >= 0.01 * max(len(s.token_ids) for s in samples)
    assert engine.generate([[1]], 2, SamplingParams(max_tokens=4), logprobs=False)[0][0].logprobs == []


def test_an_engine_holds_and_attests_what_is_pushed(tiny_model_dir):
    from actors.sim_engine import SimulatedEngine
    from gdpo_ray.weights.buckets import pack_flat_buckets, unpack_bucket
    from gdpo_ray.weights.digest import Sent, recorded

    engine = _engine(SimulatedEngine, tiny_model_dir)
    flat = np.arange(40, dtype=np.float32)
    entries = [(0, "a", "float32", (4, 5), 80), (80, "b", "float32", (20,), 80)]
    sent, named = Sent(), {}
    for bucket in pack_flat_buckets(flat.view(np.uint8), entries, 1 << 20):
        sent.add_bucket(bucket, bucket["digests"], bucket["rounded"])
        engine.load_weights(recorded(unpack_bucket(bucket, host=True), named))
    assert named == {"a": "float32", "b": "float32"}
    assert engine.weight_digests(named) == sent.digests and len(sent.digests) == 2
    np.testing.assert_array_equal(engine.weights["a"], flat[:20].reshape(4, 5))
    engine.weights["b"] = engine.weights["b"] + 1  # an engine that does not hold what was sent
    assert engine.weight_digests(named)["b"] != sent.digests["b"]


def test_the_streaming_engine_labels_tokens_after_a_push_and_cancels(tiny_model_dir):
    from actors.sim_engine import SimulatedStreamingEngine

    engine = _engine(SimulatedStreamingEngine, tiny_model_dir)
    engine.lengths = ResponseLengths.of({"dist": "fixed", "tokens": 8})
    engine.time_scale = engine._batch.scale = 5.0  # 50 ms a step: a late wake-up moves the push a step at most
    sampling = SamplingParams(max_tokens=8)

    async def run():
        first = asyncio.create_task(engine.sample([1, 2], sampling))
        await asyncio.sleep(0.175)  # ~3 steps of 50 ms
        path = engine.write_weights([("w", np.ones(3, np.float32))])
        assert await engine.push(path, 1) == pytest.approx(5 * 16.06e9 / 1e12)  # the modelled weights' load
        second = asyncio.create_task(engine.sample([3], sampling))
        doomed = asyncio.create_task(engine.sample([4], sampling))
        await asyncio.sleep(0.075)
        doomed.cancel()
        a, b = await first, await second
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return a, b

    a, b = asyncio.run(run())
    assert len(a.token_ids) == 8 and a.finish_reason == "length" and engine.active == 0
    changed = a.versions.index(1)
    assert 1 <= changed <= 7 and a.versions == [0] * changed + [1] * (8 - changed)
    assert b.versions == [1] * 8
    assert engine.pause_s == [pytest.approx(5 * 0.01606)] and engine.weights["w"].tolist() == [1.0, 1.0, 1.0]


def test_an_actor_of_the_simulated_engine_imports_no_torch(tiny_model_dir):
    import subprocess

    code = ("import sys; from actors.sim_engine import SimulatedEngine; from actors.rollout import RolloutActor; "
            f"e = SimulatedEngine({tiny_model_dir!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_ideal_pipeline_by_hand():
    from gdpo_ray.pipeline_model import pipeline, step_s

    # one engine, one learner, B = 1 group of G = 1 response of 3 tokens, 1 s a decode step,
    # a prefill of no time, updates of (1 prompt + 3 response tokens) / 2 tokens/s = 2 s
    timing = TimingModel(step_s=1.0, step_s_per_seq=0.0, prefill_tokens_per_s=1e12, max_num_seqs=8,
                         train_tokens_per_s=2.0, weight_bytes=1, load_bytes_per_s=1e30)
    three = ResponseLengths(dist="fixed", tokens=3)
    ends = pipeline(timing, three, 1, 1, 1, 1, max_staleness=0, steps=4, max_tokens=100, prompt_tokens=1)
    assert ends == pytest.approx([5, 10, 15, 20])  # synchronous: generate 3 s, then update 2 s
    # one step of staleness: two groups decode at once from t=0 (done at 3); updates 3-5, 5-7; the
    # third group starts at the first push (5) and is done at 8, trained 8-10; the fourth starts
    # at 7 and is done at 10, trained 10-12: a step of (3 + 2) / 2 s from then on
    ends = pipeline(timing, three, 1, 1, 1, 1, max_staleness=1, steps=8, max_tokens=100, prompt_tokens=1)
    assert ends == pytest.approx([5, 7, 10, 12, 15, 17, 20, 22])
    assert step_s(ends, warmup=2) == pytest.approx((22 - 10) / 5)
    # a push's load pauses the engine: 1 s after each update before the next group decodes
    loaded = dataclasses.replace(timing, weight_bytes=10, load_bytes_per_s=10.0)
    ends = pipeline(loaded, three, 1, 1, 1, 1, max_staleness=0, steps=3, max_tokens=100, prompt_tokens=1)
    assert ends == pytest.approx([5, 11, 17])
    # two engines halve the wait for four groups of one step: 2 each, decoded at once
    ends = pipeline(timing, three, 2, 1, 4, 1, max_staleness=0, steps=2, max_tokens=100, prompt_tokens=1)
    assert ends == pytest.approx([3 + 8, 11 + 3 + 8])  # 4 x 4 tokens / 2 tokens/s = 8 s an update
    with pytest.raises(ValueError, match="fewer than 2 past the warm-up"):
        step_s([1.0, 2.0])


def test_a_push_numpy_cannot_hold_is_refused_by_name():
    from gdpo_ray.weights.buckets import pack_flat_buckets, unpack_bucket
    from gdpo_ray.weights.dtypes import itemsize

    assert (itemsize("bfloat16"), itemsize("float32"), itemsize("int64")) == (2, 4, 8)
    [bucket] = pack_flat_buckets(np.zeros(8, np.uint8), [(0, "w", "bfloat16", (4,), 8)], 1 << 10, digests=False)
    with pytest.raises(ValueError, match="w was pushed as bfloat16, which numpy does not hold"):
        unpack_bucket(bucket, host=True)
