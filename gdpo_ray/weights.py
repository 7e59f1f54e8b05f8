"""Weights out: the learners' parameters to every rollout actor, in buckets of bounded size
(the wire format and the transports both sides share: the learners send, the rollout actors
receive; ``actors`` and ``learners`` meet here instead of importing each other).

Object-store path (CPU, and any cluster): learner rank 0 packs parameters, gathered one at a
time under ZeRO-3, into buckets of at most ``bucket_bytes`` (a single larger parameter travels
alone) and puts each bucket once into Ray's object store; every rollout actor reads the buckets
zero-copy and copies them into its engine. Peak extra memory on the learner is one bucket; no
whole model is ever gathered into one tensor.

A bucket is ``{"names", "dtypes", "shapes", "arrays"}`` with one uint8 array of raw bytes per
tensor, so that bf16 travels as bf16 and nothing is concatenated.

Broadcast path (``WeightBroadcast``): learner rank 0 and the rollout actors form a group of
their own, over one of three backends that the members agree on when the group is built:
  - ``gloo``: host buckets (as above) over a gloo group; every member can take part;
  - ``nccl``: the same buckets as CUDA tensors over a torch NCCL group (learner and HF engines
    on CUDA);
  - ``vllm``: vLLM engines on CUDA receive through vLLM's own weight-transfer engine (an NCCL
    group of vLLM's making that learner rank 0 joins); one broadcast per tensor.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Iterable, Iterator, Sequence

import numpy as np


def pack_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int,
                 on_device: bool = False) -> Iterator[dict]:
    """Buckets of at most ``bucket_bytes`` (one oversized tensor makes a bucket of its own).

    A bucket holds byte views of the tensors, not a copy: ``ray.put`` writes them once into the
    object store. (A ZeRO-3 parameter arrives as a gathered copy that the bucket keeps.) The
    views are numpy arrays on the host, or with ``on_device`` uint8 torch tensors left on the
    tensors' device (CUDA buckets for an NCCL broadcast)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    bucket: dict = {"names": [], "dtypes": [], "shapes": [], "arrays": []}
    size = 0
    for name, tensor in named_tensors:
        flat = tensor.detach() if on_device else tensor.detach().cpu()
        raw = flat.contiguous().view(-1).view(_uint8())
        raw = raw if on_device else raw.numpy()
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


def pack_flat_buckets(flat: np.ndarray, entries: Sequence[tuple[int, str, str, tuple, int]],
                      bucket_bytes: int) -> Iterator[dict]:
    """Buckets over one contiguous byte buffer in which the tensors already live (DeepSpeed's
    flat parameter buffers under ZeRO-1/2): each bucket is ONE view of a byte range, ``offsets``
    locate its tensors. ``entries``: (byte offset, name, dtype, shape, nbytes); tied names share
    an offset. One large array per bucket is written into the object store at memory-copy speed,
    where hundreds of small views are not."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    bucket, start, end = None, 0, 0
    for offset, name, dtype, shape, nbytes in sorted(entries, key=lambda e: (e[0], e[1])):
        grows = offset + nbytes > end  # a tied name inside the current range costs nothing
        if bucket is not None and bucket["names"] and grows and offset + nbytes - start > bucket_bytes:
            bucket["arrays"] = [flat[start:end]]
            yield bucket
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
        if "offsets" in bucket:  # one byte range (pack_flat_buckets)
            data = bucket["arrays"][0]
            whole = torch.frombuffer(memoryview(data), dtype=torch.uint8) if data.nbytes else torch.zeros(0, dtype=torch.uint8)
            for name, dtype, shape, offset in zip(bucket["names"], bucket["dtypes"], bucket["shapes"],
                                                  bucket["offsets"]):
                kind = getattr(torch, dtype)
                size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=kind).element_size()
                out.append((name, whole[offset:offset + size].view(kind).view(shape)))
            return out
        for name, dtype, shape, raw in zip(bucket["names"], bucket["dtypes"], bucket["shapes"],
                                           bucket["arrays"]):
            flat = torch.frombuffer(memoryview(raw), dtype=torch.uint8) if raw.nbytes else torch.zeros(0, dtype=torch.uint8)
            out.append((name, flat.view(getattr(torch, dtype)).view(shape)))
    return out


def _uint8():
    import torch

    return torch.uint8


# -- choosing a broadcast backend --------------------------------------------------------------

BACKENDS = ("gloo", "nccl", "vllm")
# NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless this
# experimental switch of NCCL >= 2.30 is on (NCCL's environment-variable docs, cited by
# NVIDIA/cuDecomp PR #130). It must be in the environment before the process's first NCCL
# communicator: set it in the Ray runtime_env (or the driver's environment) of the job.
MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"


def receiver_backend(engine: Any) -> str:
    """A rollout engine's proposal: ``vllm`` for an engine on CUDA that offers vLLM's weight
    transfer (``engine.weight_transfer``), ``nccl`` for any other engine on CUDA (the HF
    engine), ``gloo`` on CPU."""
    if not str(getattr(engine, "device", "cpu")).startswith("cuda"):
        return "gloo"
    return "vllm" if getattr(engine, "weight_transfer", False) else "nccl"


def member_info(backend: str) -> dict:
    """What this process brings to the agreement: its proposed backend and, on CUDA, its GPU's
    UUID and whether its NCCL may put a second rank on that GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "gloo":
        return {"backend": "gloo", "gpu": None, "share": False}
    import torch

    version = tuple(torch.cuda.nccl.version()[:2])
    share = os.environ.get(MULTI_RANK_GPU_ENV) == "1" and version >= (2, 30)
    gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return {"backend": backend, "gpu": gpu, "share": share}


