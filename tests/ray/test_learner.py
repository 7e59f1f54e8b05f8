"""DeepSpeed learners on CPU (gloo): the update, replicas, checkpoints, weights to rollouts."""

import numpy as np
import pytest

from gdpo_ray.groups import GroupRef
from gdpo_ray.batch import GroupData, build_groups, group_bounds
from gdpo_ray.losses import PolicyLossConfig
from gdpo_ray.run.transports import BroadcastTransport, ObjectStoreTransport, push_weights
from learners.deepspeed_learner import LearnerConfig
from learners.rows import plan_micro_batches
from learners.learner_group import LearnerGroup, split_groups
from tests.digests import actor_digests, learner_digests, optimizer_digests
from tests.engines import actor_greedy, greedy_with

ADV = np.tile([1.0, -1.0, 0.5, -0.5], 4).astype(np.float32)


@pytest.fixture(scope="module")
def fixed_batch(ray_cluster):
    """4 groups x 4 rollouts of random tokens, with fixed advantages."""
    rng = np.random.default_rng(0)
    groups = []
    for p in range(4):
        responses = [rng.integers(3, 300, rng.integers(4, 12)).tolist() for _ in range(4)]
        groups.append(GroupData(
            prompt_id=str(p), group_id=f"{p}/e0/a0", prompt_token_ids=[1, 5, 7, 9],
            response_token_ids=responses, response_logprobs=[[-5.0] * len(r) for r in responses],
            finish_reasons=["stop"] * 4, policy_version=0, rewards=np.zeros((4, 1)),
            reward_errors=[[""]] * 4))
    batch = build_groups(groups, ["r"])
    ref = ray_cluster.put(batch)
    return [GroupRef(ref, a, b, g, 0) for g, a, b in group_bounds(batch)]


def two_rollout_actors(model_dir):
    from actors.buffer import ArrowBuffer
    from actors.prompts import PromptSource
    from actors.rollout_group import RolloutGroup

    return RolloutGroup(dict(model_path=model_dir, group_size=2,
                             rewards=[{"name": "short", "fn": "length", "params": {"limit": 8}}],
                             sampling={"max_tokens": 8}),
                        2, PromptSource([{"prompt": "hi"}]), ArrowBuffer(groups_per_step=1))


def config(model_dir, **kw):
    kw = {"lr": 1e-3, "epochs": 4, "loss": PolicyLossConfig(off_policy="none"), "micro_batch_tokens": 64, **kw}
    return LearnerConfig(model_path=model_dir, **kw)


@pytest.mark.parametrize("stage, learners, precision", [(0, 2, "fp32"), (1, 2, "fp32"), (2, 1, "fp32"),
                                                         (2, 2, "bf16"), (3, 2, "fp32")])
def test_update_lowers_the_loss_and_replicas_agree(ray_cluster, tiny_model_dir, fixed_batch, stage,
                                                   learners, precision):
    group = LearnerGroup(config(tiny_model_dir, zero_stage=stage, precision=precision), num_learners=learners)
    try:
        m = group.update(fixed_batch, ADV)
        digests = learner_digests(group)
    finally:
        group.shutdown()
    # four epochs over the same batch against the policy at its start: the surrogate goes down
    assert m["loss_last"] < m["loss_first"]
    assert len(set(digests)) == 1  # every learner holds the same weights, bit for bit


