"""Weight digests: what a push sent against what each engine holds afterwards (attestation).

A tensor's digest is the sum of its elements' bit patterns, read as signed integers of the
element's width (float32 as int32, bfloat16 as int16, ...), modulo 2**64: one pass at memory
speed (faster than a copy of the bytes), on the host or on the tensor's device. It is additive:
the digest of tensors concatenated is the sum of theirs (``combine``), so an engine that holds
several pushed tensors fused into one (vLLM's ``qkv_proj``, ``gate_up_proj``), sharded or padded
with zeros reports that one digest under the joined names (``FUSED``), and the driver compares it
with the sum of the sender's. A dropped, corrupted or never-loaded tensor changes its digest
(every changed element changes the sum; an unchanged tensor is what was meant anyway). It is a
check against silent faults, not a cryptographic hash.

The sender computes the digest of what it sends (per tensor, while packing each bucket:
``gdpo_ray.weights.buckets``); a receiver converts what its engine holds to the sent dtype and
digests that (``digest_as``); ``compare`` names the first tensors that differ. An engine may hold
a float32 push in a lower precision (vLLM in bfloat16): for such engines the sender also takes
the digest of each float32 tensor rounded to that precision and back (``rounded_digests``,
``VARIANTS``), and a held tensor matches either.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping

MOD = 1 << 64
FUSED = "+"  # joins the names of pushed tensors an engine holds as one: "a+b+c"

_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
#: the lower precisions an engine may hold a float32 push in (the rounded digests a sender takes)
VARIANTS = ("bfloat16", "float16")


def digest(tensor: Any) -> int:
    """The digest of a torch tensor (any device) or numpy array, in its own dtype: the sum of
    its elements' bit patterns as signed integers of their width, mod 2**64."""
    if hasattr(tensor, "element_size"):  # torch
        import torch

        flat = tensor.detach().contiguous().view(-1)
        ints = flat.view(getattr(torch, _INT_OF_WIDTH[flat.element_size()]))
        if ints.device.type == "cpu":  # numpy's integer sum runs at memory speed, torch's ~8x slower
            return digest(ints.numpy())
        return int(ints.sum(dtype=torch.int64).item()) % MOD
    import numpy as np

    flat = np.ascontiguousarray(tensor).reshape(-1)
    ints = flat.view(_INT_OF_WIDTH[flat.itemsize])
    return int(ints.sum(dtype=np.int64)) % MOD


def digest_as(tensor: Any, dtype: str) -> int:
    """The digest of a torch tensor converted to ``dtype`` (a torch dtype's name, as buckets
    record it: "float32", "bfloat16"): what a receiver reports for a tensor sent in ``dtype``."""
    import torch

    kind = getattr(torch, dtype)
    return digest(tensor if tensor.dtype == kind else tensor.to(kind))


def digest_raw(raw: Any, dtype: str) -> int:
    """The digest of a tensor given as its raw bytes (a uint8 numpy array or torch tensor) and
    its dtype's name: what ``digest`` gives of the tensor itself."""
    import torch

    width = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    if hasattr(raw, "element_size"):
        return digest(raw.view(getattr(torch, _INT_OF_WIDTH[width])))
    return digest(raw.view(_INT_OF_WIDTH[width]))


def recorded(named_tensors: Iterable[tuple[str, Any]], into: dict) -> Iterator[tuple[str, Any]]:
    """``named_tensors`` passed through, each name's dtype noted in ``into``: what a receiver
    was sent, whose digests it reports once loaded."""
    for name, tensor in named_tensors:
        into[name] = str(tensor.dtype).removeprefix("torch.")
        yield name, tensor


def rounded_digests(tensor: Any, dtype: str, variants: Iterable[str]) -> dict[str, int]:
    """For a float32 tensor (torch, or raw uint8 bytes as numpy/torch), the digest of it rounded
    to each of ``variants`` and back to float32: what an engine holding it in that precision
    reports (``digest_as(held, "float32")``). Empty for other dtypes or no variants."""
    variants = tuple(variants)
    if dtype != "float32" or not variants:
        return {}
    import torch

    if not hasattr(tensor, "element_size"):  # numpy bytes
        tensor = torch.from_numpy(tensor)
    if tensor.dtype == torch.uint8:
        tensor = tensor.view(torch.float32)
    return {v: digest(tensor.to(getattr(torch, v)).to(torch.float32)) for v in variants}


def combine(digests: Any) -> int:
    """The digest of tensors laid end to end: the sum of theirs, mod 2**64."""
    return sum(digests) % MOD


def compare(sent: Mapping[str, int], held: Mapping[str, int],
            rounded: Mapping[str, Mapping[str, int]] | None = None) -> list[str]:
    """What differs between the digests a sender sent (per tensor name) and those a receiver
    reports of its engine (per name, or per ``FUSED``-joined names): every sent tensor must be
    covered exactly once. ``rounded``: per name, the digests of the tensor rounded to a lower
    precision (``rounded_digests``), which a held tensor may match instead. Returns readable
    differences, empty when they agree."""
    wrong, covered, rounded = [], set(), rounded or {}
    for key, value in held.items():
        names = key.split(FUSED)
        unknown = [n for n in names if n not in sent]
        if unknown:
            wrong.append(f"{key}: the engine reports a tensor the push did not send ({unknown[0]})")
            continue
        covered.update(names)
        variants = set.intersection(*(set(rounded.get(n, {})) for n in names))
        expected = {combine(sent[n] for n in names)} | {combine(rounded[n][v] for n in names) for v in variants}
        if value % MOD not in expected:
            wrong.append(f"{key}: the engine holds other values than were sent")
    missing = [n for n in sent if n not in covered]
    if missing:
        wrong.append(f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                     + ": not reported as held by the engine")
    return wrong


@dataclasses.dataclass
class Sent:
    """What one push sent, from the sender's side: per tensor name its digest, dtype and the
    index of its bucket (of its broadcast, for a transport without buckets), and the bytes in
    all and of the largest bucket."""

    digests: dict[str, int] = dataclasses.field(default_factory=dict)
    rounded: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # name -> variant -> digest
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    buckets: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    peak_bytes: int = 0
    count: int = 0  # buckets (or broadcasts)

    def add(self, names: Any, dtypes: Any, digests: Any, nbytes: int, rounded: Any = None) -> None:
        """One bucket's tensors (or one tensor's), ``nbytes`` on the wire; ``rounded``: their
        ``rounded_digests``, if taken."""
        for i, (name, dtype, value) in enumerate(zip(names, dtypes, digests, strict=True)):
            self.digests[name], self.dtypes[name], self.buckets[name] = int(value), dtype, self.count
            if rounded and rounded[i]:
                self.rounded[name] = dict(rounded[i])
        self.count += 1
        self.bytes += int(nbytes)
        self.peak_bytes = max(self.peak_bytes, int(nbytes))

    def add_bucket(self, bucket: dict) -> None:
        self.add(bucket["names"], bucket["dtypes"], bucket["digests"],
                 sum(a.nbytes for a in bucket["arrays"]), bucket.get("rounded"))
