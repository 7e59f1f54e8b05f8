"""The host half of the weight digest (``gdpo_ray.weights.digest``), compiled by numba: each
element read once, g and the multiply by its power of R in 64-bit lanes the compiler vectorizes,
without the GIL (a sender's or receiver's thread digests while another works). About 2x one
memory copy of the bytes (``benchmarks/weight_sync.py``: digest_over_memcpy), where the same
arithmetic as numpy's array operations took about 3.6x. Compiled on first use and cached on
disk where numba finds a writable place (beside this file, or the user's cache directory), so a
later process pays only the load; where none is writable, compiled in each process."""

from __future__ import annotations

import numba
import numpy as np


def _compiled(fn):
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available" (read-only)
        return numba.njit(nogil=True, boundscheck=False)(fn)


@_compiled
def _run(seg, table, mask, half, sign, scramble):
    """sum_c table[c] * g(seg[c]): g(b) = v ^ (v >> half), v = b * scramble masked to the
    element's w bits, read as signed w bits (``sign`` = 2**(w-1), 0 for 64-bit) and widened."""
    acc = np.uint64(0)
    for c in range(seg.shape[0]):
        v = (np.uint64(seg[c]) * scramble) & mask
        v ^= v >> half
        acc += ((v ^ sign) - sign) * table[c]
    return acc


@_compiled
def _rows(x, table, first, row_step, chunk_step, mask, half, sign, scramble):
    """sum over [r, c] of R**(p(r) + c) g(x[r, c]), p(0) given as ``first`` = R**p(0), each
    next row's R**p(r) the last one's times ``row_step``, a row in pieces of the table's length
    (``chunk_step`` = R**that length)."""
    total, start = np.uint64(0), first
    width = table.shape[0]
    for r in range(x.shape[0]):
        at = start
        for c0 in range(0, x.shape[1], width):
            total += _run(x[r, c0:c0 + width], table, mask, half, sign, scramble) * at
            at *= chunk_step
        start *= row_step
    return total


def rows_sum(lanes: np.ndarray, table: np.ndarray, first: int, row_step: int, chunk_step: int,
             scramble: int) -> int:
    """``_rows`` of a C-contiguous 2-D array of unsigned integers (w bits: g works in their
    width) with powers given mod 2**64 as Python ints; the sum mod 2**64."""
    bits = 8 * lanes.itemsize
    u = np.uint64
    return int(_rows(lanes, table, u(first), u(row_step), u(chunk_step), u((1 << bits) - 1),
                     u(bits // 2), u(1 << (bits - 1) if bits < 64 else 0), u(scramble % (1 << 64))))