def test_one_and_two_learners_compute_the_same_update(ray_cluster, tiny_model_dir, fixed_batch):
    losses, weights = [], []
    for n in (1, 2):
        group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1), num_learners=n)
        try:
            start = group.get_weights()
            m = group.update(fixed_batch, ADV)
            weights.append(group.get_weights())
        finally:
            group.shutdown()
        losses.append((m["loss"], m["tokens"]))
    # the loss is normalized by the global token count, whatever the split across learners
    assert losses[0][1] == losses[1][1]
    assert losses[0][0] == pytest.approx(losses[1][0], abs=1e-6)
    # and so is the gradient: the same weights after the update (Adam's first step moves each
    # weight by about lr = 1e-3; two learners only sum the gradient in another order)
    assert weights[0].keys() == weights[1].keys()
    moved = max(float(np.abs(weights[0][k] - start[k]).max()) for k in start)
    assert moved > 5e-4
    for name in weights[0]:
        np.testing.assert_allclose(weights[1][name], weights[0][name], rtol=0, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("lora", [None, {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}])
def test_gradient_checkpointing_computes_the_same_update(ray_cluster, tiny_model_dir, fixed_batch, lora):
    """training.gradient_checkpointing recomputes the layers in backward: the same update (one
    row per micro-batch: no forward shares a prompt, the same forward either way; sharing is
    the test below)."""
    weights, flags = [], []
    for on in (False, True):
        group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, lr=0.01, lora=lora, micro_batch_tokens=1,
                                    gradient_checkpointing=on), num_learners=1)
        try:
            flags.append(ray_cluster.get(group.learners[0].__ray_call__.remote(
                lambda lr: (lr.engine.module.is_gradient_checkpointing, lr.engine.module.training))))
            group.update(fixed_batch, ADV)
            weights.append(group.get_weights())
        finally:
            group.shutdown()
    assert flags == [(False, True), (True, True)]  # on where asked, and in train mode (else it is a no-op)
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        np.testing.assert_allclose(weights[1][name], weights[0][name], rtol=0, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_packed_shared_and_padded_forwards_give_one_loss_and_gradient(ray_cluster, tiny_model_dir, fixed_batch,
                                                                      stage):
    """The batch's 16 rows share one prompt: the packed forward (learners/packing.py, the
    default), the shared one through a cache (learners/shared_prompts.py, packing off) and the
    plain padded one (gradient checkpointing turns sharing off, not packing) give the same loss
    and gradient norm, up to float rounding; the packed one computes the fewest padded positions."""
    metrics = []
    for packing, checkpointing in ((True, False), (False, False), (False, True), (True, True)):
        group = LearnerGroup(config(tiny_model_dir, zero_stage=stage, epochs=1, packing=packing,
                                    gradient_checkpointing=checkpointing), num_learners=1)
        try:
            shares = ray_cluster.get(group.learners[0].__ray_call__.remote(shares_prompts, fixed_batch))
            assert shares is not checkpointing
            metrics.append(group.update(fixed_batch, ADV))
        finally:
            group.shutdown()
    for m in metrics[1:]:
        for key in ("loss_first", "pg_loss", "entropy", "grad_norm"):
            assert metrics[0][key] == pytest.approx(m[key], rel=1e-5, abs=1e-7), key
    packed, shared, plain, checkpointed = (m["padding_fraction"] for m in metrics)
    assert packed < 0.1 and packed < shared and packed < plain and checkpointed == packed, metrics


def shares_prompts(learner, groups) -> bool:
    """(On a learner actor) whether its forward over these groups' rows shares their prompts."""
    from gdpo_ray.groups import read_rows
    from learners.rows import rows_of

    return learner._prompt_sharing(learner.engine, rows_of(read_rows(groups), ADV)) is not None


def test_checkpoint_round_trip(ray_cluster, tiny_model_dir, fixed_batch, tmp_path):
    group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1), num_learners=1)
    try:
        group.update(fixed_batch, ADV)
        group.save_checkpoint(str(tmp_path))
        saved = learner_digests(group) + optimizer_digests(group)
        group.update(fixed_batch, ADV)
        assert learner_digests(group) != saved[:1]
        assert group.load_checkpoint(str(tmp_path)) == 1
        assert learner_digests(group) + optimizer_digests(group) == saved
    finally:
        group.shutdown()


def test_weights_reach_the_rollout_actors(ray_cluster, tiny_model_dir, fixed_batch):
    # a large step, so that the random tiny model's greedy choice moves
    learners = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=1, lr=0.05), num_learners=2)
    rollouts = two_rollout_actors(tiny_model_dir)
    prompts = ["What is 1 + 1?", "Name a color.", "Count to three."]
    try:
        before = actor_digests(rollouts.receivers())
        greedy_before = ray_cluster.get(rollouts.slots[0].handle.__ray_call__.remote(actor_greedy, prompts, 8))
        for _ in range(3):
            learners.update(fixed_batch, ADV)
        weights = learners.get_weights()  # rank 0 gathers the ZeRO-3 shards
        rollouts.set_weights(1, ray_cluster.put(weights))
        after = actor_digests(rollouts.receivers(), rollouts.version)
        greedy_after = ray_cluster.get([s.handle.__ray_call__.remote(actor_greedy, prompts, 8)
                                        for s in rollouts.slots])
        learner_digest = learner_digests(learners)[0]
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert before[0] != learner_digest
    assert after == [learner_digest, learner_digest]
    # the greedy output follows: every actor decodes as the learner's weights do, not as before
    expected = greedy_with(tiny_model_dir, weights, prompts, 8)
    assert greedy_after == [expected, expected] and expected != greedy_before


