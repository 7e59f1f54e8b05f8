"""The Arrow record of DESIGN.md §3: built, checked, and padded for the learner."""

import json

import numpy as np
import pyarrow as pa
import pytest

from gdpo_ray.batch import build_group, check_group, reward_names


def group(gid="p/e0/a0", version=3, responses=([5, 6, 7], [8]), rewards=((1.0, np.nan), (0.0, 0.5))):
    return build_group(
        prompt_id=gid.split("/")[0], group_id=gid, prompt_token_ids=[1, 2],
        response_token_ids=[list(r) for r in responses],
        response_logprobs=[[-0.5] * len(r) for r in responses],
        finish_reasons=["stop", "length"], policy_version=version,
        rewards=np.array(rewards, np.float32), reward_errors=[["", "timeout"], ["", ""]],
        reward_names=["format", "correct"], sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0},
        task_columns={"ground_truth": "42"},
    )


def test_schema_and_dtypes():
    b = group()
    s = b.schema
    assert s.names[:12] == ["prompt_id", "group_id", "sample_index", "prompt_token_ids",
                            "response_token_ids", "response_logprobs", "response_length",
                            "finish_reason", "policy_version", "response_versions", "rewards",
                            "reward_errors"]
    assert s.field("response_versions").type == pa.list_(pa.struct([("version", pa.int32()), ("tokens", pa.int32())]))
    # a batch engine's response: one run of its group's version over all its tokens
    assert b.column("response_versions").to_pylist() == [[{"version": 3, "tokens": 3}], [{"version": 3, "tokens": 1}]]
    assert s.field("response_token_ids").type == pa.large_list(pa.int32())
    assert s.field("response_logprobs").type == pa.large_list(pa.float32())
    assert s.field("rewards").type == pa.list_(pa.float32(), 2)
    assert s.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert s.field("policy_version").type == pa.int64()
    assert reward_names(s) == ["format", "correct"]
    assert json.loads(s.metadata[b"gdpo.sampling"])["temperature"] == 0.7
    assert b.column("response_length").to_pylist() == [3, 1]
    assert b.column("ground_truth").to_pylist() == ["42", "42"]
    r = b.column("rewards").flatten().to_numpy().reshape(2, 2)
    assert np.isnan(r[0, 1]) and r[1, 1] == 0.5


def test_response_versions_per_token_and_the_oldest_is_the_group_version():
    from gdpo_ray.batch import GroupData, build_groups

    fields = dict(prompt_id="p", group_id="g", prompt_token_ids=[1], response_token_ids=[[5, 6, 7], [8]],
                  response_logprobs=[[-1.0] * 3, [-1.0]], finish_reasons=["stop", "stop"],
                  rewards=np.zeros((2, 1)), reward_errors=[[""], [""]])
    from gdpo_ray.batch import token_versions

    b = build_groups([GroupData(policy_version=3, response_versions=[[3, 3, 4], [4]], **fields)], ["r"])
    assert b.column("response_versions").to_pylist() == [[{"version": 3, "tokens": 2}, {"version": 4, "tokens": 1}],
                                                         [{"version": 4, "tokens": 1}]]
    assert token_versions(b.column("response_versions")).tolist() == [3, 3, 4, 4]
    assert token_versions(b.slice(1).column("response_versions")).tolist() == [4]
    # a group with per-token versions beside one without (a batch engine's), and an empty response
    other = dict(fields, group_id="h", prompt_id="q", response_token_ids=[[9, 9], []],
                 response_logprobs=[[-1.0] * 2, []])
    b = build_groups([GroupData(policy_version=2, **other),
                      GroupData(policy_version=3, response_versions=[[5, 3, 3], [4]], **fields)], ["r"])
    assert [[(r["version"], r["tokens"]) for r in row] for row in b.column("response_versions").to_pylist()] == \
        [[(2, 2)], [], [(5, 1), (3, 2)], [(4, 1)]]
    assert token_versions(b.slice(2, 2).column("response_versions")).tolist() == [5, 3, 3, 4]
    with pytest.raises(ValueError, match="older than its group's policy_version"):
        build_groups([GroupData(policy_version=4, response_versions=[[3, 3, 4], [4]], **fields)], ["r"])
    # checked group by group: an older group beside it does not hide the error
    older = dict(fields, group_id="h", prompt_id="q")
    with pytest.raises(ValueError, match="older than its group's policy_version"):
        build_groups([GroupData(policy_version=1, **older),
                      GroupData(policy_version=4, response_versions=[[3, 3, 4], [4]], **fields)], ["r"])
    with pytest.raises(ValueError, match="response_versions and response_length disagree"):
        build_groups([GroupData(policy_version=3, response_versions=[[3, 3], [4]], **fields)], ["r"])


