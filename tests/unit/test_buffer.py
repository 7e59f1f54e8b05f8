"""ArrowBuffer admission and staleness arithmetic (references only; no payload needed here)."""

import pytest

from actors.buffer import ArrowBuffer
from gdpo_ray.groups import GroupRef


def refs(versions, start=0):
    return [GroupRef(ref=None, start=4 * i, stop=4 * i + 4, group_id=f"g{start + i}", policy_version=v)
            for i, v in enumerate(versions)]


def test_on_policy_admission():
    # eta = 0, B = 4: at version 0 at most (0 + 0 + 1) * 4 = 4 groups accepted + in flight
    buf = ArrowBuffer(groups_per_step=4, max_staleness=0)
    assert buf.room(in_flight=0) == 4 and buf.room(in_flight=3) == 1
    assert buf.add(refs([0, 0])) == []
    assert buf.room(in_flight=2) == 0
    buf.add(refs([0, 0], start=2))
    assert [g.group_id for g in buf.take(4)] == ["g0", "g1", "g2", "g3"]
    assert buf.room(in_flight=0) == 0  # trained groups still count until the version moves
    buf.set_version(1)
    assert buf.room(in_flight=0) == 4  # (0 + 1 + 1) * 4 - 4 accepted


def test_staleness_drops_and_counts():
    # eta = 1, B = 2: a group of version v may be trained at step s if s - v <= 1
    buf = ArrowBuffer(groups_per_step=2, max_staleness=1)
    buf.add(refs([0, 0, 0]))
    assert buf.room(in_flight=0) == 1  # (1 + 0 + 1) * 2 - 3
    assert buf.set_version(1) == []
    assert buf.set_version(2) == ["g0", "g1", "g2"]  # 2 - 0 > 1: dropped, to re-issue
    assert buf.dropped_stale == 3 and len(buf) == 0 and buf.accepted == 0
    assert buf.add(refs([0], start=9)) == ["g9"]  # arrives already too stale
    assert buf.dropped_stale == 4


def test_release_frees_places_of_filtered_groups():
    buf = ArrowBuffer(groups_per_step=2, max_staleness=0)
    buf.add(refs([0, 0]))
    buf.take(2)
    buf.release(1)  # one of them was filtered out by dynamic sampling
    assert buf.room(in_flight=0) == 1


def test_capacity_is_an_invariant():
    buf = ArrowBuffer(groups_per_step=1, max_staleness=0)
    with pytest.raises(RuntimeError, match="admission was bypassed"):
        buf.add(refs([0, 0]))
    with pytest.raises(ValueError, match="max_staleness"):
        ArrowBuffer(groups_per_step=2, max_staleness=-1)


def test_group_ids_are_the_buffered_groups_oldest_first():
    buffer = ArrowBuffer(groups_per_step=2, max_staleness=1)
    buffer.add([GroupRef(None, 0, 2, "a", 0), GroupRef(None, 2, 4, "b", 0)])
    assert buffer.group_ids() == ["a", "b"]
    buffer.take(1)
    assert buffer.group_ids() == ["b"]


def test_a_short_step_of_dynamic_sampling_keeps_the_buffer_within_capacity():
    """Refills ran out and a step trained fewer than B groups: without counting the shortfall,
    admission let in more groups than the buffer holds (found by the math-length study)."""
    import types

    import numpy as np

    from gdpo_ray.run.sampling import take_groups

    def group(i, rewards):
        return GroupRef(None, 0, 2, f"g{i}", buffer.version, np.asarray(rewards, np.float32)[:, None])

    class Prompts:
        def mark_filtered(self, group_id, why):
            pass

    buffer = ArrowBuffer(groups_per_step=2, max_staleness=1)  # capacity 4
    config = types.SimpleNamespace(prompts_per_step=2, max_refills=1, dynamic_sampling=True,
                                   estimator="gdpo", eps=1e-6)
    rollouts = types.SimpleNamespace(wait_for=lambda n: None)
    buffer.add([group(0, [0, 1]), group(1, [1, 1]), group(2, [0, 0])])  # room at version 0: 4
    kept, dropped = take_groups(config, rollouts, buffer, Prompts(), np.ones(1))
    # round 1 keeps g0 and drops g1; round 2 drops g2; no refills left: a step of 1 group
    assert [g.group_id for g in kept] == ["g0"] and [g.group_id for g in dropped] == ["g1", "g2"]
    assert len(buffer) == 0
    buffer.set_version(1)
    room = buffer.room(in_flight=0)
    assert room == 4  # (1 + 1 + 1) * 2 - accepted (3 admitted - 2 released + 1 short)
    buffer.add([group(10 + i, [0, 1]) for i in range(room)])  # every admitted group arrives
    assert len(buffer) == buffer.capacity
