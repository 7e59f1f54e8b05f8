"""The backend agreement of a weight broadcast group (pure): NCCL only when every member can."""

from gdpo_ray.weights.channels import agreed_backend

CPU = {"backend": "gloo", "gpu": None, "share": False}


def gpu(kind: str, uuid: str, share: bool = False) -> dict:
    return {"backend": kind, "gpu": uuid, "share": share}


def test_nccl_only_when_every_member_is_on_cuda_and_alike():
    assert agreed_backend([CPU, CPU, CPU]) == "gloo"
    assert agreed_backend([gpu("nccl", "a"), gpu("nccl", "b")]) == "nccl"
    assert agreed_backend([gpu("nccl", "a"), gpu("vllm", "b"), gpu("vllm", "c")]) == "vllm"
    assert agreed_backend([gpu("nccl", "a"), CPU]) == "gloo"  # one CPU actor: everyone on gloo
    assert agreed_backend([gpu("nccl", "a"), gpu("vllm", "b"), gpu("nccl", "c")]) == "gloo"


def test_two_members_on_one_gpu_need_every_members_nccl_to_allow_it():
    assert agreed_backend([gpu("nccl", "a"), gpu("nccl", "a")]) == "gloo"
    assert agreed_backend([gpu("nccl", "a", True), gpu("nccl", "a", False)]) == "gloo"
    assert agreed_backend([gpu("nccl", "a", True), gpu("nccl", "a", True)]) == "nccl"


def test_a_batched_actor_digests_large_tensors_on_a_thread(tiny_model_dir, monkeypatch):
    """The hf engine digests by name: the tensors of THREADED_DIGEST_BYTES or more are digested
    on a thread (beside generation), the rest on the actor's loop; together the same digests as
    one call. Without sizes (a broadcast) or an engine that does not digest by name: one call."""
    import asyncio
    import dataclasses
    import threading

    from actors import samplers
    from actors.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir)
    sent = {name: "float32" for name, _ in engine.model.named_parameters()}
    sizes = {name: p.nbytes for name, p in engine.model.named_parameters()}
    limit = sorted(sizes.values())[-3]  # the three largest go to the thread
    monkeypatch.setattr(samplers, "THREADED_DIGEST_BYTES", limit)
    whole, calls = engine.weight_digests(sent), []
    digests = engine.weight_digests

    def spied(names):
        calls.append((sorted(names), threading.current_thread() is threading.main_thread()))
        return digests(names)

    monkeypatch.setattr(engine, "weight_digests", spied)
    sampler = samplers.BatchedSampler(engine, 2, None)
    assert asyncio.run(sampler.digests(sent, sizes)) == whole
    large = sorted(n for n, b in sizes.items() if b >= limit)
    assert len(large) >= 3 and calls == [(sorted(set(sent) - set(large)), True), (large, False)]
    calls.clear()
    assert asyncio.run(sampler.digests(sent)) == whole and calls == [(sorted(sent), True)]
    calls.clear()
    monkeypatch.setattr(HFEngine, "traits", dataclasses.replace(HFEngine.traits, digests_by_name=False))
    assert asyncio.run(sampler.digests(sent, sizes)) == whole and calls == [(sorted(sent), True)]
