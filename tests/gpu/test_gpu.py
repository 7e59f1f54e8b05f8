"""The GPU paths (run by benchmarks/gpu_check.sh on a machine with a CUDA GPU; skipped elsewhere).

The same code as on CPU, on the device: the hf engine's logprobs, a DeepSpeed learner with NCCL,
the vLLM engine of the official wheel, and weights broadcast from the learner over NCCL (into an
hf engine, into a vLLM engine through vLLM's weight transfer, and into a streaming actor's
``AsyncLLM`` in flight)."""

import os

import numpy as np
import pytest
import torch

from gdpo_ray.weights.channels import MULTI_RANK_GPU_ENV
from gdpo_ray.run.transports import BroadcastTransport, push_weights
from tests.digests import actor_digest, learner_digests
from tests.engines import actor_greedy, greedy_with
# the learner tests' batch (4 groups x 4 rollouts, fixed advantages)
from tests.ray.test_learner import ADV, fixed_batch  # noqa: F401 - fixed_batch is a fixture

pytestmark = pytest.mark.gpu

# A learner and a rollout actor sharing one GPU form an NCCL group only with NCCL's multi-rank
# switch; set before the session's Ray cluster starts, so that every Ray worker inherits it.
os.environ.setdefault(MULTI_RANK_GPU_ENV, "1")


def test_hf_engine_on_cuda_matches_a_forward_pass(tiny_model_dir):
    from actors.engines import SamplingParams
    from actors.hf_engine import HFEngine

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


def learner_config(model_dir, **kw):
    from gdpo_ray.losses import PolicyLossConfig
    from learners.deepspeed_learner import LearnerConfig

    kw = {"lr": 1e-3, "epochs": 4, "loss": PolicyLossConfig(off_policy="none"), **kw}
    return LearnerConfig(model_path=model_dir, **kw)


def test_deepspeed_learner_with_nccl_lowers_the_loss(ray_cluster, tiny_model_dir, fixed_batch):
    from learners.learner_group import LearnerGroup

    learners = LearnerGroup(learner_config(tiny_model_dir, zero_stage=2), num_learners=1,
                            num_gpus_per_learner=1)
    try:
        m = learners.update(fixed_batch, ADV)
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


# -- weights out over NCCL -----------------------------------------------------------------------

def gpu_shares() -> dict:
    """GPU fractions of a learner and of a rollout actor: whole GPUs where there are two; else
    shares of one, where NCCL admits both ranks only from 2.30 on (MULTI_RANK_GPU_ENV)."""
    if torch.cuda.device_count() >= 2:
        return {"learner": 1, "actor": 1}
    if tuple(torch.cuda.nccl.version()[:2]) < (2, 30):
        pytest.skip(f"one GPU, and NCCL {torch.cuda.nccl.version()} (< 2.30) refuses two ranks on "
                    "it (Duplicate GPU detected): needs 2 GPUs")
    return {"learner": 0.4, "actor": 0.3}


def one_rollout_actor(model_dir, num_gpus, **actor_kwargs):
    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup

    return RolloutGroup(dict(model_path=model_dir, group_size=2,
                             rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
                             sampling={"max_tokens": 8},
                             **actor_kwargs),
                        1, PromptSource([{"prompt": "hi"}]), ArrowBuffer(groups_per_step=1),
                        num_gpus=num_gpus)


def test_nccl_broadcast_reaches_an_hf_actor_on_cuda(ray_cluster, tiny_model_dir, fixed_batch):
    from learners.learner_group import LearnerGroup

    shares = gpu_shares()
    learners = LearnerGroup(learner_config(tiny_model_dir, zero_stage=2, epochs=1), num_learners=1,
                            num_gpus_per_learner=shares["learner"])
    rollouts = one_rollout_actor(tiny_model_dir, shares["actor"], engine_kwargs={"device": "cuda"})
    actor = rollouts.slots[0].handle
    try:
        ray_cluster.get(rollouts.slots[0].starting)
        transport, pushes = BroadcastTransport(learners, 128 << 10), []
        for version in (1, 2):  # the second push reuses the group
            learners.update(fixed_batch, ADV)
            peak = push_weights(transport, rollouts, version).peak_bytes
            pushes.append((actor_digest(actor),
                           ray_cluster.get(actor.policy_version.remote()), learner_digests(learners)[0]))
        backend = transport.backend
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert backend == "nccl"
    assert 0 < peak <= 128 << 10  # the largest parameter (the 384 x 64 float32 embedding) is 96 KiB
    for version, (digest, actor_version, learner_digest) in zip((1, 2), pushes):
        assert digest == learner_digest and actor_version == version
    assert pushes[0][2] != pushes[1][2]