def test_a_multi_turn_group_carries_its_mask_and_counts_after_the_rewards():
    from gdpo_ray.batch import GroupData, Turns, build_groups

    fields = dict(prompt_id="p", group_id="g", prompt_token_ids=[1], response_token_ids=[[5, 6, 7, 9], [8]],
                  response_logprobs=[[-1.0, 0.0, 0.0, -1.0], [-1.0]], finish_reasons=["stop", "stop"],
                  policy_version=0, rewards=np.zeros((2, 1)), reward_errors=[[""], [""]],
                  task_columns={"ground_truth": "x"})
    turns = Turns(response_mask=[[1, 0, 0, 1], [1]], num_turns=[2, 1], num_tool_calls=[1, 0], tool_errors=[1, 0],
                  tool_timeouts=[1, 0], prompt_token_ids=[[1, 40], [1, 41, 42]])
    b = build_groups([GroupData(turns=turns, **fields)], ["r"])
    assert b.schema.names[10:] == ["rewards", "reward_errors", "response_mask", "num_turns", "num_tool_calls",
                                   "tool_errors", "tool_timeouts", "ground_truth"]
    assert b.schema.field("response_mask").type == pa.large_list(pa.int8())
    assert b.column("response_mask").to_pylist() == [[1, 0, 0, 1], [1]]
    assert [b.column(c).to_pylist() for c in ("num_turns", "num_tool_calls", "tool_errors", "tool_timeouts")] == [
        [2, 1], [1, 0], [1, 0], [1, 0]]
    assert b.column("prompt_token_ids").to_pylist() == [[1, 40], [1, 41, 42]]  # each rollout's reset text
    same = build_groups([GroupData(turns=Turns([[1, 0, 0, 1], [1]], [2, 1], [1, 0], [0, 0], [0, 0]), **fields)], ["r"])
    assert same.column("prompt_token_ids").to_pylist() == [[1], [1]]
    with pytest.raises(ValueError, match="response_mask and response_length disagree"):
        build_groups([GroupData(turns=Turns([[1, 0], [1]], [2, 1], [1, 0], [0, 0], [0, 0]), **fields)], ["r"])
    with pytest.raises(ValueError, match="only 0 .* and 1"):
        build_groups([GroupData(turns=Turns([[1, 2, 0, 1], [1]], [2, 1], [1, 0], [0, 0], [0, 0]), **fields)], ["r"])
    with pytest.raises(ValueError, match="multi-turn groups or single-turn ones, not both"):
        build_groups([GroupData(turns=turns, **fields), GroupData(**dict(fields, group_id="h"))], ["r"])
    single = build_groups([GroupData(**fields)], ["r"])
    assert "response_mask" not in single.schema.names  # a single-turn record is today's


def test_check_group_names_the_broken_rule():
    b = group()
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        build_group(prompt_id="p", group_id="g", prompt_token_ids=[1], response_token_ids=[[1], [2]],
                    response_logprobs=[[0.0], [0.0]], finish_reasons=["stop", "eos"], policy_version=0,
                    rewards=np.zeros((2, 1)), reward_errors=[[""], [""]], reward_names=["r"])
    with pytest.raises(ValueError, match="a group needs >= 2 rollouts"):
        check_group(b.slice(0, 1))
    bad = b.set_column(b.schema.get_field_index("response_length"), "response_length",
                       pa.array([3, 2], pa.int32()))
    with pytest.raises(ValueError, match="disagree"):
        check_group(bad)
    wrong_type = b.set_column(b.schema.get_field_index("policy_version"),
                              pa.field("policy_version", pa.int32()), pa.array([3, 3], pa.int32()))
    with pytest.raises(ValueError, match="'policy_version' is int32, must be int64"):
        check_group(wrong_type)


