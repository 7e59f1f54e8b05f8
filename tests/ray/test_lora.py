"""LoRA (issue 30) on CPU: PEFT adapters under DeepSpeed, pushed alone and attested, exported as
PEFT adapter directories; the hf engine computing exactly what the learners compute."""

from pathlib import Path

import numpy as np
import pytest

from gdpo_ray.lora import lora_settings
from gdpo_ray.run.transports import BroadcastTransport, ObjectStoreTransport, push_weights
from learners.learner_group import LearnerGroup
from tests.ray.test_learner import ADV, _learner_logprobs, config, fixed_batch  # noqa: F401 - a fixture

LORA = lora_settings({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})


def _named(learner, trainable: bool | None = None) -> dict:
    """The learner's parameters (name -> numpy copy); only the trainable ones, or the frozen."""
    return {n: p.detach().float().numpy().copy() for n, p in learner.engine.module.named_parameters()
            if trainable is None or p.requires_grad == trainable}


def _optimizer_numel(learner) -> tuple[int, int]:
    """(elements the optimizer steps, elements of the trainable parameters)."""
    opt = learner.engine.optimizer
    groups = getattr(opt, "optimizer", opt).param_groups
    stepped = sum(p.numel() for g in groups for p in g["params"])
    return stepped, sum(p.numel() for p in learner.engine.module.parameters() if p.requires_grad)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_fresh_adapter_computes_the_base_model_exactly(ray_cluster, tiny_model_dir, fixed_batch, stage):
    """Logprobs of a learner with a fresh adapter (B = 0) equal, bit for bit, those of the same
    learner without one; only the adapter is trainable, and only it carries optimizer state."""
    full = LearnerGroup(config(tiny_model_dir, zero_stage=stage), num_learners=1)
    try:
        base, _ = ray_cluster.get(full.learners[0].__ray_call__.remote(_learner_logprobs, fixed_batch))
    finally:
        full.shutdown()
    lora = LearnerGroup(config(tiny_model_dir, zero_stage=stage, lora=LORA), num_learners=1)
    try:
        got, _ = ray_cluster.get(lora.learners[0].__ray_call__.remote(_learner_logprobs, fixed_batch))
        trainable = ray_cluster.get(lora.learners[0].__ray_call__.remote(_named, True))
        stepped, numel = ray_cluster.get(lora.learners[0].__ray_call__.remote(_optimizer_numel))
    finally:
        lora.shutdown()
    for g, b in zip(got, base):
        np.testing.assert_array_equal(g, b)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    if stage != 3:  # (ZeRO-3 partitions what it steps)
        assert stepped == numel == sum(v.size for v in trainable.values())


def test_one_update_changes_the_adapter_and_nothing_else(ray_cluster, tiny_model_dir, fixed_batch):
    group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, lr=0.01, lora=LORA), num_learners=1)
    try:
        before = ray_cluster.get(group.learners[0].__ray_call__.remote(_named))
        group.update(fixed_batch, ADV)
        after = ray_cluster.get(group.learners[0].__ray_call__.remote(_named))
    finally:
        group.shutdown()
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B moves from zero at the first step
    frozen = [n for n in before if ".lora_" not in n]
    assert frozen and not changed & set(frozen)


def _dropout_probe(learner, groups):
    """Two training-mode forwards, then two old-logprob passes, of the same rows."""
    from gdpo_ray.groups import read_rows
    from learners.rows import rows_of

    rows = rows_of(read_rows(groups), np.zeros(sum(g.stop - g.start for g in groups)))
    train = [learner._logprobs(learner.engine, rows)[0].detach().numpy() for _ in range(2)]
    old = [np.concatenate(learner._old_logprobs(rows)) for _ in range(2)]
    return train, old


def test_lora_dropout_is_applied_in_the_update_and_nowhere_else(ray_cluster, tiny_model_dir, fixed_batch):
    """A TRL user's lora_dropout (0.05 in PEFT's examples) is not silently ignored: the update's
    forward drops the adapters' inputs; the old logprobs (the importance ratio's) do not."""
    updated = []
    for dropout in (0.0, 0.5):
        lora = lora_settings({"r": 4, "lora_alpha": 8, "lora_dropout": dropout, "target_modules": "all-linear"})
        group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, lr=0.05, lora=lora), num_learners=1)
        try:
            group.update(fixed_batch, ADV)  # B leaves zero: the adapter now changes the output
            updated.append(ray_cluster.get(group.learners[0].__ray_call__.remote(_named, True)))
            train, old = ray_cluster.get(group.learners[0].__ray_call__.remote(_dropout_probe, fixed_batch))
        finally:
            group.shutdown()
    assert any(not np.array_equal(updated[0][n], updated[1][n]) for n in updated[0])  # dropout changed the step
    assert not np.array_equal(train[0], train[1])  # two training forwards drop differently
    np.testing.assert_array_equal(old[0], old[1])  # eval mode: the policy's own logprobs


