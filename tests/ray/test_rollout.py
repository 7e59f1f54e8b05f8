"""Rollout actors on a local Ray cluster: real actors, a tiny model, faults and resizing."""

import time

import numpy as np
import pytest

from actors.buffer import ArrowBuffer
from actors.prompts import PromptSource
from actors.rollout_group import RolloutGroup
from gdpo_ray.groups import read_groups, read_rows
from gdpo_ray.batch import check_group, reward_names

ROWS = [{"prompt": f"What is {a} + {b}?", "ground_truth": str(a + b)} for a in range(4) for b in range(4)]
REWARDS = [{"name": "short", "fn": "length", "params": {"limit": 12}},
           {"name": "math", "fn": "math_correctness"}]
G = 4


def make_group(model_dir, num_actors=2, groups_per_step=4, max_staleness=1, seed=0):
    prompts = PromptSource(ROWS, seed=seed)
    buffer = ArrowBuffer(groups_per_step=groups_per_step, max_staleness=max_staleness)
    kwargs = dict(model_path=model_dir, rewards=REWARDS, group_size=G, sampling={"max_tokens": 16})
    return RolloutGroup(kwargs, num_actors, prompts, buffer, prompts_per_call=2, num_cpus=1)


def train_step(group, version, weights):
    """What the driver does with a batch (minus the learner): mark trained, push weights."""
    taken = group.buffer.take(group.buffer.groups_per_step)
    # the payload is readable, also for groups delivered by an actor that died since
    for g, batch in zip(taken, read_groups(taken)):
        assert batch.column("group_id")[0].as_py() == g.group_id
    group.prompts.mark_trained([g.group_id for g in taken])
    group.on_update(version, weights)
    return taken


def test_emitted_groups_follow_the_schema(ray_cluster, tiny_model_dir):
    group = make_group(tiny_model_dir)
    try:
        group.wait_for(4, timeout=180)
        taken = group.buffer.take(4)
        batches = read_groups(taken)
    finally:
        group.shutdown()
    for g, b in zip(taken, batches):
        check_group(b)
        # the metadata the driver reads in place of the payload is the payload's
        np.testing.assert_array_equal(g.rewards, b.column("rewards").flatten().to_numpy().reshape(G, 2))
        assert [list(e) for e in g.reward_errors] == b.column("reward_errors").to_pylist()
        assert g.response_length.tolist() == b.column("response_length").to_pylist()
        assert list(g.finish_reason) == b.column("finish_reason").to_pylist()
        assert b.num_rows == G and reward_names(b.schema) == ["short", "math"]
        lengths = b.column("response_length").to_numpy()
        assert np.array_equal(lengths, [len(x) for x in b.column("response_token_ids").to_pylist()])
        rewards = b.column("rewards").flatten().to_numpy().reshape(G, 2)
        assert np.array_equal(rewards[:, 0], (lengths <= 12).astype(np.float32))  # the length reward
        assert set(rewards[:, 1]) <= {0.0, 1.0}
        assert b.column("reward_errors").to_pylist() == [["", ""]] * G
        assert b.column("policy_version").to_pylist() == [0] * G
        assert set(b.column("finish_reason").to_pylist()) <= {"stop", "length"}
        assert b.column("ground_truth")[0].as_py() in {r["ground_truth"] for r in ROWS}


def test_stale_groups_are_dropped_and_their_prompts_reissued(ray_cluster, tiny_model_dir, tiny_weights):
    group = make_group(tiny_model_dir, num_actors=1, groups_per_step=2, max_staleness=0)
    try:
        group.wait_for(2, timeout=180)
        first = group.buffer.group_ids()
        group.on_update(1, tiny_weights)  # version 0 groups are too stale for step 1 when eta = 0
        assert len(group.buffer) == 0 and group.buffer.dropped_stale == 2
        assert group.prompts.reissued == 2  # the dropped prompts go out again
        group.wait_for(2, timeout=180)
        again = group.buffer.take(2)
        # a call queued at the actor before the push generated on the old weights is dropped too
        # (and re-issued); one that waited for the push (admission) is kept
        assert {g.policy_version for g in again} == {1}
        assert group.prompts.reissued == 2 + (group.buffer.dropped_stale - 2)
    finally:
        group.shutdown()


def run_epoch(group, weights, during=None, limit_s=240):
    version, deadline = 0, time.monotonic() + limit_s
    while len(group.prompts.outcomes(0)) < len(ROWS):
        group.wait_for(group.buffer.groups_per_step, timeout=180)
        version += 1
        train_step(group, version, weights)
        if during:
            during(version)
        assert time.monotonic() < deadline, f"epoch 0 unfinished after {version} steps: {group.stats}"
    return group.prompts.outcomes(0)


