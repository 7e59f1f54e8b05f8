"""Weight buckets over a flat buffer (ZeRO-1/2's parameter storage): each bucket is one byte
range, tied names share an offset, and unpacking gives back every tensor exactly."""

import numpy as np
import pytest
import torch

from gdpo_ray.weights.buckets import bucket_bytes_of, pack_flat_buckets, unpack_bucket


def flat_model():
    flat = torch.arange(40, dtype=torch.float32)  # 160 bytes: a (8 floats), b (4x4), c (16)
    views = {"a": flat[0:8], "b": flat[8:24].view(4, 4), "c": flat[24:40], "tied.c": flat[24:40]}
    entries = [(int(v.data_ptr() - flat.data_ptr()), k, "float32", tuple(v.shape), v.numel() * 4)
               for k, v in views.items()]
    return flat, views, entries


@pytest.mark.parametrize("bucket_bytes, sizes", [(1 << 20, [160]), (96, [96, 64]), (64, [32, 64, 64]), (8, [32, 64, 64])])
def test_flat_buckets_are_byte_ranges_and_round_trip(bucket_bytes, sizes):
    flat, views, entries = flat_model()
    raw = flat.view(torch.uint8).numpy()
    buckets = list(pack_flat_buckets(raw, entries, bucket_bytes))
    assert [bucket_bytes_of(b) for b in buckets] == sizes  # a tensor larger than the bucket travels alone
    assert all(len(b["arrays"]) == 1 and np.shares_memory(b["arrays"][0], raw) for b in buckets)
    got = {name: t for b in buckets for name, t in unpack_bucket(b)}
    assert set(got) == set(views)
    for name, view in views.items():
        assert torch.equal(got[name], view) and got[name].shape == view.shape
    # tied names land in the same bucket at the same offset
    bucket = next(b for b in buckets if "c" in b["names"])
    assert "tied.c" in bucket["names"]
    assert bucket["offsets"][bucket["names"].index("c")] == bucket["offsets"][bucket["names"].index("tied.c")]


@pytest.mark.parametrize("flat_buffer", [True, False])
def test_digests_of_a_buckets_own_bytes_are_those_taken_while_packing(flat_buffer):
    """A sender digests the copies it wrote into the object store (``bucket_digests``, with the
    rounded variants), packed without digests: the same values as digesting while packing, on
    flat buckets (byte ranges, tied names) and on per-tensor ones (a bfloat16 tensor too)."""
    from gdpo_ray.weights.buckets import bucket_digests, pack_buckets

    flat, views, entries = flat_model()
    flat.copy_(torch.randn(40))
    variants = ("bfloat16", "float16")
    if flat_buffer:
        raw = flat.view(torch.uint8).numpy()
        packed = list(pack_flat_buckets(raw, entries, 64, variants))
        bare = list(pack_flat_buckets(raw, entries, 64, variants, digests=False))
    else:
        tensors = list(views.items()) + [("h", torch.randn(3, 5).bfloat16())]
        packed = list(pack_buckets(tensors, 64, variants=variants))
        bare = list(pack_buckets(tensors, 64, variants=variants, digests=False))
    assert len(bare) == len(packed) > 1 and all("digests" not in b for b in bare)
    taken = [bucket_digests(without, variants) for without in bare]
    assert [d for d, _ in taken] == [b["digests"] for b in packed]
    assert [r for _, r in taken] == [b["rounded"] for b in packed]
    assert sum(bool(x) for _, r in taken for x in r) == 4  # every float32 tensor has them, bfloat16 none
