"""Weight digests: what a push sent against what each engine holds afterwards (attestation).

A tensor's digest depends on every element's value and position, and on the tensor's row length
C (its last dimension; 1 for a vector). Element i (its flat index, row-major), whose bit pattern
b is w bits wide (32 for float32, 16 for bfloat16, ...), adds ``R**i * g(b)``; the sum is
multiplied by ``S(C)``; all modulo 2**64::

    digest = S(C) * sum_i R**i * g(b_i)
    g(b) = v ^ (v >> w/2), v = b * K mod 2**w, read as a signed w-bit integer (then 64 bits wide)
    S(C) = splitmix64(C) | 1

``K`` and ``R`` are odd constants, so ``g`` is a bijection of w-bit words that is not linear in
b (a multiply, then the high half xored into the low half), with g(0) = 0: a zero element adds
nothing wherever it sits, so an engine that holds a tensor padded with zeros (vLLM's vocabulary
rows) reports the digest of the unpadded one. Every other element adds ``R**i`` times a
scrambled value of itself: moving an element (permuted or reversed rows, a transpose, swapped
shards), swapping the signs of a +x/-x pair, or moving two elements by one ulp in opposite
directions changes the sum, and so does a reshape to another row length (``S``). One pass over
the data: on the host a loop compiled by numba (``gdpo_ray.weights.host_digest``: each element
read once, in unsigned 64-bit lanes, which wrap; numpy's array operations in a process whose
engine cannot abide numba, ``keep_to_numpy``), on the tensor's own device torch's array operations in batches of bounded
size (the same arithmetic in signed integers, which wrap alike; ``tests/unit/test_digest.py``
holds the three bit for bit together).

Additive by global offset: the digest of elements placed ``o`` positions later is ``R**o`` times
theirs (``shifted``), so the digest of tensors laid end to end (sharing a row length) is the sum
of each part's digest shifted by the number of elements before it (``combine``). An engine that
holds several pushed tensors concatenated into one (vLLM's ``qkv_proj`` = q, k, v and
``gate_up_proj`` = gate, up, in that order) reports that one digest under the joined names in
the order it holds them (``FUSED``), and the driver compares it with the sum of the sender's,
placed by the sent shapes (``Sent.shapes``). A part of a tensor (a shard, a block of columns, a
chunk) is digested where it sits in the whole (``digest(part, offset, row_length)``), and the
parts' digests add up to the whole's.

It is a check against silent faults, not a cryptographic hash: arithmetic modulo 2**64 keeps
some structure (``R**i`` and ``R**j`` agree in their lowest 2 + v2(i - j) bits, so a change
moving elements 2**k positions apart goes unseen with probability about 2**(k + 2 - 64)).

The sender computes the digest of what it sends (per tensor: of the copies it wrote into the
object store, or while packing each bucket for a broadcast: ``gdpo_ray.weights.buckets``); a receiver converts what its engine holds to the sent dtype and
digests that (``digest_as``); ``compare`` names the first tensors that differ. An engine may hold
a float32 push in a lower precision (vLLM in bfloat16): for such engines the sender also takes
the digest of each float32 tensor rounded to that precision and back (``rounded_digests``,
``VARIANTS``), and a held tensor matches either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Iterable, Iterator, Mapping, Sequence

from gdpo_ray.weights.dtypes import itemsize

MOD = 1 << 64
FUSED = "+"  # joins the names of pushed tensors an engine holds as one: "a+b+c"

#: the lower precisions an engine may hold a float32 push in (the rounded digests a sender takes)
VARIANTS = ("bfloat16", "float16")

BASE = 0x9E3779B97F4A7C15  # R: odd, 5 mod 8, so its powers repeat only after 2**62 positions
SCRAMBLE = 0xBF58476D1CE4E5B9  # K (its low w bits for w-bit elements): odd, so g is a bijection
WIDTH = 1 << 15  # elements per piece of a row (the length of the table of R's powers)
HOST_BATCH = 1 << 17  # elements per numpy step (where numba is not loaded): 2 MiB of temporaries
DEVICE_BATCH = 1 << 22  # elements per torch step on a device: 32 MiB temporaries
ROUND_BATCH = 1 << 20  # elements converted to another dtype at a time (digest_as, rounded_digests)

_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_NUMPY_ONLY = False  # keep_to_numpy
_tables: dict = {}  # (base, count, device) -> torch tensor of powers on that device


def row_length_of(shape: Sequence[int]) -> int:
    """The row length a tensor of ``shape`` is digested with: its last dimension, 1 for a
    vector or a scalar (so vectors concatenate as vLLM's fused biases do)."""
    return int(shape[-1]) if len(shape) >= 2 else 1


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def shifted(value: int, offset: int) -> int:
    """The digest of the same elements placed ``offset`` positions later."""
    return value * pow(BASE, offset, MOD) % MOD


def combine(digests: Sequence[int], sizes: Sequence[int]) -> int:
    """The digest of tensors laid end to end (all of one row length): the sum of their digests,
    each shifted by the elements before it (``sizes``: each tensor's element count)."""
    total, offset = 0, 0
    for value, size in zip(digests, sizes, strict=True):
        total += shifted(value, offset)
        offset += int(size)
    return total % MOD


def digest(tensor: Any, offset: int = 0, row_length: int | None = None) -> int:
    """The digest of a torch tensor (any device) or numpy array, in its own dtype (module
    docstring), computed where the tensor lives (a host tensor by the compiled host loop, several
    times faster there than torch).

    ``row_length`` None: ``tensor`` is a whole tensor (``offset`` shifts it). Otherwise
    ``tensor`` is a part of a whole tensor whose rows are ``row_length`` long, digested where it
    sits in that whole: a vector (or a tensor whose last dimension is ``row_length``) is the run
    of elements from flat position ``offset``; a tensor whose last dimension is shorter is a
    block of columns, its row r starting at ``offset + r * row_length``. The digests of disjoint
    parts add up (mod 2**64) to the whole's."""
    if not numel(tensor.shape):
        return 0  # nothing adds anything, whatever the shape
    length, block = _layout(tuple(tensor.shape), row_length)
    if hasattr(tensor, "element_size"):  # torch
        ints = _torch_ints(tensor)
        if ints.device.type != "cpu":
            return _finish(_device_sum(ints, offset, length, block), length)
        ints = ints.numpy()
    else:
        import numpy as np

        ints = np.ascontiguousarray(tensor)
        ints = ints.view(_INT_OF_WIDTH[ints.itemsize])
    return _finish(_host_sum(ints, offset, length, block), length)


def device_digest(tensor: Any, offset: int = 0, row_length: int | None = None) -> int:
    """``digest`` by its device code path (torch), wherever the tensor is: on the host it
    gives what the host loop gives, bit for bit (``tests/unit/test_digest.py``)."""
    if not numel(tensor.shape):
        return 0  # nothing adds anything, whatever the shape
    length, block = _layout(tuple(tensor.shape), row_length)
    return _finish(_device_sum(_torch_ints(tensor), offset, length, block), length)


def _layout(shape: tuple, row_length: int | None) -> tuple[int, bool]:
    """(the row length, whether the tensor is a block of columns of a wider whole)."""
    length = row_length_of(shape) if row_length is None else int(row_length)
    if length < 1:
        raise ValueError(f"row_length must be >= 1; got {length}")
    block = row_length is not None and len(shape) >= 2 and shape[-1] != length
    if block and shape[-1] > length:
        raise ValueError(f"a block of {shape[-1]} columns is wider than the rows ({length}) it is part of")
    return length, block


def _torch_ints(tensor: Any) -> Any:
    import torch

    ints = tensor.detach().contiguous()
    return ints.view(getattr(torch, _INT_OF_WIDTH[ints.element_size()]))


def _finish(total: int, length: int) -> int:
    """The sum times S(row length): an odd constant per row length (splitmix64 of it)."""
    z = (length + 0x9E3779B97F4A7C15) % MOD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % MOD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % MOD
    return total * ((z ^ (z >> 31)) | 1) % MOD


@functools.lru_cache(maxsize=64)
def _powers(base: int, count: int) -> Any:
    """base**0 .. base**(count-1) mod 2**64, as a numpy uint64 array (read only)."""
    import numpy as np

    out = np.ones(count, dtype=np.uint64)
    done = 1
    while done < count:  # doubling: out[k:2k] = out[:k] * base**k
        n = min(done, count - done)
        np.multiply(out[:n], np.uint64(pow(base, done, MOD)), out=out[done:done + n])
        done += n
    out.flags.writeable = False
    return out


# --- host (numba: gdpo_ray.weights.host_digest; numpy where numba may not load) --------------------

def _host_sum(ints: Any, first: int, length: int, block: bool) -> int:
    """sum_i R**(position of i) g(ints[i]) (before S), ``ints`` a contiguous numpy integer array:
    a block of columns by its rows (row r from ``first + r * length``), a run as one row; by the
    compiled loop, else numpy's array operations in rows of WIDTH."""
    compiled = _compiled()
    if compiled is not None:
        rows = ints.reshape(-1, ints.shape[-1]) if block else ints.reshape(1, -1)
        if not rows.size:
            return 0
        lanes = rows.view(f"uint{8 * ints.itemsize}")  # widened without the sign: g masks to w bits
        return compiled(lanes, _powers(BASE, WIDTH), pow(BASE, first, MOD), pow(BASE, length, MOD),
                        pow(BASE, WIDTH, MOD), SCRAMBLE) % MOD
    if block:
        return _host_rows(ints.reshape(-1, ints.shape[-1]), first, length)
    flat = ints.reshape(-1)
    full = flat.size // WIDTH * WIDTH
    total = _host_rows(flat[:full].reshape(-1, WIDTH), first, WIDTH) if full else 0
    if full < flat.size:
        total += _host_rows(flat[full:].reshape(1, -1), first + full, WIDTH)
    return total % MOD


def warm_host_digest() -> None:
    """Loads the compiled host digest (compiles it where numba has no cache yet: a second or
    two) on a daemon thread, so that a process's first push does not wait for it; nothing in a
    process that keeps to numpy (``keep_to_numpy``). Called by learners (rank 0) at start; not by
    rollout actors, whose process may start a vLLM engine after it (benchmarks, tests)."""
    import threading

    def warm() -> None:
        import numpy as np

        for width in ("uint32", "uint16"):  # float32 and bfloat16 pushes
            _host_sum(np.zeros(2, width), 0, 1, False)

    threading.Thread(target=warm, daemon=True, name="digest-warm-up").start()


def keep_to_numpy() -> None:
    """This process's host digests go through numpy, never numba: what an engine calls, before
    it loads its library, where that library cannot abide numba's llvmlite in its process (the
    vLLM engines: vLLM 0.32's CPU kernel registration, at each engine's start, scans every
    loaded module and fails on llvmlite's function wrappers). numpy is about 1.8x slower."""
    global _NUMPY_ONLY
    _NUMPY_ONLY = True
    if "llvmlite" in sys.modules:
        import logging

        logging.getLogger(__name__).warning(
            "numba (llvmlite) is loaded in this process already (a host weight digest ran here before "
            "this engine started): vLLM 0.32 on CPU fails to start beside it ('_lib_fn_wrapper' object "
            "has no attribute 'get'); start vLLM engines before any push in their process, or in a "
            "process of their own")


def _compiled() -> Any:
    """``host_digest.rows_sum`` (numba), or None where the process keeps to numpy
    (``keep_to_numpy``). An engine that loads such a library after a host digest of its
    process would fail: rollout actors start their engines first, learners and drivers run none."""
    if _NUMPY_ONLY:
        return None
    from gdpo_ray.weights.host_digest import rows_sum

    return rows_sum


def _host_rows(ints: Any, first: int, stride: int) -> int:
    """sum over [r, c] of R**(first + r * stride + c) g(ints[r, c]) of a 2-D integer array, a
    batch of rows at a time: g in the elements' own width (three operations on narrow lanes),
    widened, times R**c, summed per row; each row's sum weighed by R**(r * stride) and the
    batch's by R**(its first position)."""
    import numpy as np

    rows, cols = ints.shape
    if not rows or not cols:
        return 0
    bits = 8 * ints.itemsize
    lanes = ints.view(f"uint{bits}")
    scramble, half = np.dtype(lanes.dtype).type(SCRAMBLE % (1 << bits)), np.dtype(lanes.dtype).type(bits // 2)
    table, total = _powers(BASE, WIDTH), 0
    for c0 in range(0, cols, WIDTH):
        width = min(WIDTH, cols - c0)
        per = max(1, min(rows, HOST_BATCH // width))
        steps = _powers(pow(BASE, stride, MOD), per)
        v, t = np.empty((per, width), lanes.dtype), np.empty((per, width), lanes.dtype)
        wide = v.view(np.uint64) if bits == 64 else np.empty((per, width), np.uint64)
        for r0 in range(0, rows, per):
            n = min(per, rows - r0)
            np.multiply(lanes[r0:r0 + n, c0:c0 + width], scramble, out=v[:n])
            np.right_shift(v[:n], half, out=t[:n])
            np.bitwise_xor(v[:n], t[:n], out=v[:n])  # g(b), in the element's width
            if bits < 64:  # widened with its sign
                np.copyto(wide[:n].view(np.int64), v[:n].view(f"int{bits}"), casting="unsafe")
            np.multiply(wide[:n], table[:width], out=wide[:n])  # R**c
            sums = wide[:n].sum(axis=1, dtype=np.uint64)
            sums *= steps[:n]  # R**(r * stride)
            total += int(sums.sum(dtype=np.uint64)) * pow(BASE, first + r0 * stride + c0, MOD)
    return total % MOD


# --- device (torch: signed integers, which wrap alike) -------------------------------------------

def _device_powers(base: int, count: int, device: Any) -> Any:
    import torch

    key = (base, count, str(device))
    table = _tables.get(key)
    if table is None:
        table = torch.from_numpy(_powers(base, count).view("int64").copy()).to(device)
        if len(_tables) < 64:
            _tables[key] = table
    return table


def _device_sum(ints: Any, first: int, length: int, block: bool) -> int:
    """``_host_sum`` in torch on the tensor's device (one host sync at the end)."""
    import torch

    if block:
        parts = [(ints.reshape(-1, ints.shape[-1]), first, length)]
    else:
        flat = ints.reshape(-1)
        full = flat.numel() // WIDTH * WIDTH
        parts = [(flat[:full].reshape(-1, WIDTH), first, WIDTH), (flat[full:].reshape(1, -1), first + full, WIDTH)]
    acc = torch.zeros((), dtype=torch.int64, device=ints.device)
    for part, start, stride in parts:
        _device_rows(part, start, stride, acc)
    return int(acc.item()) % MOD


def _device_rows(ints: Any, first: int, stride: int, acc: Any) -> None:
    """sum over [r, c] of R**(first + r * stride + c) g(ints[r, c]) into ``acc`` (an int64
    scalar on the device), DEVICE_BATCH elements a step. torch's integers are signed: its
    products wrap alike, its >> copies the sign bit (masked off here), and its widening keeps the
    sign, which the host loop gets by its xor and subtraction."""
    import torch

    rows, cols = ints.shape
    if not rows or not cols:
        return
    bits = 8 * ints.element_size()
    scramble, low = _signed(SCRAMBLE % (1 << bits), bits), (1 << (bits // 2)) - 1
    table = _device_powers(BASE, WIDTH, ints.device)
    for c0 in range(0, cols, WIDTH):
        width = min(WIDTH, cols - c0)
        per = max(1, min(rows, DEVICE_BATCH // width))
        steps = _device_powers(pow(BASE, stride, MOD), per, ints.device)
        for r0 in range(0, rows, per):
            v = ints[r0:r0 + per, c0:c0 + width] * scramble  # a new tensor: never the caller's
            v.bitwise_xor_((v >> (bits // 2)) & low)  # g(b), in the element's width
            u = v.to(torch.int64)
            u.mul_(table[:width])
            sums = u.sum(dim=1)
            sums.mul_(steps[:u.shape[0]])
            acc += sums.sum() * _signed(pow(BASE, first + r0 * stride + c0, MOD))


def _signed(value: int, bits: int = 64) -> int:
    """``value`` (mod 2**bits) as the signed integer of that width with its bits (what torch's
    integer arithmetic takes)."""
    value %= 1 << bits
    return value - (1 << bits) if value >> (bits - 1) else value


# --- conversions, raw bytes, rounding -------------------------------------------------------------

def digest_as(tensor: Any, dtype: str, offset: int = 0, row_length: int | None = None) -> int:
    """The digest of a torch tensor converted to ``dtype`` (a torch dtype's name, as buckets
    record it: "float32", "bfloat16"): what a receiver reports for a tensor sent in ``dtype``.
    Converted a batch at a time (``_conversion_batch``); ``offset``, ``row_length`` as ``digest``'s."""
    import torch

    kind = getattr(torch, dtype)
    if tensor.dtype == kind:
        return digest(tensor, offset, row_length)
    shape, batch = tuple(tensor.shape), _conversion_batch(tensor)
    length = row_length_of(shape) if row_length is None else int(row_length)
    if row_length is not None and len(shape) >= 2 and shape[-1] != length:  # a block: by rows
        rows = tensor.reshape(-1, shape[-1])
        per = max(1, batch // max(1, shape[-1]))
        return sum(digest(rows[r:r + per].to(kind), offset + r * length, length)
                   for r in range(0, rows.shape[0], per)) % MOD
    flat = tensor.reshape(-1)
    return sum(digest(flat[s:s + batch].to(kind), offset + s, length)
               for s in range(0, flat.numel(), batch)) % MOD


def _conversion_batch(tensor: Any) -> int:
    """Elements converted at a time: ROUND_BATCH on the host, DEVICE_BATCH on a device."""
    return ROUND_BATCH if tensor.device.type == "cpu" else DEVICE_BATCH


def _typed(raw: Any, dtype: str) -> Any:
    """A uint8 numpy array or torch tensor of raw bytes, viewed as integers of ``dtype``'s width."""
    width = itemsize(dtype)
    if hasattr(raw, "element_size"):
        import torch

        return raw.view(getattr(torch, _INT_OF_WIDTH[width]))
    return raw.view(_INT_OF_WIDTH[width])


def digest_raw(raw: Any, dtype: str, shape: Sequence[int]) -> int:
    """The digest of a tensor given as its raw bytes (a uint8 numpy array or torch tensor), its
    dtype's name and its shape: what ``digest`` gives of the tensor itself."""
    ints = _typed(raw, dtype)
    if ints.shape[0] != numel(shape):
        raise ValueError(f"{raw.shape[0]} bytes of {dtype} are {ints.shape[0]} elements, not a tensor of "
                         f"shape {tuple(shape)}")
    return digest(ints, 0, row_length_of(shape))


def recorded(named_tensors: Iterable[tuple[str, Any]], into: dict) -> Iterator[tuple[str, Any]]:
    """``named_tensors`` passed through, each name's dtype noted in ``into``: what a receiver
    was sent, whose digests it reports once loaded."""
    for name, tensor in named_tensors:
        into[name] = str(tensor.dtype).removeprefix("torch.")
        yield name, tensor


def rounded_digests(tensor: Any, dtype: str, variants: Iterable[str],
                    shape: Sequence[int] | None = None) -> dict[str, int]:
    """For a float32 tensor (torch, or raw uint8 bytes as numpy/torch with its ``shape``), the
    digest of it rounded to each of ``variants`` and back to float32: what an engine holding it
    in that precision reports (``digest_as(held, "float32")``). Empty for other dtypes or no
    variants. Rounded a batch at a time (``_conversion_batch``)."""
    variants = tuple(variants)
    if dtype != "float32" or not variants:
        return {}
    import torch

    if not hasattr(tensor, "element_size"):  # numpy bytes (an object store's copy: read-only, only read)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(tensor)
    shape = tuple(tensor.shape) if shape is None else tuple(shape)
    flat = tensor.view(torch.float32) if tensor.dtype == torch.uint8 else tensor.detach()
    flat = flat.reshape(-1)
    length, out, batch = row_length_of(shape), dict.fromkeys(variants, 0), _conversion_batch(flat)
    for s in range(0, flat.numel(), batch):
        part = flat[s:s + batch]
        for v in variants:
            out[v] += digest(part.to(getattr(torch, v)).to(torch.float32), s, length)
    return {v: d % MOD for v, d in out.items()}


# --- comparison -----------------------------------------------------------------------------------

def compare(sent: Mapping[str, int], held: Mapping[str, int],
            rounded: Mapping[str, Mapping[str, int]] | None = None,
            shapes: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """What differs between the digests a sender sent (per tensor name) and those a receiver
    reports of its engine (per name, or per ``FUSED``-joined names, in the order the engine
    holds them): every sent tensor must be covered exactly once. ``rounded``: per name, the
    digests of the tensor rounded to a lower precision (``rounded_digests``), which a held
    tensor may match instead. ``shapes``: per name, the sent shape, which places each part of a
    joined key (``combine``). Returns readable differences, empty when they agree."""
    wrong, covered, rounded, shapes = [], set(), rounded or {}, shapes or {}
    for key, value in held.items():
        names = key.split(FUSED)
        unknown = [n for n in names if n not in sent]
        if unknown:
            wrong.append(f"{key}: the engine reports a tensor the push did not send ({unknown[0]})")
            continue
        covered.update(names)
        unplaced = [n for n in names[:-1] if n not in shapes]
        if unplaced:
            wrong.append(f"{key}: the sent shape of {unplaced[0]} was not recorded, so the tensors "
                         f"it joins cannot be placed (Sent.shapes)")
            continue
        sizes = [numel(shapes[n]) for n in names[:-1]] + [0]
        variants = set.intersection(*(set(rounded.get(n, {})) for n in names))
        expected = {combine([sent[n] for n in names], sizes)} | {
            combine([rounded[n][v] for n in names], sizes) for v in variants}
        if value % MOD not in expected:
            wrong.append(f"{key}: the engine holds other values than were sent")
    missing = [n for n in sent if n not in covered]
    if missing:
        wrong.append(f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                     + ": not reported as held by the engine")
    return wrong


@dataclasses.dataclass
class Sent:
    """What one push sent, from the sender's side: per tensor name its digest, dtype, shape and
    the index of its bucket (of its broadcast, for a transport without buckets), and the bytes
    in all and of the largest bucket."""

    digests: dict[str, int] = dataclasses.field(default_factory=dict)
    rounded: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # name -> variant -> digest
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    shapes: dict[str, tuple] = dataclasses.field(default_factory=dict)
    buckets: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    peak_bytes: int = 0
    count: int = 0  # buckets (or broadcasts)

    def add(self, names: Any, dtypes: Any, digests: Any, nbytes: int, rounded: Any = None,
            shapes: Any = None) -> None:
        """One bucket's tensors (or one tensor's), ``nbytes`` on the wire; ``digests`` None: not
        taken (a record of the sizes); ``rounded``: their
        ``rounded_digests``, if taken; ``shapes``: theirs (a fused comparison needs them)."""
        for i, (name, dtype) in enumerate(zip(names, dtypes, strict=True)):
            self.dtypes[name], self.buckets[name] = dtype, self.count
            if digests is not None:
                self.digests[name] = int(digests[i])
            if rounded and rounded[i]:
                self.rounded[name] = dict(rounded[i])
            if shapes is not None:
                self.shapes[name] = tuple(int(d) for d in shapes[i])
        self.count += 1
        self.bytes += int(nbytes)
        self.peak_bytes = max(self.peak_bytes, int(nbytes))

    def add_bucket(self, bucket: dict, digests: Any = None, rounded: Any = None) -> None:
        """A bucket, with its own digests or those given (``buckets.bucket_digests``)."""
        self.add(bucket["names"], bucket["dtypes"], digests if digests is not None else bucket.get("digests"),
                 sum(a.nbytes for a in bucket["arrays"]), rounded if rounded is not None else bucket.get("rounded"),
                 bucket.get("shapes"))
