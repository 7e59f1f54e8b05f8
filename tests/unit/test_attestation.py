"""Weight digests and the push ledger (issue 30; order-aware since issue 50): additive digests by
offset; every sent tensor must be reported once; a push is counted attested only when its reports
match."""

import numpy as np
import pytest
import torch

from actors.attestation import PushLedger, WeightPushFailed
from gdpo_ray.weights.buckets import pack_buckets, pack_flat_buckets
from gdpo_ray.weights.digest import BASE, FUSED, MOD, Sent, combine, compare, digest, digest_as, digest_raw


def test_a_digest_adds_over_concatenation_by_offset_and_sees_every_bit():
    """Exact arithmetic of the digest: tests/unit/test_digest.py. Here what attestation relies on."""
    a, b, c = torch.randn(7, 3), torch.randn(2, 3), torch.randn(5, 3)
    assert digest(a) == digest(a.numpy())
    assert digest(torch.cat([a, b, c])) == combine([digest(a), digest(b), digest(c)], [21, 6, 15])
    assert digest(torch.cat([a, torch.zeros(4, 3)])) == digest(a)  # zero padding adds nothing
    assert digest_as(a, "bfloat16") == digest(a.bfloat16()) != digest(a)
    assert digest_raw(a.contiguous().view(-1).view(torch.uint8).numpy(), "float32", (7, 3)) == digest(a)
    flipped = a.clone()
    flipped.view(-1).view(torch.int32)[5] ^= 1  # one bit of one element
    assert digest(flipped) != digest(a)
    assert digest(a.flip(0)) != digest(a)  # the same values in other rows


def test_buckets_carry_the_digest_of_every_tensor_they_pack():
    tensors = [("a", torch.randn(300)), ("b", torch.randn(10, 10).bfloat16()), ("c", torch.randn(50))]
    sent = Sent()
    for bucket in pack_buckets(tensors, 1024):
        sent.add_bucket(bucket)
    assert sent.digests == {n: digest(t) for n, t in tensors}
    assert sent.shapes == {"a": (300,), "b": (10, 10), "c": (50,)}
    assert sent.count == 2 and sent.buckets == {"a": 0, "b": 1, "c": 1}
    assert sent.bytes == sum(t.numel() * t.element_size() for _, t in tensors) and sent.peak_bytes == 1200
    flat = torch.randn(100)
    raw = flat.view(torch.uint8).numpy()
    entries = [(0, "x", "float32", (40,), 160), (160, "y", "float32", (60,), 240), (160, "y2", "float32", (6, 10), 240)]
    digests = {n: d for b in pack_flat_buckets(raw, entries, 1 << 20) for n, d in zip(b["names"], b["digests"])}
    assert digests == {"x": digest(flat[:40]), "y": digest(flat[40:]), "y2": digest(flat[40:].reshape(6, 10))}
    assert digests["y"] != digests["y2"]  # the same bytes as another shape


def test_compare_covers_every_sent_tensor_exactly_once():
    sent = {"q": 5, "k": 7, "v": 11, "o": 13}
    shapes = {"q": (2, 1), "k": (1, 1), "v": (1, 1), "o": (1, 1)}
    qkv = (5 + 7 * pow(BASE, 2, MOD) + 11 * pow(BASE, 3, MOD)) % MOD  # k after q's 2 elements, v after 3
    assert compare(sent, {f"q{FUSED}k{FUSED}v": qkv, "o": 13}, shapes=shapes) == []
    assert compare(sent, {"q+k+v": qkv + 1, "o": 13}, shapes=shapes) == [
        "q+k+v: the engine holds other values than were sent"]
    assert compare(sent, {"q+k+v": 23, "o": 13}, shapes=shapes) == [  # 5 + 7 + 11: not where they sit
        "q+k+v: the engine holds other values than were sent"]
    assert compare(sent, {"o": 13}) == ["q (and 2 more): not reported as held by the engine"]
    assert compare(sent, {"q+k+v": qkv, "o": 13, "x": 1}, shapes=shapes) == [
        "x: the engine reports a tensor the push did not send (x)"]


def _sent(values: dict, per_bucket: int = 2) -> Sent:
    sent = Sent()
    names = list(values)
    for i in range(0, len(names), per_bucket):
        part = names[i:i + per_bucket]
        sent.add(part, ["float32"] * len(part), [values[n] for n in part], 8 * len(part))
    return sent


def test_the_ledger_counts_a_push_attested_and_names_what_differs():
    ledger = PushLedger()
    ledger.expect(1, _sent({"a": 1, "b": 2, "c": 3}))
    ledger.report("rollout actor 0", 1, {"version": 1, "digests": {"a": 1, "b": 2, "c": 3}})
    assert ledger.attested == 1
    ledger.expect(2, _sent({"a": 4, "b": 5, "c": 6}))
    with pytest.raises(WeightPushFailed) as err:
        ledger.report("rollout actor 1", 2, {"version": 2, "digests": {"a": 4, "b": 5, "c": 7}})
    assert str(err.value).startswith("rollout actor 1 does not hold the weights version 2 it was sent: "
                                     "c: the engine holds other values than were sent (bucket 1 of 2)")
    with pytest.raises(WeightPushFailed, match=r"a \(and 2 more\): not reported as held by the engine "
                                               r"\(bucket 0 of 2\)"):
        ledger.report("rollout actor 1", 2, {"version": 2, "digests": {}})
    assert ledger.attested == 1


def test_a_skipped_version_is_no_failure_and_a_version_pushed_again_is_checked_against_its_own_push():
    ledger = PushLedger()
    ledger.expect(3, _sent({"a": 1}))
    ledger.report("rollout actor 0", 3, {"version": 4, "digests": None})  # held a newer one already
    assert ledger.attested == 0
    ledger.expect(3, _sent({"a": 2}))  # after a learner recovery: version 3 again, other weights
    ledger.report("rollout actor 0", 3, {"version": 3, "digests": {"a": 2}})
    with pytest.raises(WeightPushFailed):
        ledger.report("rollout actor 0", 3, {"version": 3, "digests": {"a": 1}})
    assert ledger.attested == 1


def test_an_engine_holding_a_float32_push_in_bfloat16_matches_the_rounded_digest():
    t = torch.randn(1000)
    sent = Sent()
    for bucket in pack_buckets([("w", t)], 1 << 20, variants=("bfloat16", "float16")):
        sent.add_bucket(bucket)
    held = t.to(torch.bfloat16)  # what a bfloat16 engine keeps of it
    assert digest_as(held, "float32") != sent.digests["w"]
    assert compare(sent.digests, {"w": digest_as(held, "float32")}, sent.rounded) == []
    assert compare(sent.digests, {"w": digest_as(held, "float32")}) != []  # without the variants: a mismatch
    stale = torch.randn(1000).to(torch.bfloat16)  # an engine that kept other weights
    assert compare(sent.digests, {"w": digest_as(stale, "float32")}, sent.rounded) != []


def test_an_engine_that_cannot_read_back_is_warned_about_once_and_not_counted(caplog):
    ledger = PushLedger()
    for version in (1, 2):
        ledger.expect(version, _sent({"a": version}))
        ledger.report("rollout actor 0", version, {"version": version, "digests": None,
                                                   "unverified": "two vLLM workers"})
    assert ledger.attested == 0
    warned = [r.getMessage() for r in caplog.records if "cannot read back" in r.getMessage()]
    assert warned == ["rollout actor 0 cannot read back the weights it holds (two vLLM workers): its pushes "
                      "are loaded but not attested (weights/attested does not count them)"]