def test_vllm_actor_on_cuda_takes_the_broadcast_through_vllm_weight_transfer(ray_cluster, tiny_model_dir,
                                                                              fixed_batch):
    pytest.importorskip("vllm")
    from learners.learner_group import LearnerGroup

    shares = gpu_shares()
    # ZeRO-3: the announced shapes come from ds_shape, the tensors from one gather at a time
    learners = LearnerGroup(learner_config(tiny_model_dir, zero_stage=3, epochs=1, lr=0.05,
                                           micro_batch_tokens=64),
                            num_learners=1, num_gpus_per_learner=shares["learner"])
    rollouts = one_rollout_actor(tiny_model_dir, shares["actor"], engine="vllm", engine_kwargs={
        "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.3})
    actor = rollouts.slots[0].handle
    prompts = ["What is 1 + 1?", "Name a color.", "Count to three."]
    try:
        ray_cluster.get(rollouts.slots[0].starting)
        greedy_before = ray_cluster.get(actor.__ray_call__.remote(actor_greedy, prompts, 8))
        for _ in range(3):  # a large step, so that the random tiny model's greedy choice moves
            learners.update(fixed_batch, ADV)
        transport = BroadcastTransport(learners, 256 << 20)
        push_weights(transport, rollouts, 1)
        greedy_after = ray_cluster.get(actor.__ray_call__.remote(actor_greedy, prompts, 8))
        version = ray_cluster.get(actor.policy_version.remote())
        weights = learners.get_weights()
        backend = transport.backend
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert backend == "vllm" and version == 1
    # the engine decodes as the learner's weights do, not as before
    expected = greedy_with(tiny_model_dir, weights, prompts, 8)
    assert greedy_after == expected and expected != greedy_before


def test_a_vllm_broadcast_lands_in_flight_on_a_streaming_actor_on_cuda(ray_cluster, tiny_model_dir, fixed_batch):
    """weight_sync=broadcast with generation.mode=streaming on CUDA: learner rank 0 broadcasts
    through vLLM's NCCL weight transfer into the AsyncLLM engine (paused, requests kept) while
    a group decodes; its tokens carry each version and that policy's logprobs (the CPU variant
    over gloo is tests/ray/test_vllm.py)."""
    pytest.importorskip("vllm")
    from tests.ray.test_vllm import broadcast_into_a_streaming_actor, check_broadcast_in_flight

    shares = gpu_shares()
    out = broadcast_into_a_streaming_actor(ray_cluster, tiny_model_dir, fixed_batch,
                                           learner_gpus=shares["learner"], actor_gpus=shares["actor"])
    assert out["backend"] == "vllm"
    check_broadcast_in_flight(out, tiny_model_dir)


def lora_pushes(ray_cluster, model_dir, batch, lora: dict, bucket_bytes: int, **actor_kwargs):
    """Two NCCL-broadcast pushes of a LoRA learner's adapter (DeepSpeed on CUDA, ZeRO-2) to one
    rollout actor on CUDA: (the group's backend, pushes attested, the last ``Pushed``)."""
    from learners.learner_group import LearnerGroup

    shares = gpu_shares()
    learners = LearnerGroup(learner_config(model_dir, zero_stage=2, epochs=1, lr=0.05, lora=lora),
                            num_learners=1, num_gpus_per_learner=shares["learner"])
    rollouts = one_rollout_actor(model_dir, shares["actor"], lora=lora, **actor_kwargs)
    try:
        ray_cluster.get(rollouts.slots[0].starting)
        transport = BroadcastTransport(learners, bucket_bytes)
        for version in (1, 2):
            learners.update(batch, ADV)
            pushed = push_weights(transport, rollouts, version)
        return transport.backend, rollouts.ledger.attested, pushed
    finally:
        learners.shutdown()
        rollouts.shutdown()


def test_a_lora_adapter_goes_over_nccl_alone_and_is_attested(ray_cluster, tiny_model_dir, fixed_batch):
    """Issue 30 on CUDA: a LoRA learner (DeepSpeed, NCCL) pushes its adapter alone to an hf actor
    on CUDA over the NCCL broadcast; the actor's report matches what was sent."""
    from gdpo_ray.lora import lora_settings

    lora = lora_settings({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    backend, attested, pushed = lora_pushes(ray_cluster, tiny_model_dir, fixed_batch, lora, 128 << 10,
                                            engine_kwargs={"device": "cuda"})
    assert backend == "nccl" and attested == 2
    assert pushed.sent.digests and all(".lora_" in name for name in pushed.sent.digests)


def test_a_vllm_actor_on_cuda_serves_the_pushed_adapter_attested(ray_cluster, tiny_model_dir, fixed_batch):
    """Issue 30 on CUDA: a LoRA learner's adapter over the NCCL broadcast into a vLLM engine
    serving it through vLLM's LoRA support (its weight transfer is off under LoRA); every push
    attested against what vLLM's LoRA layers hold."""
    pytest.importorskip("vllm")
    from gdpo_ray.lora import lora_settings

    lora = lora_settings({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
    backend, attested, pushed = lora_pushes(
        ray_cluster, tiny_model_dir, fixed_batch, lora, 256 << 20, engine="vllm", engine_kwargs={
            "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.3})
    assert backend == "nccl" and attested == 2
    assert pushed.sent.digests and all(".lora_" in name for name in pushed.sent.digests)
