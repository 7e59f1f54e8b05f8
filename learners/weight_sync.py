"""Weights out: the learners' parameters to every rollout actor, in buckets of bounded size.

Object-store path (CPU, and any cluster): learner rank 0 packs parameters, gathered one at a
time under ZeRO-3, into buckets of at most ``bucket_bytes`` (a single larger parameter travels
alone) and puts each bucket once into Ray's object store; every rollout actor reads the buckets
zero-copy and copies them into its engine. Peak extra memory on the learner is one bucket; no
whole model is ever gathered into one tensor.

A bucket is ``{"names": [...], "dtypes": [...], "shapes": [...], "offsets": [...], "data":
uint8 array}``: raw bytes, so that bf16 travels as bf16.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np


def pack_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[dict]:
    """Buckets of at most ``bucket_bytes`` (one oversized tensor makes a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    names, dtypes, shapes, chunks, size = [], [], [], [], 0

    def flush() -> dict:
        offsets = np.cumsum([0] + [len(c) for c in chunks]).tolist()
        data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        return {"names": list(names), "dtypes": list(dtypes), "shapes": list(shapes),
                "offsets": offsets, "data": data}

    for name, tensor in named_tensors:
        raw = tensor.detach().cpu().contiguous().view(-1).view(_uint8()).numpy()
        if chunks and size + len(raw) > bucket_bytes:
            yield flush()
            names, dtypes, shapes, chunks, size = [], [], [], [], 0
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(tuple(tensor.shape))
        chunks.append(raw.copy())  # the gathered ZeRO-3 parameter is released after this
        size += len(raw)
    if chunks:
        yield flush()


def unpack_bucket(bucket: dict) -> list[tuple[str, Any]]:
    """(name, tensor) views of a bucket's bytes (read-only views when it came from the store)."""
    import warnings

    import torch

    data = bucket["data"]
    out = []
    with warnings.catch_warnings():  # tensors over read-only object-store memory: only read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(memoryview(data), dtype=torch.uint8) if len(data) else torch.zeros(0, dtype=torch.uint8)
    for name, dtype, shape, a, b in zip(bucket["names"], bucket["dtypes"], bucket["shapes"],
                                        bucket["offsets"][:-1], bucket["offsets"][1:]):
        out.append((name, flat[a:b].view(getattr(torch, dtype)).view(shape)))
    return out


def _uint8():
    import torch

    return torch.uint8