def test_epoch_accounting_with_an_actor_killed(ray_cluster, tiny_model_dir, tiny_weights):
    group = make_group(tiny_model_dir, groups_per_step=4, max_staleness=1)

    killed = []

    def kill_one(version):
        # kill an actor while it is generating (with the buffer full, none may be in flight yet).
        # A kill lands a moment later, and a call may finish meanwhile (nothing to re-issue then):
        # again, up to three kills, until one took prompts with it
        busy = [s for s in group.slots if s.starting is None and s.calls
                and not ray_cluster.wait([c.gen for c in s.calls], timeout=0, fetch_local=False)[0]]
        if len(killed) < 3 and busy and group.stats["reissued"] == 0:
            killed.append(ray_cluster.kill(busy[0].handle))

    try:
        outcomes = run_epoch(group, tiny_weights, during=kill_one)
    finally:
        group.shutdown()
    # every prompt of the epoch trained exactly once (mark_trained raises on a repeat)
    assert sorted(outcomes, key=int) == [str(i) for i in range(len(ROWS))]
    assert set(outcomes.values()) == {"trained"}
    assert killed, "no actor ever held prompts at a step boundary"
    assert group.stats["actor_restarts"] >= 1 and group.stats["reissued"] >= 1


def test_resize_up_and_down_during_a_run(ray_cluster, tiny_model_dir, tiny_weights):
    group = make_group(tiny_model_dir, num_actors=1, groups_per_step=4, max_staleness=1)

    def resize(version):
        if version == 1:
            group.resize(3)
            assert len(group.slots) == 3
        if version == 2:
            group.resize(1)
            assert len(group.slots) == 1

    try:
        outcomes = run_epoch(group, tiny_weights, during=resize)
    finally:
        group.shutdown()
    assert sorted(outcomes, key=int) == [str(i) for i in range(len(ROWS))]
    assert set(outcomes.values()) == {"trained"}


def test_buffer_checkpoint_and_restore(ray_cluster, tiny_model_dir):
    group = make_group(tiny_model_dir, groups_per_step=3)
    try:
        group.wait_for(3, timeout=180)
    finally:
        group.shutdown()
    state = group.buffer.state_dict()
    restored = ArrowBuffer(groups_per_step=3, max_staleness=1)
    restored.load_state_dict(state)
    assert (restored.version, restored.accepted) == (group.buffer.version, group.buffer.accepted)
    original = read_groups(group.buffer.take(3))
    again = read_groups(restored.take(3))
    for a, b in zip(original, again):
        assert a.equals(b) and a.schema.metadata == b.schema.metadata


def test_group_payload_is_read_zero_copy(ray_cluster, tiny_model_dir):
    group = make_group(tiny_model_dir, groups_per_step=2)
    try:
        group.wait_for(2, timeout=180)
        refs = group.buffer.take(2)
    finally:
        group.shutdown()
    batch = ray_cluster.get(refs[0].ref)
    # buffers read from the object store are read-only views of shared memory, not copies
    assert not batch.column("response_token_ids").values.buffers()[1].is_mutable
    (group,) = read_groups(refs[:1])
    assert group.num_rows == G and group.column("group_id")[0].as_py() == refs[0].group_id


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_hf_logprobs_match_a_forward_pass(tiny_model_dir, temperature):
    import torch

    from actors.engines import SamplingParams
    from actors.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir, seed=1)
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    (samples,) = engine.generate([prompt], 3, SamplingParams(temperature=temperature, max_tokens=12))
    for s in samples:
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(s.logprobs, expected.numpy(), atol=1e-4)


def test_generation_in_flight_finishes_on_its_version(ray_cluster, tiny_model_dir, tiny_weights):
    from actors.rollout import RolloutActor

    actor = ray_cluster.remote(RolloutActor).options(num_cpus=1).remote(
        tiny_model_dir, REWARDS, G, sampling={"max_tokens": 8})
    prompts = PromptSource(ROWS).take(4)
    try:
        first = actor.generate.options(num_returns=2).remote(prompts[:2])
        # an async actor runs calls in no set order (Ray's out-of-order execution): the push goes
        # out once the first call has started, and arrives while it runs (a batched call holds the
        # engine: the push waits for it); the next call goes out once the push is in
        deadline = time.monotonic() + 120
        while (not ray_cluster.wait([first[0]], timeout=0, fetch_local=False)[0]
               and ray_cluster.get(actor.engine_stats.remote())["groups"] == 0):
            assert time.monotonic() < deadline, "the first call never started"
            time.sleep(0.005)
        assert ray_cluster.get(actor.set_weights.remote(1, tiny_weights))["version"] == 1
        second = actor.generate.options(num_returns=2).remote(prompts[2:])
        meta1, batch1 = ray_cluster.get(first)
        meta2, batch2 = ray_cluster.get(second)
    finally:
        ray_cluster.get(actor.shutdown.remote())
        ray_cluster.kill(actor)
    # the call that started before the new weights keeps its version; the next one has the new one
    assert {g.policy_version for g in meta1.groups} == {0}
    assert set(batch1.column("policy_version").to_pylist()) == {0}
    assert {g.policy_version for g in meta2.groups} == {1}
    assert set(batch2.column("policy_version").to_pylist()) == {1}