def _rollouts(model_dir, lora):
    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup

    return RolloutGroup(dict(model_path=model_dir, group_size=2, lora=lora,
                             rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
                             sampling={"max_tokens": 8}),
                        2, PromptSource([{"prompt": "hi"}]), ArrowBuffer(groups_per_step=1))


def _engine_logprobs(actor, prompt, response):
    """The rollout engine's logprobs of ``response`` after ``prompt`` (a plain forward pass)."""
    import torch

    model = actor.engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return steps.gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


def _learner_row_logprobs(learner, prompt, response):
    import torch

    with torch.no_grad():
        logits = learner.engine(input_ids=torch.tensor([prompt + response])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return steps.gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("transport", [ObjectStoreTransport, BroadcastTransport])
def test_only_the_adapter_is_pushed_and_every_push_is_attested(ray_cluster, tiny_model_dir, fixed_batch,
                                                               transport):
    """A LoRA push carries the adapter's tensors alone; each actor's engine then computes what
    the learner computes (merged: up to rounding), and the ledger counts the push attested."""
    learners = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, lr=0.05, lora=LORA), num_learners=1)
    rollouts = _rollouts(tiny_model_dir, LORA)
    prompt, response = [1, 5, 7, 9], [11, 42, 7, 300, 2]
    try:
        ray_cluster.get([s.starting for s in rollouts.slots])
        sender = transport(learners, 64 << 10)
        for version in (1, 2):
            learners.update(fixed_batch, ADV)
            pushed = push_weights(sender, rollouts, version)
            sent = pushed.sent if pushed.digests is None else ray_cluster.get(pushed.digests)
            assert set(sent.digests) and all(".lora_" in n for n in sent.digests)
        rollouts.ledger.settle()  # every actor has loaded push 2 and reported (Ray may run a call before it)
        adapter = ray_cluster.get(learners.learners[0].__ray_call__.remote(_named, True))
        learner_lp = ray_cluster.get(learners.learners[0].__ray_call__.remote(_learner_row_logprobs, prompt, response))
        engine_lp = ray_cluster.get([s.handle.__ray_call__.remote(_engine_logprobs, prompt, response)
                                     for s in rollouts.slots])
        rollouts.collect()
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert pushed.sent.bytes == sum(v.nbytes for v in adapter.values())  # the adapter, nothing else
    assert len(sent.digests) == len(adapter) and set(sent.dtypes) == set(pushed.sent.dtypes)
    for lp in engine_lp:  # the merged adapter: the learner's function up to float rounding
        np.testing.assert_allclose(lp, learner_lp, rtol=0, atol=1e-5)
    assert rollouts.ledger.attested == 2


def test_the_exported_adapter_loads_with_peft_and_the_merged_model_agrees(ray_cluster, tiny_model_dir,
                                                                           fixed_batch, tmp_path):
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    group = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=1, lr=0.05, lora=LORA), num_learners=2)
    prompt, response = [1, 5, 7, 9], [11, 42, 7, 300, 2]
    try:
        group.update(fixed_batch, ADV)
        group.export_hf(str(tmp_path / "policy"), str(tmp_path / "policy-merged"))
        expected = ray_cluster.get([learner.__ray_call__.remote(_learner_row_logprobs, prompt, response)
                                    for learner in group.learners])[0]
    finally:
        group.shutdown()
    adapter_config = json.loads((tmp_path / "policy" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir) and adapter_config["r"] == 4
    assert not (tmp_path / "policy" / "config.json").exists()  # an adapter, not a model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "policy")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy-merged", dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = [torch.log_softmax(m(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
              .gather(1, torch.tensor(response)[:, None])[:, 0].numpy() for m in (peft_model, merged)]
    np.testing.assert_array_equal(lp[0], expected)  # PEFT's layers: exactly the learner's
    np.testing.assert_allclose(lp[1], expected, atol=1e-5)  # merged: rounded once more
    assert not np.allclose(expected, _base_logprobs(tiny_model_dir, prompt, response), atol=1e-4)