def test_group_metadata_is_what_the_payload_holds():
    from gdpo_ray.groups import (GroupRef, describe_groups, finish_reasons, response_lengths,
                                 reward_errors, rewards_matrix)

    a, b = group("a/e0/a0", 1), group("b/e0/a0", 2)
    both = pa.concat_batches([a, b])
    refs = describe_groups(both, ref="obj")
    assert [(g.ref, g.start, g.stop, g.group_id, g.policy_version) for g in refs] == [
        ("obj", 0, 2, "a/e0/a0", 1), ("obj", 2, 4, "b/e0/a0", 2)]
    rewards, index = rewards_matrix(refs)
    assert rewards.shape == (4, 2) and rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, both.column("rewards").to_pylist())
    assert index.tolist() == [0, 0, 1, 1]
    assert [list(e) for e in reward_errors(refs)] == both.column("reward_errors").to_pylist()
    assert response_lengths(refs).tolist() == both.column("response_length").to_pylist()
    assert finish_reasons(refs) == both.column("finish_reason").to_pylist()
    with pytest.raises(ValueError, match="carry no metadata"):
        rewards_matrix([GroupRef(None, 0, 2, "bare", 0)])


def test_several_groups_in_one_batch_are_zero_copy_slices():
    from gdpo_ray.batch import GroupData, build_groups, group_bounds

    groups = [GroupData(prompt_id=p, group_id=f"{p}/e0/a0", prompt_token_ids=[1] * (i + 1),
                        response_token_ids=[[i] * (j + 1) for j in range(3)],
                        response_logprobs=[[-1.0] * (j + 1) for j in range(3)],
                        finish_reasons=["stop"] * 3, policy_version=i,
                        rewards=np.full((3, 1), float(i)), reward_errors=[[""]] * 3,
                        task_columns={"ground_truth": None if i == 0 else str(i)})
              for i, p in enumerate(["a", "b", "c"])]
    batch = build_groups(groups, ["r"])
    assert group_bounds(batch) == [("a/e0/a0", 0, 3), ("b/e0/a0", 3, 6), ("c/e0/a0", 6, 9)]
    assert batch.column("ground_truth").to_pylist() == [None] * 3 + ["1"] * 3 + ["2"] * 3
    second = batch.slice(3, 3)
    assert second.column("rewards").to_pylist() == [[1.0]] * 3
    assert second.column("response_token_ids").to_pylist() == [[1], [1, 1], [1, 1, 1]]
    assert second.column("policy_version").to_pylist() == [1, 1, 1]
    assert second.column("prompt_token_ids").to_pylist() == [[1, 1]] * 3
    # a batch whose group rows are interleaved breaks the contract
    mixed = pa.concat_batches([batch.slice(0, 2), batch.slice(3, 3), batch.slice(2, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        from gdpo_ray.batch import check_groups
        check_groups(mixed)


def test_learner_rows_are_views_of_group_slices():
    from gdpo_ray.batch import GroupData, build_groups
    from learners.rows import rows_of

    groups = [GroupData(prompt_id=p, group_id=p, prompt_token_ids=[i, i + 1],
                        response_token_ids=[[i] * (j + 1) for j in range(2)],
                        response_logprobs=[[-0.5 * i] * (j + 1) for j in range(2)],
                        finish_reasons=["stop"] * 2, policy_version=0, rewards=np.zeros((2, 1)),
                        reward_errors=[[""]] * 2) for i, p in enumerate("abc")]
    batch = build_groups(groups, ["r"])
    rows = rows_of([batch.slice(2, 4)], np.array([1.0, 2.0, 3.0, 4.0]))  # groups b and c
    assert [r.prompt.tolist() for r in rows] == [[1, 2], [1, 2], [2, 3], [2, 3]]
    assert [r.response.tolist() for r in rows] == [[1], [1, 1], [2], [2, 2]]
    assert [r.rollout_logprobs.tolist() for r in rows] == [[-0.5], [-0.5, -0.5], [-1.0], [-1.0, -1.0]]
    assert [r.advantage for r in rows] == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="3 advantages for 4 rollouts"):
        rows_of([batch.slice(2, 4)], np.zeros(3))


def test_ragged_columns_from_lists_arrays_and_empty_rows():
    from gdpo_ray.batch import _ragged

    ids = _ragged([[1, 2], np.array([3], np.int64), [], np.array([4, 5], np.int32)], np.int32, large=True)
    assert ids.type == pa.large_list(pa.int32())
    assert ids.to_pylist() == [[1, 2], [3], [], [4, 5]] and ids.offsets.to_pylist() == [0, 2, 3, 3, 5]
    lps = _ragged([[-0.5], np.array([], np.float32), np.array([-1.25, 0.0])], np.float32, large=False)
    assert lps.type == pa.list_(pa.float32()) and lps.to_pylist() == [[-0.5], [], [-1.25, 0.0]]
    assert _ragged([], np.int32, large=True).to_pylist() == []


@pytest.mark.parametrize("values, kind", [
    ([3, -1, 7, 0, 2**40], pa.int64()), ([3, 1, 7, 0, 9], pa.int32()), ([1, 0, 1, 1, 0], pa.int8()),
    ([0.5, float("nan"), -2.25, 1e30, 0.0], pa.float32()), ([0.1, 2.0, -0.0, 3.5, 7.0], pa.float64()),
    ([True, False, True, True, False, False, True, False, True, True], pa.bool_())])
def test_as_numpy_is_to_numpy_on_every_slice(values, kind):
    from gdpo_ray.batch import as_numpy

    array = pa.array(values, kind)
    for start in range(len(values) + 1):
        for stop in range(start, len(values) + 1):
            part = array.slice(start, stop - start)
            got, want = as_numpy(part), part.to_numpy(zero_copy_only=False)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    with_null = pa.array([values[0], None], kind)  # nulls: to_numpy's own conversion
    np.testing.assert_array_equal(as_numpy(with_null), with_null.to_numpy(zero_copy_only=False))


def test_plain_task_values_get_the_type_pyarrow_would_infer():
    from gdpo_ray.batch import _plain_type

    for values in (["a", "b"], [1, 2**40], [0.5, 1.0], [True, False], ["a", None], [1, 2.5],
                   [[1, 2], [3]], [{"k": 1}], [None, None]):
        assert pa.array(values, _plain_type(values)).equals(pa.array(values))
    assert _plain_type(["a", None]) is None and _plain_type([1, 2.5]) is None


ACTOR_PATH = """
import sys
import numpy as np
from gdpo_ray.batch import GroupData, arrow_without_pandas, build_groups, check_groups
from gdpo_ray.groups import describe_groups
from learners.rows import rows_of

arrow_without_pandas()
groups = [GroupData(prompt_id=p, group_id=p, prompt_token_ids=[1, 2], response_token_ids=[[3], [4, 5]],
                    response_logprobs=[[-0.5], [-1.0, -2.0]], finish_reasons=["stop", "length"],
                    policy_version=0, rewards=np.zeros((2, 1)), reward_errors=[[""]] * 2,
                    task_columns={"ground_truth": "42", "n": 7}) for p in "ab"]
batch = build_groups(groups, ["r"])
check_groups(batch)
describe_groups(batch)
rows_of([batch], np.zeros(4))
print("pandas" in sys.modules, type(batch.to_pandas()).__name__)
"""


def test_the_actors_paths_do_not_import_pandas_and_to_pandas_still_works():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ACTOR_PATH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "DataFrame"]
