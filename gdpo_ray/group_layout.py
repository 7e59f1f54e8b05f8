"""Group layouts: rows of a batch in contiguous prompt groups, and the few reductions over
groups that the advantage estimators (``gdpo_ray.advantages``) are written in.

``layout(group_index)`` returns (order, labels, groups): ``order`` puts the rows into contiguous
groups (None: they are already), ``labels`` the group_index value of each group, ``groups`` a
``UniformGroups`` (B groups of G rows: reductions are small matrix products) or a
``RaggedGroups`` (any sizes: numpy's reduceat). Both offer, for [N, C] row values and [B, C]
group values: ``sum``, ``sum_squares``, ``expand``, ``minus_expanded``, ``subtract_per_group``, ``row_dot``,
``first``, ``nanmin``, ``nanmax``, ``zero``, and ``sizes`` [B]. Every group must have >= 2 rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np




class UniformGroups:
    """B contiguous groups of G rows each: reductions are small matrix products (BLAS)."""

    def __init__(self, num_groups: int, group_size: int) -> None:
        self.num_groups, self.group_size = num_groups, group_size
        self.sizes = np.full(num_groups, group_size)

    def _fold(self, cols: int, dtype: np.dtype) -> np.ndarray:
        # [G*C, C]: row g*C + c has a 1 in column c, so Y.reshape(B, G*C) @ fold sums over g.
        return np.tile(np.eye(cols, dtype=dtype), (self.group_size, 1))

    def sum(self, y: np.ndarray) -> np.ndarray:  # [N, C] -> [B, C]
        b, c = self.num_groups, y.shape[1]
        return y.reshape(b, self.group_size * c) @ self._fold(c, y.dtype)

    def sum_squares(self, y: np.ndarray) -> np.ndarray:  # [N, C] -> [B, C]
        return self.sum(y * y)  # one elementwise pass and a BLAS product: faster than einsum

    def expand(self, z: np.ndarray) -> np.ndarray:  # [B, C] -> [N, C]
        c = z.shape[1]
        return np.broadcast_to(z[:, None, :], (self.num_groups, self.group_size, c)).reshape(-1, c)

    def minus_expanded(self, y: np.ndarray, z: np.ndarray) -> np.ndarray:  # y - expand(z), in z's dtype
        b, g, c = self.num_groups, self.group_size, y.shape[1]
        out = np.tile(z, (1, g))  # [B, G*C]: contiguous operands (a broadcast over C = 4 is ~3x slower)
        np.subtract(y.reshape(b, g * c), out, out=out)
        return out.reshape(-1, c)

    def subtract_per_group(self, v: np.ndarray, z: np.ndarray) -> None:  # v[n] -= z[g(n)]
        v.reshape(self.num_groups, self.group_size)[...] -= z[:, None]

    def row_dot(self, y: np.ndarray, z: np.ndarray) -> np.ndarray:  # sum_c y[n, c] z[g(n), c]
        b, g, c = self.num_groups, self.group_size, y.shape[1]
        return np.matmul(y.reshape(b, g, c), z[:, :, None]).reshape(-1)

    def first(self, y: np.ndarray) -> np.ndarray:
        return y[:: self.group_size]

    def nanmin(self, y: np.ndarray) -> np.ndarray:
        return self._reduce(np.fmin, y)

    def nanmax(self, y: np.ndarray) -> np.ndarray:
        return self._reduce(np.fmax, y)

    def _reduce(self, op: np.ufunc, y: np.ndarray) -> np.ndarray:  # [N, C] -> [B, C]
        b, g = self.num_groups, self.group_size
        if y.shape[1] == 1:  # transposed, the reduction runs down contiguous rows (~5x faster)
            return op.reduce(np.ascontiguousarray(y.reshape(b, g).T), axis=0)[:, None]
        y3 = y.reshape(b, g, -1)  # a reduction over the middle axis is slow: G elementwise steps
        out = y3[:, 0].copy()
        for j in range(1, g):
            op(out, y3[:, j], out=out)
        return out

    def zero(self, v: np.ndarray, mask: np.ndarray) -> None:  # v[n] = 0 in the masked groups
        rows = v.reshape(self.num_groups, self.group_size)
        rows[mask] = np.where(np.isnan(rows[mask]), np.nan, 0.0)


class RaggedGroups:
    """Contiguous groups of unequal sizes: rows starts[b] .. starts[b] + sizes[b] - 1."""

    def __init__(self, starts: np.ndarray, sizes: np.ndarray) -> None:
        self.starts, self.sizes = starts, sizes
        self.num_groups = len(starts)

    def sum(self, y: np.ndarray) -> np.ndarray:
        return np.add.reduceat(y, self.starts, axis=0)

    def sum_squares(self, y: np.ndarray) -> np.ndarray:
        return np.add.reduceat(y * y, self.starts, axis=0)

    def expand(self, z: np.ndarray) -> np.ndarray:
        return np.repeat(z, self.sizes, axis=0)

    def minus_expanded(self, y: np.ndarray, z: np.ndarray) -> np.ndarray:
        d = self.expand(z)
        return np.subtract(y, d, out=d, dtype=d.dtype)

    def subtract_per_group(self, v: np.ndarray, z: np.ndarray) -> None:
        v -= np.repeat(z, self.sizes)

    def row_dot(self, y: np.ndarray, z: np.ndarray) -> np.ndarray:
        return np.einsum("nc,nc->n", y, self.expand(z))

    def first(self, y: np.ndarray) -> np.ndarray:
        return y[self.starts]

    def nanmin(self, y: np.ndarray) -> np.ndarray:
        return np.fmin.reduceat(y, self.starts, axis=0)

    def nanmax(self, y: np.ndarray) -> np.ndarray:
        return np.fmax.reduceat(y, self.starts, axis=0)

    def zero(self, v: np.ndarray, mask: np.ndarray) -> None:
        rows = np.repeat(mask, self.sizes) & ~np.isnan(v)
        v[rows] = 0.0


def layout(group_index: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, Any]:
    """Returns (order, labels, groups): rows ``order`` (None = as given) form contiguous groups."""
    n = len(group_index)
    if group_index.dtype.kind not in "iub":
        labels, codes = np.unique(group_index, return_inverse=True)
        order = np.argsort(codes, kind="stable")
        return order, labels, _contiguous(codes[order], labels)
    starts = np.flatnonzero(group_index[1:] != group_index[:-1]) + 1
    starts = np.concatenate(([0], starts)) if n else starts
    run_labels = group_index[starts]
    if np.all(run_labels[1:] > run_labels[:-1]) or len(np.unique(run_labels)) == len(run_labels):
        return None, run_labels, _contiguous(group_index, run_labels, starts)
    order = np.argsort(group_index, kind="stable")
    return order, *_sorted_layout(group_index[order])


def _sorted_layout(sorted_index: np.ndarray) -> tuple[np.ndarray, Any]:
    starts = np.concatenate(([0], np.flatnonzero(sorted_index[1:] != sorted_index[:-1]) + 1))
    labels = sorted_index[starts]
    return labels, _contiguous(sorted_index, labels, starts)


def _contiguous(index: np.ndarray, labels: np.ndarray, starts: np.ndarray | None = None) -> Any:
    n = len(index)
    if starts is None:
        starts = np.concatenate(([0], np.flatnonzero(index[1:] != index[:-1]) + 1))
    sizes = np.diff(np.append(starts, n))
    if len(sizes) and sizes.min() < 2:
        b = int(np.argmin(sizes))
        raise ValueError(
            f"group_index: group {labels[b].tolist()!r} has {sizes[b]} rollout; every prompt group needs "
            "at least 2 rollouts to be normalized (use group_size >= 2)"
        )
    if len(sizes) and sizes[0] * len(sizes) == n and np.all(sizes == sizes[0]):
        return UniformGroups(len(sizes), int(sizes[0]))
    return RaggedGroups(starts, sizes)
