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
