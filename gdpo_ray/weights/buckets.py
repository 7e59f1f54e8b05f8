"""The weight wire format: a model's parameters in buckets of bounded size.

A bucket is ``{"names", "dtypes", "shapes", "arrays"}`` with one uint8 array of raw bytes per
tensor (``pack_buckets``: bf16 travels as bf16, nothing is concatenated), or one array over a
byte range of a flat buffer with ``offsets`` locating its tensors (``pack_flat_buckets``:
DeepSpeed's flat parameter storage under ZeRO-1/2, written into the object store at memory-copy
speed); with ``digests`` (and ``rounded``), each tensor's digest (``gdpo_ray.weights.digest``: of
its values, their positions and its shape, for the attestation of every push), taken from the
bucket's own bytes (``bucket_digests``) as it is packed, or afterwards (a sender digests the copy
it wrote into the object store while the receivers load it). A single tensor larger than the
bucket size travels alone. Peak extra memory on the sender is one bucket; no whole model is ever gathered into one tensor. Every transport
(``gdpo_ray.run.transports``) carries these buckets, or tensors in the same order.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from gdpo_ray.weights.digest import digest_raw, numel, rounded_digests
from gdpo_ray.weights.dtypes import itemsize, numpy_dtype


def pack_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int,
                 on_device: bool = False, variants: Sequence[str] = (), digests: bool = True) -> Iterator[dict]:
    """Buckets of at most ``bucket_bytes`` (one oversized tensor makes a bucket of its own).

    A bucket holds byte views of the tensors, not a copy: ``ray.put`` writes them once into the
    object store. (A ZeRO-3 parameter arrives as a gathered copy that the bucket keeps.) The
    views are numpy arrays on the host, or with ``on_device`` uint8 torch tensors left on the
    tensors' device (CUDA buckets for an NCCL broadcast). ``digests``: each tensor digested as
    it is packed; ``variants``: the lower precisions whose ``rounded_digests`` each float32
    tensor's entry also gets (``rounded``)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    bucket, size = _empty(), 0
    for name, tensor in named_tensors:
        flat = tensor.detach() if on_device else tensor.detach().cpu()
        raw = flat.contiguous().view(-1).view(_uint8())
        raw = raw if on_device else raw.numpy()
        if bucket["names"] and size + raw.nbytes > bucket_bytes:
            yield _digested(bucket, digests, variants)
            bucket, size = _empty(), 0
        bucket["names"].append(name)
        bucket["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
        bucket["shapes"].append(tuple(tensor.shape))
        bucket["arrays"].append(raw)
        size += raw.nbytes
    if bucket["names"]:
        yield _digested(bucket, digests, variants)


def pack_flat_buckets(flat: np.ndarray, entries: Sequence[tuple[int, str, str, tuple, int]],
                      bucket_bytes: int, variants: Sequence[str] = (), digests: bool = True) -> Iterator[dict]:
    """Buckets over one contiguous byte buffer in which the tensors already live (DeepSpeed's
    flat parameter buffers under ZeRO-1/2): each bucket is ONE view of a byte range, ``offsets``
    locate its tensors. ``entries``: (byte offset, name, dtype, shape, nbytes); tied names share
    an offset. One large array per bucket is written into the object store at memory-copy speed,
    where hundreds of small views are not. ``digests``, ``variants``: as ``pack_buckets``'."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    bucket, start, end = None, 0, 0
    for offset, name, dtype, shape, nbytes in sorted(entries, key=lambda e: (e[0], e[1])):
        grows = offset + nbytes > end  # a tied name inside the current range costs nothing
        if bucket is not None and bucket["names"] and grows and offset + nbytes - start > bucket_bytes:
            bucket["arrays"] = [flat[start:end]]
            yield _digested(bucket, digests, variants)
            bucket = None
        if bucket is None:
            bucket = {"names": [], "dtypes": [], "shapes": [], "offsets": []}
            start = end = offset
        bucket["names"].append(name)
        bucket["dtypes"].append(dtype)
        bucket["shapes"].append(tuple(shape))
        bucket["offsets"].append(offset - start)
        end = max(end, offset + nbytes)
    if bucket is not None and bucket["names"]:
        bucket["arrays"] = [flat[start:end]]
        yield _digested(bucket, digests, variants)


def _empty() -> dict:
    return {"names": [], "dtypes": [], "shapes": [], "arrays": []}


def _digested(bucket: dict, digests: bool, variants: Sequence[str]) -> dict:
    if digests:
        bucket["digests"], bucket["rounded"] = bucket_digests(bucket, variants)
    return bucket


def bucket_digests(bucket: dict, variants: Sequence[str] = ()) -> tuple[list[int], list[dict]]:
    """Each tensor's digest and ``rounded_digests`` (``variants``) from a bucket's own bytes
    (numpy arrays on the host, as packed or read back from the object store, or uint8 torch
    tensors on a device)."""
    out, rounded = [], []
    for i, (dtype, shape, offset) in enumerate(zip(bucket["dtypes"], bucket["shapes"], bucket_offsets(bucket))):
        size = numel(shape) * itemsize(dtype)
        raw = bucket["arrays"][0][offset:offset + size] if "offsets" in bucket else bucket["arrays"][i]
        out.append(digest_raw(raw, dtype, shape))
        rounded.append(rounded_digests(raw, dtype, variants, shape))
    return out, rounded


def bucket_bytes_of(bucket: dict) -> int:
    return sum(a.nbytes for a in bucket["arrays"])


def bucket_offsets(bucket: dict) -> list[int]:
    """The byte offset of every tensor of a bucket within its bytes laid end to end (a flat
    bucket's own ``offsets``; tied names share one)."""
    if "offsets" in bucket:
        return [int(o) for o in bucket["offsets"]]
    return np.cumsum([0] + [a.nbytes for a in bucket["arrays"][:-1]], dtype=np.int64).tolist()


def tensor_views(data: Any, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple],
                 offsets: Sequence[int]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views into ``data``, a uint8 torch tensor on any device, at byte
    ``offsets``."""
    import torch

    for name, dtype, shape, offset in zip(names, dtypes, shapes, offsets):
        kind = getattr(torch, dtype)
        size = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        yield name, data[offset:offset + size].view(kind).view(tuple(shape))


def unpack_bucket(bucket: dict, host: bool = False) -> list[tuple[str, Any]]:
    """(name, tensor) views of a bucket's bytes (read-only views when it came from the store);
    ``host``: numpy arrays instead of torch tensors (no torch imported: an engine whose traits
    say it uses none), for the dtypes numpy has."""
    import warnings

    if host:
        return list(_numpy_views(bucket))
    with warnings.catch_warnings():  # tensors over read-only object-store memory: only read
        warnings.simplefilter("ignore", UserWarning)
        if "offsets" in bucket:  # one byte range (pack_flat_buckets)
            return list(tensor_views(_bytes(bucket["arrays"][0]), bucket["names"], bucket["dtypes"],
                                     bucket["shapes"], bucket["offsets"]))
        return [view for name, dtype, shape, raw in zip(bucket["names"], bucket["dtypes"],
                                                         bucket["shapes"], bucket["arrays"])
                for view in tensor_views(_bytes(raw), [name], [dtype], [shape], [0])]


def _numpy_views(bucket: dict) -> Iterator[tuple[str, np.ndarray]]:
    offsets = bucket_offsets(bucket)
    for i, (name, dtype, shape) in enumerate(zip(bucket["names"], bucket["dtypes"], bucket["shapes"])):
        kind = numpy_dtype(dtype, name)
        raw = bucket["arrays"][0] if "offsets" in bucket else bucket["arrays"][i]
        start = offsets[i] if "offsets" in bucket else 0
        size = numel(shape) * itemsize(dtype)
        yield name, raw[start:start + size].view(kind).reshape(tuple(shape))


def _bytes(array: np.ndarray) -> Any:
    import torch

    if not array.nbytes:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(memoryview(array), dtype=torch.uint8)


def _uint8():
    import torch

    return torch.uint8
