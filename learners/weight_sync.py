"""Weights out: the learners' parameters to every rollout actor, in buckets of bounded size.

Object-store path (CPU, and any cluster): learner rank 0 packs parameters, gathered one at a
time under ZeRO-3, into buckets of at most ``bucket_bytes`` (a single larger parameter travels
alone) and puts each bucket once into Ray's object store; every rollout actor reads the buckets
zero-copy and copies them into its engine. Peak extra memory on the learner is one bucket; no
whole model is ever gathered into one tensor.

A bucket is ``{"names", "dtypes", "shapes", "arrays"}`` with one uint8 array of raw bytes per
tensor, so that bf16 travels as bf16 and nothing is concatenated.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np


def pack_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[dict]:
    """Buckets of at most ``bucket_bytes`` (one oversized tensor makes a bucket of its own).

    A bucket holds byte views of the tensors, not a copy: ``ray.put`` writes them once into the
    object store. (A ZeRO-3 parameter arrives as a gathered copy that the bucket keeps.)"""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    bucket: dict = {"names": [], "dtypes": [], "shapes": [], "arrays": []}
    size = 0
    for name, tensor in named_tensors:
        raw = tensor.detach().cpu().contiguous().view(-1).view(_uint8()).numpy()
        if bucket["names"] and size + raw.nbytes > bucket_bytes:
            yield bucket
            bucket, size = {"names": [], "dtypes": [], "shapes": [], "arrays": []}, 0
        bucket["names"].append(name)
        bucket["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
        bucket["shapes"].append(tuple(tensor.shape))
        bucket["arrays"].append(raw)
        size += raw.nbytes
    if bucket["names"]:
        yield bucket


def bucket_bytes_of(bucket: dict) -> int:
    return sum(a.nbytes for a in bucket["arrays"])


def unpack_bucket(bucket: dict) -> list[tuple[str, Any]]:
    """(name, tensor) views of a bucket's bytes (read-only views when it came from the store)."""
    import warnings

    import torch

    out = []
    with warnings.catch_warnings():  # tensors over read-only object-store memory: only read
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, raw in zip(bucket["names"], bucket["dtypes"], bucket["shapes"],
                                           bucket["arrays"]):
            flat = torch.frombuffer(memoryview(raw), dtype=torch.uint8) if raw.nbytes else torch.zeros(0, dtype=torch.uint8)
            out.append((name, flat.view(getattr(torch, dtype)).view(shape)))
    return out


def _uint8():
    import torch

    return torch.uint8