def _learner_logprobs(learner, groups):
    from gdpo_ray.groups import read_rows
    from learners.rows import rows_of

    rows = rows_of(read_rows(groups), np.zeros(sum(g.stop - g.start for g in groups)))
    logp, mask, _ = learner._logprobs(learner.engine, rows)
    return [logp[i, :len(r.response)].detach().numpy() for i, r in enumerate(rows)], mask.sum().item()


@pytest.mark.parametrize("temperature, stage, packing", [(1.0, 2, True), (0.7, 2, True), (0.7, 3, True),
                                                         (0.7, 2, False), (0.7, 3, False)])
def test_learner_logprobs_are_a_plain_forward_pass_per_row(ray_cluster, tiny_model_dir, fixed_batch, temperature,
                                                           stage, packing):
    """The batched logprobs equal each row's own forward pass: through the LM head in slices
    (learners/token_logprobs.py), or under ZeRO-3 (a partitioned head) the plain path."""
    import torch
    from transformers import AutoModelForCausalLM

    learners = LearnerGroup(config(tiny_model_dir, zero_stage=stage, temperature=temperature, packing=packing),
                            num_learners=1)
    try:
        got, tokens = ray_cluster.get(learners.learners[0].__ray_call__.remote(_learner_logprobs, fixed_batch))
        fused = ray_cluster.get(learners.learners[0].__ray_call__.remote(lambda lr: list(lr._fused.values())))
    finally:
        learners.shutdown()
    assert fused == [stage < 3]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batches = [ray_cluster.get(g.ref).slice(g.start, g.stop - g.start) for g in fixed_batch]
    expected = []
    for b in batches:
        for prompt, response in zip(b.column("prompt_token_ids").to_pylist(), b.column("response_token_ids").to_pylist()):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
            steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            expected.append(steps.gather(1, torch.tensor(response)[:, None])[:, 0].numpy())
    assert tokens == sum(len(e) for e in expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-5)


def _turn_batch(ray_cluster, mask_of, tool_logprob=0.0):
    """4 groups x 4 rollouts of random tokens (the seed of ``fixed_batch``), as multi-turn
    rollouts whose tokens ``mask_of(n)`` marks (None: a single-turn record); a tool token's
    rollout logprob is ``tool_logprob``."""
    from gdpo_ray.batch import Turns

    rng = np.random.default_rng(0)
    groups = []
    for p in range(4):
        responses = [rng.integers(3, 300, rng.integers(4, 12)).tolist() for _ in range(4)]
        masks = [mask_of(len(r)) for r in responses]
        logprobs = [[-5.0 if masks[j] is None or masks[j][t] else tool_logprob for t in range(len(r))]
                    for j, r in enumerate(responses)]
        turns = None if masks[0] is None else Turns(masks, [2] * 4, [1] * 4, [0] * 4, [0] * 4)
        groups.append(GroupData(
            prompt_id=str(p), group_id=f"{p}/e0/a0", prompt_token_ids=[1, 5, 7, 9],
            response_token_ids=responses, response_logprobs=logprobs, finish_reasons=["stop"] * 4,
            policy_version=0, rewards=np.zeros((4, 1)), reward_errors=[[""]] * 4, turns=turns))
    batch = build_groups(groups, ["r"])
    ref = ray_cluster.put(batch)
    return [GroupRef(ref, a, b, g, 0) for g, a, b in group_bounds(batch)]


def _tool_mask(n):
    """A tool turn in the middle of the response: tokens 2..3 (and 5 when there is one) not sampled."""
    return [0 if t in (2, 3, 5) else 1 for t in range(n)]


def _loss_gradient(learner, groups):
    """d loss / d logprob per response token, and the loss mask, for the learner's own loss."""
    import torch

    from gdpo_ray.groups import read_rows
    from gdpo_ray.losses import policy_loss
    from learners.rows import rows_of

    rows = rows_of(read_rows(groups), ADV)
    logp, mask, _ = learner._logprobs(learner.engine, rows)
    adv = torch.tensor([r.advantage for r in rows])
    rollout = learner._padded([r.rollout_logprobs for r in rows], logp.shape[1])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, learner.config.loss, rollout_logprobs=rollout)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad.numpy(), mask.numpy(), [len(r.response) for r in rows]


