"""A learner's sending side of a weight push: every parameter of its DeepSpeed engine, full, under
the names and in the order a rollout engine loads them (the model's state dict, tied names such
as ``lm_head.weight`` beside ``embed_tokens`` included, which vLLM's reload needs); under LoRA
only the adapter's tensors.

One source, several shapes, one per transport (``gdpo_ray.weights``): host buckets for the
object store and gloo (under ZeRO-1/2 on the host: byte ranges of DeepSpeed's flat parameter
buffers, no copy), device buckets for NCCL, device tensors and their ``update_info`` for vLLM's
weight transfer. Under ZeRO-3 each parameter is gathered on its own (a collective: every rank
iterates alike, ``take_part`` on ranks that send nothing), so no whole model is ever gathered.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from gdpo_ray.weights.buckets import pack_buckets, pack_flat_buckets
from gdpo_ray.weights.digest import Sent


class WeightSender:
    """``adapter_only`` (``llm.lora``): only the trainable tensors, the adapter's, under the
    names PEFT saves them with (``gdpo_ray.lora.adapter_key``): a push of megabytes."""

    def __init__(self, engine: Any, zero_stage: int, adapter_only: bool = False,
                 variants: tuple[str, ...] = ()) -> None:
        self.engine, self.zero_stage, self.adapter_only = engine, zero_stage, adapter_only
        self.variants = variants  # the rounded digests to take too (gdpo_ray.weights.digest)
        self.device = engine.device

    def _state(self) -> Iterable[tuple[str, Any]]:
        if not self.adapter_only:
            return self.engine.module.state_dict(keep_vars=True).items()
        from gdpo_ray.lora import adapter_key

        return [(adapter_key(name), p) for name, p in self.engine.module.named_parameters() if p.requires_grad]

    def _gathered(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(name, full float32 tensor on this learner's device), each ZeRO-3 parameter gathered
        on its own (a collective)."""
        import deepspeed

        for name, param in named:
            if self.zero_stage == 3 and hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param]):
                    yield name, param.detach().float().clone()
            else:
                yield name, param.detach().float()

    def host_tensors(self, every_name: bool = True) -> Iterator[tuple[str, Any]]:
        """(name, full tensor on the host) of every state-dict entry (``every_name``) or of
        every parameter (``named_parameters``: tied weights once)."""
        named = self._state() if every_name or self.adapter_only else self.engine.module.named_parameters()
        for name, tensor in self._gathered(named):
            yield name, tensor.cpu()

    def device_tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, full float32 tensor on this learner's device), in ``host_tensors``' order."""
        yield from self._gathered(self._state())

    def take_part(self) -> None:
        """A rank that sends nothing: its part in the ZeRO-3 gathers (nothing otherwise)."""
        if self.zero_stage == 3:
            for _ in self._gathered(self._state()):
                pass

    def update_info(self) -> dict:
        """vLLM's ``update_info`` for ``device_tensors`` (names, dtype names, full shapes; a
        ZeRO-3 partition keeps its full shape in ``ds_shape``), read without gathering."""
        names, shapes = [], []
        for name, param in self._state():
            names.append(name)
            shapes.append(list(param.ds_shape if hasattr(param, "ds_shape") else param.shape))
        return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": shapes}

    def host_buckets(self, bucket_bytes: int) -> Iterator[dict]:
        """Buckets on the host: byte ranges of the flat buffers where the parameters live
        there (``flat_parameters``), else packed views of the gathered tensors."""
        flat = self.flat_parameters()
        if flat is not None:
            return (b for data, entries in flat
                    for b in pack_flat_buckets(data, entries, bucket_bytes, self.variants))
        return pack_buckets(self.host_tensors(), bucket_bytes, variants=self.variants)

    def device_buckets(self, bucket_bytes: int) -> Iterator[dict]:
        return pack_buckets(self.device_tensors(), bucket_bytes, on_device=True, variants=self.variants)

    def put_buckets(self, bucket_bytes: int) -> tuple[list[Any], Sent]:
        """The host buckets written once into Ray's object store: (their ObjectRefs, what was
        sent: every tensor's digest and bucket, the bytes)."""
        import ray

        refs, sent = [], Sent()
        for bucket in self.host_buckets(bucket_bytes):
            sent.add_bucket(bucket)
            refs.append(ray.put(bucket))
        return refs, sent

    def flat_parameters(self) -> list[tuple[np.ndarray, list]] | None:
        """Under ZeRO-1/2 on the host every parameter is a view into DeepSpeed's flat buffers
        (``bit16_groups_flat``): [(the buffer's bytes, [(offset, name, dtype, shape, nbytes)])]
        over every state-dict name, or None where some tensor lies outside them (ZeRO-0/3, GPU)."""
        import torch

        flats = getattr(getattr(self.engine, "optimizer", None), "bit16_groups_flat", None)
        if not flats or self.zero_stage not in (1, 2) or self.device.type != "cpu":
            return None
        spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats]
        entries: list[list] = [[] for _ in flats]
        for name, tensor in self._state():
            ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            hit = [i for i, (a, b) in enumerate(spans) if a <= ptr and ptr + nbytes <= b]
            if not hit or not tensor.is_contiguous():
                return None
            entries[hit[0]].append((ptr - spans[hit[0]][0], name,
                                    str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), nbytes))
        return [(f.detach().view(-1).view(torch.uint8).numpy(), e)
                for f, e in zip(flats, entries) if e]
