"""The members' side of a weight broadcast: learner rank 0 (rank 0 here) and the rollout actors
(ranks 1..n) in a group of their own, apart from the learners' DeepSpeed group.

``open_channel`` makes the TCPStore rendezvous, lets every member propose a backend (``gloo``
on CPU, ``nccl`` on CUDA, ``vllm`` for a vLLM engine on CUDA: ``receiver_backend``) and settles
on one (``agreed_backend``, a pure function every rank computes alike) before any group is built,
so that mismatched members fall back to gloo instead of hanging. It returns the channel of that
backend, one class each, all with one interface:

  - ``attach(engine)``: a receiver's engine joins what it must (vLLM's transfer group); returns
    what the engine's join returns (a coroutine for an async engine, which the caller awaits);
  - ``send(sender, bucket_bytes)``: rank 0 sends one version from a ``learners.weight_sender.
    WeightSender``; returns the largest bucket's (vllm: tensor's) bytes;
  - ``receive_into(engine, version)``: a receiver loads one version into its (batch) engine;
  - ``close()``: releases the group (before it is rebuilt).

What the receivers' side calls of an engine is written here: ``receiver_backend`` reads its
``device`` and ``weight_transfer``; gloo and NCCL buckets go to its ``load_weights``; an engine
with ``weight_transfer`` True is a ``WeightReceiver`` (batch) or ``AsyncWeightReceiver``
(streaming), which vLLM's transfer calls (``actors.engines`` checks engines against them).

``GlooChannel``: host buckets (``gdpo_ray.weights.buckets``); per bucket rank 0 broadcasts
[header bytes, data bytes], the pickled header (names, dtypes, shapes, offsets) and the bucket's
bytes; [0, 0] ends a version. Receivers load lazily, one bucket in memory. ``NcclChannel``: the
same messages as CUDA tensors over a torch NCCL group. ``VllmChannel``: rank 0 opens the
rendezvous of vLLM's own NCCL weight transfer (its port published in the store); each receiver's
engine joins it; per version the receivers read vLLM's ``update_info`` (names, dtypes, full
shapes; published once) from the store and rank 0 broadcasts every tensor in that order.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from datetime import timedelta
from typing import Any, Iterable, Iterator, Protocol, Sequence

import numpy as np

from gdpo_ray.weights.buckets import bucket_offsets, tensor_views
from gdpo_ray.weights.digest import Sent, digest, recorded, rounded_digests

BACKENDS = ("gloo", "nccl", "vllm")
# NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless this
# experimental switch of NCCL >= 2.30 is on (NCCL's environment-variable docs, cited by
# NVIDIA/cuDecomp PR #130). It must be in the environment before the process's first NCCL
# communicator: set it in the Ray runtime_env (or the driver's environment) of the job.
MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"


def free_port() -> int:
    """A port no socket of this host is bound to now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightReceiver(Protocol):
    """What vLLM's NCCL weight transfer (``VllmChannel``) calls of a batch engine whose
    ``weight_transfer`` is True: it joins learner rank 0's group once, then takes every version
    straight into its weights (an engine without it takes buckets through ``load_weights``)."""

    def join_weight_transfer(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Joins the NCCL group whose rank 0 (learner rank 0) listens at ``host:port`` as
        ``rank`` of ``world_size``; returns once every member has joined."""

    def receive_broadcast(self, update_info: dict, version: int) -> None:
        """Takes one version: rank 0 broadcasts every tensor ``update_info`` names (``{"names",
        "dtype_names", "shapes"}``, full shapes), one broadcast each, in that order; returns when
        all are loaded. ``version`` is the policy version they are (a batch engine may ignore
        it: its actor labels the groups)."""


class AsyncWeightReceiver(Protocol):
    """``WeightReceiver`` of a streaming engine: the same calls as coroutines on the actor's
    event loop, the broadcast taken in flight."""

    async def join_weight_transfer(self, host: str, port: int, rank: int, world_size: int) -> None:
        """As ``WeightReceiver.join_weight_transfer``; generation goes on meanwhile."""

    async def receive_broadcast(self, update_info: dict, version: int) -> float:
        """As ``WeightReceiver.receive_broadcast``, while requests are in flight: the engine
        paused with every request kept, the tensors received, the tokens sampled after it
        labelled ``version`` (``StreamingEngine.push``); returns the seconds it was paused."""


def receiver_backend(engine: Any) -> str:
    """A rollout engine's proposal: ``vllm`` for an engine on CUDA that offers vLLM's weight
    transfer (``engine.weight_transfer``), ``nccl`` for any other engine on CUDA (the HF
    engine), ``gloo`` on CPU."""
    if not str(engine.device).startswith("cuda"):
        return "gloo"
    return "vllm" if engine.weight_transfer else "nccl"


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
    which every member supports (CUDA engines load host tensors)."""
    kinds = [m["backend"] for m in members]
    if "gloo" in kinds or len(set(kinds[1:])) > 1:
        return "gloo"
    gpus = [m["gpu"] for m in members]
    if len(set(gpus)) < len(gpus) and not all(m["share"] for m in members):
        return "gloo"
    return kinds[-1]


def open_channel(host: str, port: int, rank: int, world_size: int, proposal: str,
                 timeout_s: float = 600) -> "GlooChannel | VllmChannel":
    """This member's end of a broadcast group (rank 0 hosts the store at ``host:port``): every
    member proposes, all agree, then the agreed backend's channel is built."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store.set(f"gdpo/member/{rank}", json.dumps(member_info(proposal)))
    backend = agreed_backend([json.loads(store.get(f"gdpo/member/{r}")) for r in range(world_size)])
    return CHANNELS[backend](store, host, rank, world_size, timeout)


class GlooChannel:
    """Host buckets over a gloo group; every member can take part."""

    backend = "gloo"

    def __init__(self, store: Any, host: str, rank: int, world_size: int, timeout: timedelta) -> None:
        import torch

        self.store, self.rank, self.world_size = store, rank, world_size
        self.device = torch.device("cpu")
        self.group = self._group(timeout)

    def _group(self, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(self.store, self.rank, self.world_size, timeout)

    def _buckets(self, sender: Any, bucket_bytes: int) -> Iterable[dict]:
        return sender.host_buckets(bucket_bytes)

    def _data(self, bucket: dict) -> Any:
        import torch

        arrays = bucket["arrays"]
        if len(arrays) == 1:  # a flat bucket: its byte range as it lies
            return torch.from_numpy(arrays[0])
        return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, np.uint8))

    def attach(self, engine: Any) -> None:
        """Nothing to join: the engine loads what ``receive_into`` hands it."""

    def close(self) -> None:
        """A gloo group goes with its last reference."""

    def _broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([tensor], opts).wait()

    def send(self, sender: Any, bucket_bytes: int) -> Sent:
        """Rank 0: every bucket of the sender's weights, then the end mark; returns what was
        sent (digests, buckets, bytes)."""
        import torch

        sent = Sent()
        for bucket in self._buckets(sender, bucket_bytes):
            header = pickle.dumps({k: bucket[k] for k in ("names", "dtypes", "shapes")}
                                  | {"offsets": bucket_offsets(bucket)})
            data = self._data(bucket)
            sent.add(bucket["names"], bucket["dtypes"], bucket["digests"], data.nbytes, bucket.get("rounded"),
                     bucket["shapes"])
            self._broadcast(torch.tensor([len(header), data.nbytes], dtype=torch.int64, device=self.device))
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
            self._broadcast(data)
        self._broadcast(torch.zeros(2, dtype=torch.int64, device=self.device))
        return sent

    def receive(self) -> Iterator[tuple[str, Any]]:
        """Ranks 1..n: (name, tensor on this member's device) of every parameter of one version,
        bucket by bucket."""
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
            yield from tensor_views(data, meta["names"], meta["dtypes"], meta["shapes"], meta["offsets"])

    def receive_into(self, engine: Any, version: int) -> dict[str, str]:
        """Ranks 1..n: one version into a batch engine's ``load_weights`` (the actor labels it
        ``version``); returns what was received (name -> dtype), for the attestation."""
        received: dict[str, str] = {}
        engine.load_weights(recorded(self.receive(), received))
        return received


class NcclChannel(GlooChannel):
    """The same buckets as CUDA tensors over a torch NCCL group (learner and HF engines on CUDA)."""

    backend = "nccl"

    def __init__(self, store: Any, host: str, rank: int, world_size: int, timeout: timedelta) -> None:
        import torch

        self.store, self.rank, self.world_size = store, rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = self._group(timeout)

    def _group(self, timeout: timedelta) -> Any:
        """A torch NCCL backend on the store, built as torch 2.13's own ``_nccl_factory``
        (torch/distributed/_dist2.py) builds one: ``ProcessGroupNCCL(store, rank, size,
        options)`` with the timeout in ``options._timeout``, then connected eagerly on this
        device, so that every member must be constructing it now (they are: the learner opens
        while the actors join) and an NCCL that refuses the group fails here rather than in the
        middle of a push."""
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, options)
        group._set_sequence_number_for_group()
        group.eager_connect_single_device(self.device)
        return group

    def _buckets(self, sender: Any, bucket_bytes: int) -> Iterable[dict]:
        return sender.device_buckets(bucket_bytes)

    def _data(self, bucket: dict) -> Any:
        import torch

        arrays = bucket["arrays"]
        return torch.cat(arrays) if arrays else torch.zeros(0, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        """Releases the NCCL communicator."""
        self.group.abort()


class VllmChannel:
    """vLLM engines on CUDA receive through vLLM's own weight-transfer engine (an NCCL group of
    vLLM's making that learner rank 0 joins); one broadcast per tensor."""

    backend = "vllm"

    def __init__(self, store: Any, host: str, rank: int, world_size: int, timeout: timedelta) -> None:
        import torch

        self.store, self.host, self.rank, self.world_size = store, host, rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._published: dict | None = None
        if rank == 0:
            self.vllm_port = free_port()
            store.set("gdpo/vllm_port", str(self.vllm_port))
            self.group = _vllm_trainer_group(host, self.vllm_port, world_size, self.device)
        else:  # the engine joins with the port (attach)
            self.vllm_port, self.group = int(store.get("gdpo/vllm_port")), None

    def attach(self, engine: WeightReceiver | AsyncWeightReceiver) -> Any:
        return engine.join_weight_transfer(self.host, self.vllm_port, self.rank, self.world_size)

    def close(self) -> None:
        """vLLM's group goes with its last reference."""

    def send(self, sender: Any, bucket_bytes: int) -> Sent:
        """Rank 0: one NCCL broadcast per tensor, in the order of the sender's ``update_info``
        (``{"names", "dtype_names", "shapes"}``, published to the receivers at the first send);
        returns what was sent (each tensor's digest, taken on the device; one "bucket" each)."""
        import torch

        update_info = sender.update_info()
        self._publish(update_info)
        stream, sent = torch.cuda.current_stream(), Sent()
        expected = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        for (name, tensor), (want, dtype, shape) in zip(sender.device_tensors(), expected, strict=True):
            if (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) != (want, dtype, shape):
                raise RuntimeError(f"weight {name!r} {tensor.dtype} {tuple(tensor.shape)} does not "
                                   f"match the announced {want!r} {dtype} {tuple(shape)}")
            tensor = tensor.contiguous()
            self.group.broadcast(tensor, src=0, stream=stream)
            sent.add([name], [dtype], [digest(tensor)], tensor.nbytes,
                     [rounded_digests(tensor, dtype, sender.variants)], [tuple(tensor.shape)])
        stream.synchronize()
        return sent

    def _publish(self, update_info: dict) -> None:
        if self._published is None:
            self.store.set("gdpo/update_info", json.dumps(update_info))
            self._published = update_info
        elif update_info != self._published:
            raise ValueError("the model's parameter names or shapes changed since the broadcast "
                             "group was built: rebuild the group (a new channel)")

    def update_info(self) -> dict:
        """Ranks 1..n: the ``update_info`` for vLLM's ``update_weights``."""
        if self._published is None:
            self._published = json.loads(self.store.get("gdpo/update_info"))
        return self._published

    def receive_into(self, engine: WeightReceiver, version: int) -> dict[str, str]:
        """Ranks 1..n: one version through vLLM's transfer; returns what was received."""
        info = self.update_info()
        engine.receive_broadcast(info, version)
        return dict(zip(info["names"], info["dtype_names"]))


CHANNELS = {"gloo": GlooChannel, "nccl": NcclChannel, "vllm": VllmChannel}


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