def test_tool_tokens_are_out_of_the_loss(ray_cluster, tiny_model_dir):
    """A multi-turn rollout's tool-turn tokens (response_mask 0): their gradient is exactly zero,
    their rollout logprobs change nothing, they are not counted; a multi-turn record whose
    tokens were all sampled trains exactly as today's single-turn record."""
    plain = _turn_batch(ray_cluster, lambda n: None)
    all_sampled = _turn_batch(ray_cluster, lambda n: [1] * n)
    tools = _turn_batch(ray_cluster, _tool_mask)
    tools_garbage = _turn_batch(ray_cluster, _tool_mask, tool_logprob=-40.0)
    weights, metrics = [], []
    for batch in (plain, all_sampled, tools, tools_garbage):
        group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=2, lr=0.01,
                                    loss=PolicyLossConfig(off_policy={"cap": 2.0})), num_learners=1)
        try:
            if batch is tools:
                grad, mask, lengths = ray_cluster.get(group.learners[0].__ray_call__.remote(_loss_gradient, tools))
            metrics.append(group.update(batch, ADV))
            weights.append(group.get_weights())
        finally:
            group.shutdown()
    for name in weights[0]:
        assert np.array_equal(weights[1][name], weights[0][name]), name  # bitwise: today's update
        assert np.array_equal(weights[3][name], weights[2][name]), name  # tool logprobs play no part
    assert any(not np.array_equal(weights[2][n], weights[0][n]) for n in weights[0])
    assert metrics[1]["loss_first"] == metrics[0]["loss_first"]
    tool = np.zeros_like(mask)
    for i, n in enumerate(lengths):
        tool[i, :n] = np.array(_tool_mask(n)) == 0
    assert tool.sum() > 0 and (grad[tool] == 0.0).all()  # exactly zero
    assert (grad[mask] != 0.0).all() and not mask[tool].any()
    assert metrics[2]["tokens"] == sum(lengths) - tool.sum() < metrics[0]["tokens"] == sum(lengths)


def test_micro_batch_plan_and_group_split():
    # longest first; rows x longest <= budget
    assert plan_micro_batches([5, 10, 3, 8], budget=20) == [[1, 3], [0, 2]]
    assert plan_micro_batches([50], budget=20) == [[0]]  # a row longer than the budget still runs
    assert split_groups([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert split_groups([10, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="every learner needs a group"):
        split_groups([4], 2)


def test_bucketed_push_under_zero3(ray_cluster, tiny_model_dir, fixed_batch):
    bucket = 128 << 10  # above the largest parameter (the 384 x 64 float32 embedding, 96 KiB)
    learners = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=1), num_learners=2)
    rollouts = two_rollout_actors(tiny_model_dir)
    try:
        learners.update(fixed_batch, ADV)
        peak = push_weights(ObjectStoreTransport(learners, bucket), rollouts, version=1).peak_bytes
        after = actor_digests(rollouts.receivers(), rollouts.version)
        versions = ray_cluster.get([s.handle.policy_version.remote() for s in rollouts.slots])
        learner_digest = learner_digests(learners)[0]
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert 0 < peak <= bucket
    assert after == [learner_digest, learner_digest] and versions == [1, 1]
    assert rollouts.buffer.version == 1


def test_pack_and_unpack_buckets():
    import torch

    from gdpo_ray.weights.buckets import pack_buckets, unpack_bucket

    tensors = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(300)),
               ("c", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))]
    buckets = list(pack_buckets(tensors, bucket_bytes=100))
    # a (24 B) alone since b (1,200 B) would overflow; b alone (oversized); c (4 B)
    assert [b["names"] for b in buckets] == [["a"], ["b"], ["c"]]
    out = dict(kv for b in buckets for kv in unpack_bucket(b))
    for name, t in tensors:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_export_as_hugging_face_directory(ray_cluster, tiny_model_dir, fixed_batch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    group = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=1), num_learners=2)
    try:
        group.update(fixed_batch, ADV)
        group.export_hf(str(tmp_path / "policy"))
        weights = group.get_weights()
    finally:
        group.shutdown()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    for name, value in exported.state_dict().items():
        assert torch.equal(value, torch.from_numpy(weights[name])), name
    assert (tmp_path / "policy" / "tokenizer_config.json").exists()


