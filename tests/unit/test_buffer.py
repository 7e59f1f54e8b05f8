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