def agreed_backend(members: Sequence[dict]) -> str:
    """The backend of a group, from every member's ``member_info`` (rank 0 first): NCCL (the
    receivers' kind, ``nccl`` or ``vllm``) when every member is on CUDA, the receivers are all
    of one kind, and no GPU carries two members unless every member's NCCL allows it; else gloo,
    which every member supports (CUDA engines load host tensors). A pure function: every rank
    computes the same answer from the same proposals."""
    kinds = [m["backend"] for m in members]
    if "gloo" in kinds or len(set(kinds[1:])) > 1:
        return "gloo"
    gpus = [m["gpu"] for m in members]
    if len(set(gpus)) < len(gpus) and not all(m["share"] for m in members):
        return "gloo"
    return kinds[-1]


def free_port() -> int:
    """A port no socket of this host is bound to now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightBroadcast:
    """A bucketed broadcast from learner rank 0 (rank 0 here) to the rollout actors (ranks 1..n)
    over its own group: a TCPStore rendezvous and a process group constructed directly, apart
    from the learners' DeepSpeed group.

    Every rank proposes a backend (``backend``: "gloo" on CPU, "nccl" on CUDA, "vllm" for a vLLM
    engine on CUDA) and all settle on ``self.backend`` (``agreed_backend``) before any group is
    built, so that mismatched members fall back to gloo instead of hanging.

    gloo / nccl: per bucket rank 0 broadcasts [header bytes, data bytes], the pickled header
    (names, dtypes, shapes, sizes) and the bucket's bytes; [0, 0] ends a push. On nccl every
    message is a CUDA tensor. Receivers yield (name, tensor) lazily, so an engine loads the
    whole push in one pass with one bucket in memory.

    vllm: rank 0 opens the TCP rendezvous of vLLM's NCCL weight transfer on a second port
    (``vllm_port``, published in the store) as its rank 0; each receiver's engine joins it with
    ``init_weight_transfer_engine``. Per push the receivers read vLLM's ``update_info`` (names,
    dtypes, full shapes; published once, it cannot change for a model) from the store and rank 0
    broadcasts every tensor in that order (``send_tensors``)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 600) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                   timeout=timedelta(seconds=timeout_s))
        self.backend = self._agree(backend)
        on_cuda = self.backend != "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        self._published: dict | None = None
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timedelta(seconds=timeout_s))
        elif self.backend == "nccl":
            self.group = _nccl_group(self.store, rank, world_size, timedelta(seconds=timeout_s), self.device)
        elif rank == 0:
            self.vllm_port = free_port()
            self.store.set("gdpo/vllm_port", str(self.vllm_port))
            self.group = _vllm_trainer_group(host, self.vllm_port, world_size, self.device)
        else:  # this actor's vLLM engine joins with the port (RolloutActor.join_broadcast)
            self.vllm_port, self.group = int(self.store.get("gdpo/vllm_port")), None

    def _agree(self, backend: str) -> str:
        self.store.set(f"gdpo/member/{self.rank}", json.dumps(member_info(backend)))
        return agreed_backend([json.loads(self.store.get(f"gdpo/member/{r}"))
                               for r in range(self.world_size)])

    def close(self) -> None:
        """Releases an NCCL communicator (before the group is rebuilt); gloo and vLLM groups go
        with their last reference."""
        if self.backend == "nccl":
            self.group.abort()

    def _broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([tensor], opts).wait()

    def _concat(self, arrays: list) -> Any:
        import torch

        if self.backend == "gloo":
            return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, np.uint8))
        return torch.cat(arrays) if arrays else torch.zeros(0, dtype=torch.uint8, device=self.device)

    def send(self, buckets: Iterable[dict]) -> int:
        """Rank 0 of a gloo or nccl group: every bucket (``pack_buckets``; on nccl with
        ``on_device=True``), then the end mark; returns the largest bucket's bytes."""
        import pickle

        import torch

        peak = 0
        for bucket in buckets:
            header = pickle.dumps({k: bucket[k] for k in ("names", "dtypes", "shapes")}
                                  | {"sizes": [a.nbytes for a in bucket["arrays"]]})
            data = self._concat(bucket["arrays"])
            peak = max(peak, data.nbytes)
            self._broadcast(torch.tensor([len(header), data.nbytes], dtype=torch.int64, device=self.device))
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
            self._broadcast(data)
        self._broadcast(torch.zeros(2, dtype=torch.int64, device=self.device))
        return peak

    def receive(self) -> Iterator[tuple[str, Any]]:
        """Ranks 1..n of a gloo or nccl group: (name, tensor) of every parameter of one push,
        bucket by bucket (tensors on this member's device)."""
        import pickle

        import torch

        while True:
            sizes = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._broadcast(sizes)
            header_len, data_len = sizes.tolist()
            if header_len == 0:
                return
            header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
            self._broadcast(header)
            meta = pickle.loads(header.cpu().numpy().tobytes())
            data = torch.empty(data_len, dtype=torch.uint8, device=self.device)
            self._broadcast(data)
            offsets = np.cumsum([0] + meta["sizes"])
            for name, dtype, shape, a, b in zip(meta["names"], meta["dtypes"], meta["shapes"],
                                                offsets[:-1], offsets[1:]):
                yield name, data[a:b].view(getattr(torch, dtype)).view(shape)

    def send_tensors(self, named_tensors: Iterable[tuple[str, Any]], update_info: dict) -> int:
        """Rank 0 of a vllm group: one NCCL broadcast per tensor, in the order of
        ``update_info`` (``{"names", "dtype_names", "shapes"}``, published to the receivers at
        the first push); returns the largest tensor's bytes."""
        import torch

        self._publish(update_info)
        stream, peak = torch.cuda.current_stream(), 0
        expected = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        for (name, tensor), (want, dtype, shape) in zip(named_tensors, expected, strict=True):
            if (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) != (want, dtype, shape):
                raise RuntimeError(f"weight {name!r} {tensor.dtype} {tuple(tensor.shape)} does not "
                                   f"match the announced {want!r} {dtype} {tuple(shape)}")
            tensor = tensor.contiguous()
            self.group.broadcast(tensor, src=0, stream=stream)
            peak = max(peak, tensor.nbytes)
        stream.synchronize()
        return peak

    def _publish(self, update_info: dict) -> None:
        if self._published is None:
            self.store.set("gdpo/update_info", json.dumps(update_info))
            self._published = update_info
        elif update_info != self._published:
            raise ValueError("the model's parameter names or shapes changed since the broadcast "
                             "group was built: rebuild the group (a new WeightBroadcast)")

    def update_info(self) -> dict:
        """Ranks 1..n of a vllm group: the ``update_info`` for ``llm.update_weights``."""
        if self._published is None:
            self._published = json.loads(self.store.get("gdpo/update_info"))
        return self._published