def test_a_bf16_model_is_exported_in_bf16(ray_cluster, tiny_model_dir, fixed_batch, tmp_path):
    # the learners train in fp32 (training.precision) on a bf16 base; the policy keeps the base's dtype
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    group = LearnerGroup(config(str(base), zero_stage=0, epochs=1), num_learners=1)
    try:
        group.update(fixed_batch, ADV)
        group.export_hf(str(tmp_path / "policy"))
        weights = group.get_weights()
        # one learner: no DeepSpeed op probed or built (no C++ compile); the extension cache is
        # this environment's own
        ops, cache, mlflow, muon = ray_cluster.get(group.learners[0].__ray_call__.remote(
            lambda self: (__import__("deepspeed").ops.__compatible_ops__, __import__("os").environ["TORCH_EXTENSIONS_DIR"],
                          "mlflow" in __import__("sys").modules,
                          hasattr(__import__("sys").modules["deepspeed.runtime.zero.muon.original_muon"].muon_update,
                                  "_torchdynamo_orig_callable"))))
    finally:
        group.shutdown()
    from learners.deepspeed_env import extensions_dir

    # ... DeepSpeed's autotuner did not import MLflow (installed with the test extra): 0.9 s; nor
    # did its Muon optimizer's import wrap Muon's kernels in torch.compile: 1.1 s
    assert ops == {} and cache == extensions_dir() and not mlflow and not muon
    with safe_open(tmp_path / "policy" / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
    for name, value in saved.items():
        assert torch.equal(value, torch.from_numpy(weights[name]).to(torch.bfloat16)), name


def test_broadcast_push_over_gloo(ray_cluster, tiny_model_dir, fixed_batch):
    learners = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=1), num_learners=2)
    rollouts = two_rollout_actors(tiny_model_dir)
    try:
        ray_cluster.get([s.starting for s in rollouts.slots])
        transport, digests = BroadcastTransport(learners, 128 << 10), []
        for version in (1, 2):  # the second push reuses the group
            learners.update(fixed_batch, ADV)
            pushed = push_weights(transport, rollouts, version)
            peak = pushed.peak_bytes
            assert pushed.buckets is None and transport.backend == "gloo"
            after = actor_digests(rollouts.receivers(), rollouts.version)
            versions = ray_cluster.get([s.handle.policy_version.remote() for s in rollouts.slots])
            digests.append((after, versions, learner_digests(learners)[0]))
    finally:
        learners.shutdown()
        rollouts.shutdown()
    assert 0 < peak <= 128 << 10
    for version, (after, versions, learner) in zip((1, 2), digests):
        assert after == [learner, learner] and versions == [version, version]
    assert digests[0][2] != digests[1][2]


def test_uneven_shares_with_epochs_and_kl_under_zero3(ray_cluster, tiny_model_dir, fixed_batch):
    # 3 groups of one size and 1 of another: the learners get different micro-batch counts, and the
    # old-policy pass, the mini-batches and the reference model must keep ZeRO-3's collectives in step
    learners = LearnerGroup(config(tiny_model_dir, zero_stage=3, epochs=2, mini_batches=2, micro_batch_tokens=24,
                                   loss=PolicyLossConfig(off_policy={"cap": 2.0}, kl_coef=0.1)), num_learners=2)
    try:
        m = learners.update(fixed_batch[:3], ADV[:12])
        digests = learner_digests(learners)
    finally:
        learners.shutdown()
    assert m["kl"] > 0 and np.isfinite(m["loss"]) and m["tokens"] > 0  # the policy moved off the reference
    assert len(set(digests)) == 1


def test_threads_lent_during_an_update_leave_it_unchanged(ray_cluster, tiny_model_dir, fixed_batch):
    """training.threads_alone: an update that starts on 2 threads, and one turned to 2 while it
    runs (set_threads, in the learner's own concurrency group), end on 2 and compute the same
    update as one thread (to float rounding); the next update starts on num_threads again."""
    weights, ends = [], []
    for lend in (None, "start", "during"):
        group = LearnerGroup(config(tiny_model_dir, zero_stage=2, epochs=1, threads_alone=2), num_learners=1)
        try:
            refs = group.update_async(fixed_batch, ADV, threads=2 if lend == "start" else None)
            if lend == "during":
                group.set_threads(2)
            m = ray_cluster.get(refs)[0]
            weights.append(group.get_weights())
            ends.append(m["threads_end"])
            later = ray_cluster.get(group.update_async(fixed_batch, ADV))[0]  # the next update starts on 1 again
            assert later["threads_end"] == 1
        finally:
            group.shutdown()
    assert ends == [1, 2, 2]
    for other in weights[1:]:
        for name in weights[0]:
            np.testing.assert_allclose(other[name], weights[0][name], rtol=0, atol=1e-6, err_msg=name)