def _base_logprobs(model_dir, prompt, response):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state(ray_cluster, tiny_model_dir, fixed_batch,
                                                                     tmp_path):
    from tests.digests import optimizer_digests

    group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, lora=LORA), num_learners=1)
    try:
        group.update(fixed_batch, ADV)
        group.save_checkpoint(str(tmp_path / "ckpt"))
        saved = (ray_cluster.get(group.learners[0].__ray_call__.remote(_named, True)), optimizer_digests(group))
        group.update(fixed_batch, ADV)  # moves on
        group.load_checkpoint(str(tmp_path / "ckpt"))
        restored = (ray_cluster.get(group.learners[0].__ray_call__.remote(_named, True)), optimizer_digests(group))
    finally:
        group.shutdown()
    assert saved[1] == restored[1]
    assert saved[0].keys() == restored[0].keys()
    for name in saved[0]:
        np.testing.assert_array_equal(saved[0][name], restored[0][name])
    model_states = next((tmp_path / "ckpt").glob("*/mp_rank_00_model_states.pt"))
    base_bytes = sum(f.stat().st_size for f in Path(tiny_model_dir).glob("*.safetensors"))
    assert model_states.stat().st_size < base_bytes / 2  # the adapter, not the frozen base weights
    import torch

    # no frozen tensor under any name: the tied output head (lm_head.weight, the embedding matrix,
    # which DeepSpeed's exclude_frozen_parameters keeps) neither
    module = torch.load(model_states, map_location="cpu", weights_only=False)["module"]
    assert sorted(module) == sorted(saved[0])
    # and the checkpoint's export path (gdpo-ray eval CHECKPOINT) still reads the adapter from it
    from learners.deepspeed_env import import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    assert sorted(exported) == sorted(saved[0])
    for name in saved[0]:
        np.testing.assert_array_equal(exported[name].detach().numpy(), saved[0][name])


def test_the_adapter_names_its_base_by_hub_name(ray_cluster, tiny_model_dir, tmp_path):
    """adapter_config.json's base_model_name_or_path: the hub name the driver gives
    (``model_files.hub_name``: SmolLM2's for ``smollm2``), not the learner's local copy's path."""
    import json

    group = LearnerGroup(config(tiny_model_dir, zero_stage=0, lora=LORA, base_model_name="someone/base-model"),
                         num_learners=1)
    try:
        group.export_hf(str(tmp_path / "policy"))
    finally:
        group.shutdown()
    adapter_config = json.loads((tmp_path / "policy" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "someone/base-model"


def test_the_hf_engine_merges_every_push_from_the_pristine_weights(tiny_model_dir):
    """W = W0 + PEFT's delta after each push, never accumulated: pushing the zero adapter after
    two others gives W0 back bit for bit. A layer whose weight is not its adapter's merge (a
    load that did not merge) reports none of its tensors, so its push is not attested."""
    import torch

    from actors.hf_engine import HFEngine
    from gdpo_ray.weights.digest import compare, digest

    engine = HFEngine(tiny_model_dir, lora=LORA)
    held = engine._held()
    base = {name: w0.clone() for name, (_, w0) in engine._layers.items()}
    rng = np.random.default_rng(0)
    for _ in range(2):
        adapter = {n: rng.normal(0, 0.1, p.shape).astype(np.float32) for n, p in held.items()}
        engine.load_weights(adapter.items())
    some = next(iter(engine._layers))
    layer = engine._layers[some][0]
    merged = layer.base_layer.weight.detach().clone()
    assert not torch.equal(merged, base[some])
    torch.testing.assert_close(merged, base[some] + layer.get_delta_weight("default"), rtol=0, atol=0)
    sent = {n: digest(torch.from_numpy(v)) for n, v in adapter.items()}
    dtypes = {n: "float32" for n in adapter}
    assert compare(sent, engine.weight_digests(dtypes)) == []
    layer.base_layer.weight.data = base[some].clone()  # the merge undone
    wrong = compare(sent, engine.weight_digests(dtypes))
    assert len(wrong) == 1 and f"{some}.lora_A.weight" in wrong[0] and "not reported as held" in wrong[0]
    engine.load_weights((n, np.zeros(p.shape, np.float32)) for n, p in held.items() if ".lora_B." in n)
    for name, (layer, _) in engine._layers.items():
        assert torch.equal(layer.base_layer.weight, base[name]), name