def _nccl_group(store: Any, rank: int, world_size: int, timeout: Any, device: Any) -> Any:
    """A torch NCCL backend on ``store``, built as torch 2.13's own ``_nccl_factory``
    (torch/distributed/_dist2.py) builds one: ``ProcessGroupNCCL(store, rank, size, options)``
    with the timeout in ``options._timeout``, then connected eagerly on ``device``, so that every
    member must be constructing it now (they are: the learners open while the actors join) and
    an NCCL that refuses the group fails here rather than in the middle of a push."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    group._set_sequence_number_for_group()
    group.eager_connect_single_device(device)
    return group


def _vllm_trainer_group(host: str, port: int, world_size: int, device: Any) -> Any:
    """Rank 0 of vLLM's NCCL weight-transfer group: the same StatelessProcessGroup rendezvous and
    PyNcclCommunicator (with its warm-up all_reduce) that each worker builds in
    ``init_weight_transfer_engine`` (vllm/distributed/weight_transfer/nccl_common.py,
    ``stateless_init_process_group``, in 0.32 and 0.34; ``NCCLWeightTransferEngine.
    _stateless_init_process_group`` in the older nccl_engine.py). Built from these primitives,
    not vLLM's trainer helpers, whose API moved from a static ``trainer_init`` to
    ``WeightTransferTrainerFactory`` across versions. A communicator that came up disabled (no
    NCCL library found, or VLLM_DISABLE_PYNCCL) would turn every broadcast into a silent no-op,
    so it is refused here, as the workers refuse theirs (0.34: ``_require_usable_communicator``)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
    comm = PyNcclCommunicator(group, device=device)
    if getattr(comm, "disabled", False):
        raise RuntimeError("vLLM's PyNcclCommunicator is disabled in this learner (no NCCL library, "
                           "or VLLM_DISABLE_PYNCCL): the weight broadcast would send nothing")
    return comm
