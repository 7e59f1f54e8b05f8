"""The estimators' building blocks (pure array math): each reward normalized within its group,
rounding residue cancelled, the batch normalization. ``gdpo_ray.advantages`` writes GDPO and
GRPO in them, and states the conventions they keep (its module docstring): unbiased std, zero
spread exactly 0, NaN left out of the statistics, the residue tolerance tol_g = RESIDUE_ULPS ulp
M_g, statistics in float64.

Groups are a layout of ``gdpo_ray.group_layout`` (rows in contiguous groups): [N, C] values per
row, [B, C] statistics per group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["GroupNormalized", "RESIDUE_ULPS", "cancel_residue", "normalize_batch", "normalize_in_groups",
           "reject_infinite"]


@dataclasses.dataclass
class GroupNormalized:
    """Column c of row n contributes valid[n, c] * (d[n, c] - mean_d[g, c]) * inv_std[g, c]."""

    d: np.ndarray  # [N, C] value minus a member of its group (its first, or its min); 0 where NaN
    valid: np.ndarray | None  # [N, C] bool, None when every value is valid
    ref: np.ndarray  # [B, C] the subtracted member
    count: np.ndarray  # [B, C] valid values
    mean_d: np.ndarray  # [B, C]
    std: np.ndarray  # [B, C] unbiased, 0 where degenerate
    degenerate: np.ndarray  # [B, C] bool: zero spread or fewer than two valid values
    inv_std: np.ndarray  # [B, C] 1 / (std + eps), or 1 without std; 0 where degenerate

    def contributions(self, groups: Any, scale: np.ndarray) -> np.ndarray:
        """[N]: sum over columns of the normalized values times ``scale`` [B, C]."""
        coef = self.inv_std * scale
        if self.valid is None:
            out = groups.row_dot(self.d, coef)
            groups.subtract_per_group(out, np.einsum("bc,bc->b", self.mean_d, coef))
            return out
        return groups.row_dot(self.d, coef) - groups.row_dot(
            self.valid.astype(self.d.dtype), self.mean_d * coef
        )

    def magnitude(self) -> np.ndarray:
        """[B, C]: m = (|mean| + std (n - 1) / sqrt(n)) * inv_std, a bound of max |r| in the
        normalized units (for n values of unbiased std, max |r - mean| <= std (n - 1) / sqrt(n));
        0 where the column is degenerate."""
        n = np.maximum(self.count, 1)
        return (np.abs(self.ref + self.mean_d) + self.std * (n - 1) / np.sqrt(n)) * self.inv_std

    def per_column(self, groups: Any) -> np.ndarray:
        """[N, C]: each column's group-normalized value (0 where NaN or degenerate)."""
        out = (self.d - groups.expand(self.mean_d)) * groups.expand(self.inv_std)
        if self.valid is not None:
            out[~self.valid] = 0.0
        return out


def normalize_in_groups(x: np.ndarray, groups: Any, use_std: bool, eps: float,
                        finite: bool | None = None) -> GroupNormalized:
    """Normalizes each column of x [N, C] (NaN = missing; float32 or float64, the statistics in
    float64) within its group. ``finite``: whether every value is finite, when known."""
    if finite if finite is not None else np.isfinite(x).all():
        valid = None
        ref = np.asarray(groups.first(x), np.float64)
        count = np.broadcast_to(groups.sizes[:, None], ref.shape).astype(np.float64)
    else:
        reject_infinite(x, "rewards")
        valid = ~np.isnan(x)
        ref = np.asarray(groups.nanmin(x), np.float64)
        ref[np.isnan(ref)] = 0.0  # a column with no valid value in the group
        count = groups.sum(valid.astype(np.float64))
    d = groups.minus_expanded(x, ref)  # float64; exact 0 wherever a value equals its group's reference
    if valid is not None:
        d[~valid] = 0.0
    s, q = groups.sum(d), groups.sum_squares(d)
    n = np.maximum(count, 1)
    mean_d = s / n
    # Sum of squared deviations from shifted sums: shifting by a group member bounds the
    # cancellation by the group size, and q == 0 holds exactly when every value is equal.
    ss = np.maximum(q - s * mean_d, 0.0)
    degenerate = (q == 0) | (count < 2)
    std = np.where(degenerate, 0.0, np.sqrt(ss / np.maximum(count - 1, 1)))
    if use_std:
        with np.errstate(divide="ignore"):
            inv_std = np.where(degenerate, 0.0, 1.0 / (std + eps))
    else:
        inv_std = np.where(degenerate, 0.0, 1.0)
    return GroupNormalized(d, valid, ref, count, mean_d, std, degenerate, inv_std)


#: c of the rounding-residue tolerance tol_g = c ulp M_g (module docstring)
RESIDUE_ULPS = 16.0


def cancel_residue(values: np.ndarray, groups: Any, magnitude: np.ndarray, ulp: float) -> np.ndarray:
    """Sets to exactly 0 every group of ``values`` [N] (NaN = not scored, kept) whose spread is
    at most tol_g = RESIDUE_ULPS ulp magnitude_g (S of such a group may also be a constant of a
    few ulps: S sums to 0 in exact arithmetic); returns [B] bool: the groups so set."""
    column = values[:, None]
    spread = (groups.nanmax(column) - groups.nanmin(column))[:, 0]  # NaN for an all-NaN group
    flat = spread <= RESIDUE_ULPS * ulp * magnitude
    if flat.any():
        groups.zero(values, flat)
    return flat


def normalize_batch(s: np.ndarray, scored: np.ndarray | None, eps: float):
    """S / (std + eps) over the scored rollouts; 0 elsewhere and when std is 0.

    The batch mean of S is exactly 0 (S sums to 0 in every group, unscored rows are 0), so it is
    not subtracted: its float value would only be residue, and a rollout of a group without
    signal keeps advantage exactly 0. The std is the unbiased one about that mean."""
    values = s if scored is None else s[scored]
    if values.size < 2 or values.max() == values.min():
        return np.zeros_like(s), 0.0 if values.size else float("nan"), 0.0
    std = np.sqrt(np.dot(values, values) / (values.size - 1))
    out = s * (1.0 / (std + eps))
    if scored is not None:
        out[~scored] = 0.0
    return out, 0.0, float(std)


def reject_infinite(x: np.ndarray, name: str) -> None:
    bad = np.argwhere(np.isinf(x))
    if len(bad):
        row, col = (int(v) for v in bad[0])
        raise ValueError(
            f"{name}[{row}, {col}] is {x[row, col]}: rewards must be finite, or NaN where a "
            f"reward could not be computed ({len(bad)} infinite values in all)"
        )
