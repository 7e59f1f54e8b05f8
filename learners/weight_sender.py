"""A learner's sending side of a weight push: every parameter of its model, full, under the names
and in the order a rollout engine loads them (the model's state dict, tied names such as
``lm_head.weight`` beside ``embed_tokens`` included, which vLLM's reload needs); under LoRA only
the adapter's tensors.

One source, several shapes, one per transport (``gdpo_ray.weights``): host buckets for the
object store and gloo (byte ranges of flat host buffers where the backend keeps the weights in
them, DeepSpeed's under ZeRO-1/2: no copy), device buckets for NCCL, device tensors and their
``update_info`` for vLLM's weight transfer. The backend (``learners.backend``) turns each named
parameter into its full tensor (``full_tensors``); where that is a collective (``gathers``:
ZeRO-3, FSDP2) each parameter is gathered on its own, every rank iterating alike (``take_part``
on ranks that send nothing), so no whole model is ever gathered.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from gdpo_ray.weights.buckets import bucket_digests, pack_buckets, pack_flat_buckets
from gdpo_ray.weights.digest import Sent


class WeightSender:
    """``adapter_only`` (``llm.lora``): only the trainable tensors, the adapter's, under the
    names PEFT saves them with (``gdpo_ray.lora.adapter_key``): a push of megabytes."""

    def __init__(self, backend: Any, adapter_only: bool = False, variants: tuple[str, ...] = ()) -> None:
        """``backend``: the learner (``learners.backend.LearnerBackend``) whose weights go out."""
        self.backend, self.adapter_only = backend, adapter_only
        self.variants = variants  # the rounded digests to take too (gdpo_ray.weights.digest)
        self.device = backend.device

    def _state(self) -> Iterable[tuple[str, Any]]:
        if not self.adapter_only:
            return self.backend.module.state_dict(keep_vars=True).items()
        from gdpo_ray.lora import adapter_key

        return [(adapter_key(name), p) for name, p in self.backend.module.named_parameters() if p.requires_grad]

    def host_tensors(self, every_name: bool = True) -> Iterator[tuple[str, Any]]:
        """(name, full tensor on the host) of every state-dict entry (``every_name``) or of
        every parameter (``named_parameters``: tied weights once)."""
        named = self._state() if every_name or self.adapter_only else self.backend.module.named_parameters()
        for name, tensor in self.backend.full_tensors(named):
            yield name, tensor.cpu()

    def device_tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, full float32 tensor on this learner's device), in ``host_tensors``' order."""
        yield from self.backend.full_tensors(self._state())

    def take_part(self) -> None:
        """A rank that sends nothing: its part in the gathers (nothing where there are none)."""
        if self.backend.gathers:
            for _ in self.backend.full_tensors(self._state()):
                pass

    def update_info(self) -> dict:
        """vLLM's ``update_info`` for ``device_tensors`` (names, dtype names, full shapes), read
        without gathering."""
        names, shapes = [], []
        for name, param in self._state():
            names.append(name)
            shapes.append(self.backend.full_shape(param))
        return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": shapes}

    def host_buckets(self, bucket_bytes: int, digests: bool = True) -> Iterator[dict]:
        """Buckets on the host: byte ranges of the flat buffers where the parameters live
        there (the backend's ``flat_weights``), else packed views of the full tensors;
        ``digests``: each tensor digested as it is packed."""
        flat = self.backend.flat_weights(self._state())
        if flat is not None:
            return (b for data, entries in flat
                    for b in pack_flat_buckets(data, entries, bucket_bytes, self.variants, digests))
        return pack_buckets(self.host_tensors(), bucket_bytes, variants=self.variants, digests=digests)

    def device_buckets(self, bucket_bytes: int) -> Iterator[dict]:
        return pack_buckets(self.device_tensors(), bucket_bytes, on_device=True, variants=self.variants)

    def put_buckets(self, bucket_bytes: int) -> tuple[list[Any], Sent]:
        """The host buckets written once into Ray's object store: (their ObjectRefs, what was
        sent but the digests: every tensor's bucket, dtype and shape, the bytes). The digests
        come from ``digests_of`` the written copies, while the receivers load them."""
        import ray

        refs, sent = [], Sent()
        for bucket in self.host_buckets(bucket_bytes, digests=False):
            sent.add_bucket(bucket)
            refs.append(ray.put(bucket))
        return refs, sent

    def digests_of(self, refs: list[Any]) -> Sent:
        """What was sent in the buckets ``refs`` (``put_buckets``), every tensor's digest taken
        from the object store's copy (read in place, zero-copy): the bytes the receivers load."""
        import ray

        sent = Sent()
        for ref in refs:
            bucket = ray.get(ref)
            sent.add_bucket(bucket, *bucket_digests(bucket, self.variants))
            del bucket  # the store's copy is released as soon as it is digested
        return sent
