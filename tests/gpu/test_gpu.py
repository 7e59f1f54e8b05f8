"""The GPU paths (run by benchmarks/gpu_check.sh on a machine with a CUDA GPU; skipped elsewhere).

The same code as on CPU, on the device: the hf engine's logprobs, a DeepSpeed learner with NCCL,
and the vLLM engine of the official wheel."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_hf_engine_on_cuda_matches_a_forward_pass(tiny_model_dir):
    from actors.engines import HFEngine, SamplingParams

    engine = HFEngine(tiny_model_dir, device="cuda", seed=3)
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 4, SamplingParams(temperature=0.8, max_tokens=16))
    for s in samples:
        ids = torch.tensor([prompt + s.token_ids], device="cuda")
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / 0.8, -1).gather(
            1, torch.tensor(s.token_ids, device="cuda")[:, None])[:, 0]
        np.testing.assert_allclose(s.logprobs, expected.cpu().numpy(), atol=1e-3)


def test_deepspeed_learner_with_nccl_lowers_the_loss(ray_cluster, tiny_model_dir):
    from actors.buffer import GroupRef
    from gdpo_ray.batch import GroupData, build_groups, group_bounds
    from gdpo_ray.losses import PolicyLossConfig
    from learners.deepspeed_learner import LearnerConfig, LearnerGroup

    rng = np.random.default_rng(0)
    groups = []
    for p in range(4):
        responses = [rng.integers(3, 300, rng.integers(4, 12)).tolist() for _ in range(4)]
        groups.append(GroupData(prompt_id=str(p), group_id=f"{p}/e0/a0", prompt_token_ids=[1, 5, 7],
                                response_token_ids=responses,
                                response_logprobs=[[-5.0] * len(r) for r in responses],
                                finish_reasons=["stop"] * 4, policy_version=0, rewards=np.zeros((4, 1)),
                                reward_errors=[[""]] * 4))
    batch = build_groups(groups, ["r"])
    ref = ray_cluster.put(batch)
    refs = [GroupRef(ref, a, b, g, 0) for g, a, b in group_bounds(batch)]
    learners = LearnerGroup(LearnerConfig(model_path=tiny_model_dir, zero_stage=2, lr=1e-3, epochs=4,
                                          loss=PolicyLossConfig(is_cap=None)),
                            num_learners=1, num_gpus_per_learner=1)
    try:
        m = learners.update(refs, np.tile([1.0, -1.0, 0.5, -0.5], 4).astype(np.float32))
    finally:
        learners.shutdown()
    assert m["loss_last"] < m["loss_first"]


def test_official_vllm_on_gpu_matches_a_forward_pass(tiny_model_dir):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from actors.engines import SamplingParams
    from actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 4, SamplingParams(temperature=1.0, max_tokens=12))
    for s in samples:
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(s.logprobs, expected.numpy(), atol=2e-3)
