"""FSDP2 learners (``learners.backend=fsdp2``) on CPU (gloo): DeepSpeed ZeRO-2's update to float
rounding, full weights and LoRA, on 1 and 2 learners; checkpoints that resume exactly (and export
for ``gdpo-ray eval CHECKPOINT``); pushes that reach the rollout actors and are attested."""

import hashlib
import pickle

import numpy as np
import pytest

from gdpo_ray.losses import PolicyLossConfig
from gdpo_ray.run.transports import BroadcastTransport, ObjectStoreTransport, push_weights
from learners.learner_group import LearnerGroup
from tests.digests import actor_digests, learner_digests
from tests.ray.test_learner import ADV, _learner_logprobs, config, fixed_batch, two_rollout_actors  # noqa: F401
from tests.ray.test_lora import LORA, _rollouts

#: 2 epochs x 2 mini-batches: four AdamW steps per update, the old-policy pass, the gradient
#: clipped at every step (its norm: 1.2-1.5 full, 0.2 LoRA), the KL to the reference (full: a
#: second model; LoRA: the adapter disabled), the stale-sample weight truncated
STEPS = dict(epochs=2, mini_batches=2, lr=1e-3, grad_clip=0.1, loss=PolicyLossConfig(off_policy={"cap": 2.0}, kl_coef=0.05))
METRICS = ("loss", "loss_first", "loss_last", "pg_loss", "kl", "grad_norm", "entropy", "tokens")


def _updates(cfg, learners: int, batch, n: int = 2) -> tuple[list[dict], dict]:
    group = LearnerGroup(cfg, num_learners=learners)
    try:
        metrics = [group.update(batch, ADV) for _ in range(n)]
        return metrics, group.get_weights()
    finally:
        group.shutdown()


@pytest.mark.parametrize("lora, learners", [(None, 1), (None, 2), (LORA, 1), (LORA, 2)])
def test_fsdp2_computes_the_update_of_deepspeed_zero2(ray_cluster, tiny_model_dir, fixed_batch, lora, learners):
    """Two updates of four optimizer steps each: the same losses, gradient norms and weights.
    Measured: losses, KL, entropy and gradient norms within 4e-6 relative (LoRA on one learner:
    equal); weights within 5e-7 on one learner, and on two within 1.2e-5 after eight AdamW steps of
    lr 1e-3 (AdamW divides each gradient by its own running scale, so the rounding of a near-zero
    gradient, summed over the ranks in another order, moves its weight by a small part of lr:
    the tolerance is 2% of one step)."""
    runs = {backend: _updates(config(tiny_model_dir, backend=backend, zero_stage=2, lora=lora, **STEPS),
                              learners, fixed_batch)
            for backend in ("deepspeed", "fsdp2")}
    (ds_metrics, ds_weights), (fs_metrics, fs_weights) = runs["deepspeed"], runs["fsdp2"]
    for ds, fs in zip(ds_metrics, fs_metrics):
        for key in METRICS:
            assert fs[key] == pytest.approx(ds[key], rel=1e-5, abs=1e-8), key
    assert all(m["kl"] > 0 for m in ds_metrics)  # the policy left its reference after the first step
    assert fs_weights.keys() == ds_weights.keys()
    if lora:
        assert all(".lora_" in name for name in fs_weights)  # the adapter alone goes out
    for name in ds_weights:
        np.testing.assert_allclose(fs_weights[name], ds_weights[name], rtol=1e-5, atol=2e-5, err_msg=name)