def _engine_loads(actor) -> int:
    return actor.engine.loads


def test_a_users_engine_by_import_path_runs_in_a_rollout_actor(ray_cluster, tiny_model_dir, tiny_weights):
    """generation.engine='package.module:Class': an engine written against actors.engines.
    BatchEngine alone (tests.engines.ScriptedEngine) generates, is scored and takes a weight push
    in a real rollout actor."""
    from actors.rollout import RolloutActor

    actor = ray_cluster.remote(RolloutActor).options(num_cpus=1).remote(
        tiny_model_dir, [{"name": "short", "fn": "length", "params": {"limit": 4}}], G,
        engine="tests.engines:ScriptedEngine", sampling={"max_tokens": 6})
    prompts = PromptSource(ROWS).take(3)
    try:
        meta, batch = ray_cluster.get(actor.generate.options(num_returns=2).remote(prompts[:2]))
        ray_cluster.get(actor.set_weights.remote(1, tiny_weights))
        loads = ray_cluster.get(actor.__ray_call__.remote(_engine_loads))
        meta1, batch1 = ray_cluster.get(actor.generate.options(num_returns=2).remote(prompts[2:]))
    finally:
        ray_cluster.get(actor.shutdown.remote())
        ray_cluster.kill(actor)
    assert [g.group_id for g in meta.groups] == [p.group_id for p in prompts[:2]]
    for start in (0, G):
        b = batch.slice(start, G)
        check_group(b)
        last = b.column("prompt_token_ids")[0].as_py()[-1]
        # sample j: the prompt's last token 2j + 1 times, cut at max_tokens = 6; logprob -(j + 1)
        assert b.column("response_token_ids").to_pylist() == [[last] * n for n in (1, 3, 5, 6)]
        assert b.column("response_logprobs").to_pylist() == [[-1.0], [-2.0] * 3, [-3.0] * 5, [-4.0] * 6]
        assert b.column("finish_reason").to_pylist() == ["stop", "stop", "stop", "length"]
        # the length reward (limit 4): 1 <= 4, 3 <= 4, 5 > 4, 6 > 4
        assert b.column("rewards").flatten().to_pylist() == [1.0, 1.0, 0.0, 0.0]
        assert b.column("policy_version").to_pylist() == [0] * G
    assert loads == 1 and batch1.column("policy_version").to_pylist() == [1] * G


def test_read_rows_coalesces_consecutive_groups_of_one_object(ray_cluster):
    from gdpo_ray.groups import GroupRef
    from gdpo_ray.batch import GroupData, build_groups

    def obj(tag):
        groups = [GroupData(prompt_id=f"{tag}{i}", group_id=f"{tag}{i}", prompt_token_ids=[i],
                            response_token_ids=[[i, j] for j in range(2)],
                            response_logprobs=[[-1.0, -j] for j in range(2)],
                            finish_reasons=["stop"] * 2, policy_version=0, rewards=np.zeros((2, 1)),
                            reward_errors=[[""]] * 2) for i in range(3)]
        return ray_cluster.put(build_groups(groups, ["r"]))

    a, b = obj("a"), obj("b")
    refs = [GroupRef(a, 0, 2, "a0", 0), GroupRef(a, 2, 4, "a1", 0),  # one run: rows 0..4 of a
            GroupRef(b, 4, 6, "b2", 0),  # another object
            GroupRef(a, 4, 6, "a2", 0),  # a again, after b: a new run
            GroupRef(b, 0, 2, "b0", 0)]  # b, but not after row 6: a new run
    runs = read_rows(refs)
    assert [r.num_rows for r in runs] == [4, 2, 2, 2]
    assert [r.column("group_id").to_pylist() for r in runs] == [
        ["a0", "a0", "a1", "a1"], ["b2", "b2"], ["a2", "a2"], ["b0", "b0"]]
    # the same rows, in the same order, as read_groups gives group by group
    assert sum((r.column("response_token_ids").to_pylist() for r in runs), []) == sum(
        (g.column("response_token_ids").to_pylist() for g in read_groups(refs)), [])
    assert read_rows([]) == []


def test_each_actor_samples_its_own_stream(ray_cluster, tiny_model_dir):
    from actors.prompts import PromptSource

    group = make_group(tiny_model_dir, num_actors=2)
    try:
        prompt = PromptSource(ROWS[:1]).take(1)
        ray_cluster.get([s.handle.ready.remote() for s in group.slots])
        batches = [ray_cluster.get(s.handle.generate.options(num_returns=2).remote(prompt)[1])
                   for s in group.slots]
    finally:
        group.shutdown()
    first, second = (b.column("response_token_ids").to_pylist() for b in batches)
    assert first != second  # the same prompt, the same call count, other random numbers
