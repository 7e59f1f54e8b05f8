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


class WeightBroadcast:
    """A bucketed broadcast from learner rank 0 (rank 0 here) to the rollout actors (ranks 1..n)
    over its own gloo group (NCCL on GPU uses the same calls): a TCPStore rendezvous and a
    ProcessGroupGloo constructed directly, apart from the learners' DeepSpeed group.

    Per bucket rank 0 broadcasts [header bytes, data bytes], the pickled header (names, dtypes,
    shapes, sizes) and the bucket's bytes; [0, 0] ends a push. Receivers yield (name, tensor)
    lazily, so an engine loads the whole push in one pass with one bucket in memory."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s))
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))

    def _broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([tensor], opts).wait()

    def send(self, buckets: Iterable[dict]) -> int:
        """Rank 0: every bucket, then the end mark; returns the largest bucket's bytes."""
        import pickle

        import torch

        peak = 0
        for bucket in buckets:
            header = pickle.dumps({k: bucket[k] for k in ("names", "dtypes", "shapes")}
                                  | {"sizes": [a.nbytes for a in bucket["arrays"]]})
            data = np.concatenate(bucket["arrays"]) if bucket["arrays"] else np.zeros(0, np.uint8)
            peak = max(peak, data.nbytes)
            self._broadcast(torch.tensor([len(header), data.nbytes], dtype=torch.int64))
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            self._broadcast(torch.from_numpy(data))
        self._broadcast(torch.zeros(2, dtype=torch.int64))
        return peak

    def receive(self) -> Iterator[tuple[str, Any]]:
        """Ranks 1..n: (name, tensor) of every parameter of one push, bucket by bucket."""
        import pickle

        import torch

        while True:
            sizes = torch.zeros(2, dtype=torch.int64)
            self._broadcast(sizes)
            header_len, data_len = (int(x) for x in sizes)
            if header_len == 0:
                return
            header = torch.empty(header_len, dtype=torch.uint8)
            self._broadcast(header)
            meta = pickle.loads(header.numpy().tobytes())
            data = torch.empty(data_len, dtype=torch.uint8)
            self._broadcast(data)
            offsets = np.cumsum([0] + meta["sizes"])
            for name, dtype, shape, a, b in zip(meta["names"], meta["dtypes"], meta["shapes"],
                                                offsets[:-1], offsets[1:]):
                yield name, data[a:b].view(getattr(torch, dtype)).view(shape)