def test_fsdp2_logprobs_are_a_plain_forward_pass_per_row(ray_cluster, tiny_model_dir, fixed_batch):
    """Through the LM head in slices (the root's weight, gathered for the forward, is the head's):
    each row's own forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    group = LearnerGroup(config(tiny_model_dir, backend="fsdp2", temperature=0.7), num_learners=1)
    try:
        got, _ = ray_cluster.get(group.learners[0].__ray_call__.remote(_learner_logprobs, fixed_batch))
        fused = ray_cluster.get(group.learners[0].__ray_call__.remote(lambda lr: list(lr._fused.values())))
    finally:
        group.shutdown()
    assert fused == [True]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [row for g in fixed_batch for row in zip(
        *(ray_cluster.get(g.ref).slice(g.start, g.stop - g.start).column(c).to_pylist()
          for c in ("prompt_token_ids", "response_token_ids")))]
    for (prompt, response), lp in zip(rows, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / 0.7
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        np.testing.assert_allclose(lp, expected.numpy(), atol=1e-5)


@pytest.mark.parametrize("lora", [None, LORA])
def test_gradient_checkpointing_under_fsdp2_computes_the_same_update(ray_cluster, tiny_model_dir, fixed_batch, lora):
    """Each layer recomputed in backward (FSDP2 gathers its weights again for that): the same
    update (one row per micro-batch, so that no forward shares a prompt either way)."""
    (plain, plain_weights), (checkpointed, weights) = (
        _updates(config(tiny_model_dir, backend="fsdp2", epochs=1, lr=0.01, lora=lora, micro_batch_tokens=1,
                        gradient_checkpointing=on), 1, fixed_batch, 1)
        for on in (False, True))
    assert checkpointed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    for name in plain_weights:
        np.testing.assert_allclose(weights[name], plain_weights[name], rtol=0, atol=1e-7, err_msg=name)


def _optimizer_digest(learner) -> str:
    """sha256 of this rank's AdamW state (its shards)."""
    h = hashlib.sha256()
    for key, value in sorted(learner.optimizer.state_dict()["state"].items()):
        for name in sorted(value):
            tensor = value[name]
            tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            h.update(f"{key}.{name}".encode() + tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("lora, learners", [(None, 2), (LORA, 1)])
def test_a_checkpoint_resumes_the_next_update_exactly(ray_cluster, tiny_model_dir, fixed_batch, tmp_path,
                                                      lora, learners):
    """Saved after one update: new learners that load it compute the second update bit for bit
    as the learners that saved it; the weights, AdamW state and step come back, the checkpoint
    under LoRA holds the adapter alone, and ``gdpo-ray eval CHECKPOINT``'s export reads it."""
    from gdpo_ray.run.checkpoints import COMPLETE_MARKER, export_checkpoint_policy

    cfg = config(tiny_model_dir, backend="fsdp2", lora=lora, **STEPS)
    path = str(tmp_path / "ckpt" / "learner")
    first = LearnerGroup(cfg, num_learners=learners)
    try:
        first.update(fixed_batch, ADV)
        first.save_checkpoint(path)
        saved = (learner_digests(first), ray_cluster.get([lr.__ray_call__.remote(_optimizer_digest)
                                                           for lr in first.learners]))
        saved_weights = first.get_weights()
        expected = (first.update(fixed_batch, ADV), first.get_weights())
    finally:
        first.shutdown()
    second = LearnerGroup(cfg, num_learners=learners)
    try:
        assert second.load_checkpoint(path) == 1
        assert (learner_digests(second), ray_cluster.get([lr.__ray_call__.remote(_optimizer_digest)
                                                           for lr in second.learners])) == saved
        resumed = (second.update(fixed_batch, ADV), second.get_weights())
    finally:
        second.shutdown()
    for key in METRICS:
        assert resumed[0][key] == expected[0][key], key
    for name in expected[1]:
        np.testing.assert_array_equal(resumed[1][name], expected[1][name], err_msg=name)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "learner" / "step1").iterdir())
    assert files == sorted([f"__{r}_0.distcp" for r in range(learners)] + [".metadata", "learner_state.json"])
    import torch.distributed.checkpoint as dcp

    held = dcp.FileSystemReader(str(tmp_path / "ckpt" / "learner" / "step1")).read_metadata().state_dict_metadata
    model = sorted(k for k in held if k.startswith("model."))
    if lora:  # the adapter alone (no frozen tensor under any name, the tied head neither)
        assert model and all(".lora_A." in k or ".lora_B." in k for k in model)
    else:  # every parameter of the model
        from transformers import AutoModelForCausalLM

        names = {n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
        assert {k.removeprefix("model.") for k in model} >= names
    # the export of a checkpoint (gdpo-ray eval CHECKPOINT) reads the learners' files offline
    ctor = {"model_path": tiny_model_dir, "lora": lora, "backend": "fsdp2"}
    (tmp_path / "ckpt" / "class_and_ctor_args.pkl").write_bytes(pickle.dumps({"ctor_args_and_kwargs": ((ctor,), {})}))
    (tmp_path / "ckpt" / COMPLETE_MARKER).write_text("policy_version 1\n")
    exported = _exported_logprobs(export_checkpoint_policy(str(tmp_path / "ckpt"), str(tmp_path / "policy")))
    np.testing.assert_allclose(exported, _logprobs_with(tiny_model_dir, lora, saved_weights), atol=1e-5)


PROMPT, RESPONSE = [1, 5, 7, 9], [11, 42, 7, 300, 2]


def _exported_logprobs(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return _row_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def _logprobs_with(model_dir, lora, weights):
    """The row's logprobs under the base model with ``weights`` (the adapter's, under LoRA)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import get_peft_model, set_peft_model_state_dict

        from gdpo_ray.lora import peft_config

        model = get_peft_model(model, peft_config(lora))
        set_peft_model_state_dict(model, {k: torch.from_numpy(v) for k, v in weights.items()})
    else:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return _row_logprobs(model)


def _row_logprobs(model):
    import torch

    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([PROMPT + RESPONSE])).logits[0].float()
    steps = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1)
    return steps.gather(1, torch.tensor(RESPONSE)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("lora, learners, transport", [(None, 2, ObjectStoreTransport),
                                                       (None, 2, BroadcastTransport),
                                                       (LORA, 1, ObjectStoreTransport)])
def test_a_push_from_fsdp2_learners_reaches_the_rollouts_and_is_attested(ray_cluster, tiny_model_dir, fixed_batch,
                                                                       lora, learners, transport):
    """The full, gathered weights (under LoRA the adapter alone) in float32, every state-dict
    name (the tied head too); each actor's engine then holds what the learners hold, and the
    ledger attests both pushes."""
    group = LearnerGroup(config(tiny_model_dir, backend="fsdp2", epochs=1, lr=0.05, lora=lora), num_learners=learners)
    rollouts = two_rollout_actors(tiny_model_dir) if lora is None else _rollouts(tiny_model_dir, lora)
    try:
        ray_cluster.get([s.starting for s in rollouts.slots])
        sender, held = transport(group, 64 << 10), []
        for version in (1, 2):
            group.update(fixed_batch, ADV)
            pushed = push_weights(sender, rollouts, version)
            sent = pushed.sent if pushed.digests is None else ray_cluster.get(pushed.digests)
            rollouts.ledger.settle()  # every actor has loaded it and reported, the sender's digests in
            rollouts.collect()
            held.append((actor_digests(rollouts.receivers()), learner_digests(group)))
        weights = group.get_weights()
    finally:
        group.shutdown()
        rollouts.shutdown()
    assert set(sent.dtypes.values()) == {"float32"} and sent.digests.keys() == weights.keys()
    assert pushed.sent.bytes == sent.bytes == sum(v.nbytes for v in weights.values())
    if lora is None:
        assert "lm_head.weight" in weights and held[0][0] == [held[0][1][0]] * 2  # the engines' weights
        assert held[1][0] == [held[1][1][0]] * 2 != held[0][0]
    assert rollouts.ledger.attested == 2


def test_bf16_under_fsdp2_trains_and_pushes_what_the_forward_sees(ray_cluster, tiny_model_dir, fixed_batch):
    """training.precision=bf16: FSDP2's mixed precision (bf16 weights in the forward, float32
    shards); the weights go out as the forward sees them, bf16 values in float32."""
    import torch

    metrics, weights = _updates(config(tiny_model_dir, backend="fsdp2", precision="bf16"), 1, fixed_batch, 1)
    assert metrics[0]["loss_last"] < metrics[0]["loss_first"]
    for name, value in weights.items():
        tensor = torch.from_numpy(value)
        assert value.dtype == np.float32 and torch.equal(tensor.to(torch.bfloat16).float(), tensor), name


@pytest.mark.gpu
def test_fsdp2_with_nccl_computes_the_update_of_deepspeed_zero2(ray_cluster, tiny_model_dir, fixed_batch):
    """On a CUDA GPU (NCCL): DeepSpeed's update there (cuBLAS's kernels round otherwise than the
    CPU's: 1e-4); the weights come back from the device whole."""
    metrics = []
    for backend in ("deepspeed", "fsdp2"):
        group = LearnerGroup(config(tiny_model_dir, backend=backend, zero_stage=2, **STEPS), num_learners=1,
                             num_gpus_per_learner=1)
        try:
            metrics.append(group.update(fixed_batch, ADV))
            weights = group.get_weights()
        finally:
            group.shutdown()
    for key in METRICS:
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-6), key
    assert all(np.isfinite(v).all() for v in weights.values())
