"""Group-relative advantages for several rewards: GDPO and GRPO (pure array math).

For prompt group i with rollouts j and K rewards r_k (weights w_k, default 1):

    grpo          t_ij = sum_k w_k r_k,ij          A_ij = (t_ij - mean_j t) / (std_j t + eps)
    grpo_no_std   A_ij = t_ij - mean_j t           (no std, no batch normalization)
    gdpo          A_k,ij = (r_k,ij - mean_j r_k) / (std_j r_k + eps)     each reward in its group
                  S_ij   = sum_k w_k A_k,ij                              weights act on normalized A
                  Â_ij   = (S_ij - mean_batch S) / (std_batch S + eps)   one scalar per rollout
    gdpo_no_std   per-reward centering only (A_k,ij = r_k,ij - mean_j r_k), then the same sum
                  and batch normalization.

Conventions (DESIGN.md §1):
- std is unbiased (ddof = 1): a group (0, 1) normalizes to (-0.7071, 0.7071).
- Zero spread: when every valid value of a column in a group is equal (max == min, exactly), or
  fewer than two values are valid, the column contributes exactly 0 for that group.
- NaN means "could not be computed": left out of its column's group statistics, contributes 0.
  For GRPO a NaN in any reward makes the rollout unscorable (advantage 0, out of the statistics).
- A rollout with no valid reward gets advantage 0 and is left out of the batch statistics.
- Batch std of 0 (every S equal, or fewer than two scored rollouts): Â = 0, no division.
- The batch mean of S is 0 by construction (S sums to 0 within every group), so Â = S / (std +
  eps) with std = sqrt(sum S^2 / (n - 1)): the float sum's residue is never subtracted, and a
  rollout whose S is 0 keeps Â = 0 exactly.
- "The batch" is every rollout passed in one call: pass the whole training step.
- Every group must have at least two rollouts; groups may differ in size and rows may come in
  any order (groups whose rows are contiguous and equally sized take the fast path).

Rounding residue (the same rule for GRPO's weighted totals and GDPO's weighted sum S): a value
computed as a weighted sum is exact only up to rounding, so totals that are equal in exact
arithmetic (0.1 + 0.5 and 0.2 + 0.4), or an S that two rewards cancel (r2 = 1 - r1 with equal
weights: A2 = -A1, S = 0 up to 1e-17), would come out with a spread of a few ulps, which eps = 0
blows up to order-1 advantages. The ulp is that of the rewards as they came in: float32 rewards
carry their own rounding (0.1f + 0.5f and 0.2f + 0.4f differ by 7e-9 exactly). So, per group g:

    tol_g = 16 ulp M_g                   ulp = 2.2e-16 for float64 rewards, 1.2e-7 otherwise
    M_g   = sum_k |w_k| m_k,g            the size of the terms of group g's weighted sum:
    m_k,g = |mean_j r_k| + std_j r_k (G-1)/sqrt(G)     a bound of max_j |r_k,ij| (for n values
            of unbiased std s, max |r - mean| <= s (n-1)/sqrt(n)); for GDPO divided by
            (std_j r_k + eps), in A_k's units; 0 where r_k has zero spread (its terms are exact 0)

and when the spread (max - min) of the group's totals, or of its S, is <= tol_g, it is rounding
residue: the group's values are set to exactly 0 (GRPO: the totals have zero spread; GDPO: S = 0
for the group; ``AdvantageDetails.cancelled`` marks such groups where a weighted reward varies). A real spread is many orders of magnitude
above tol_g (GRPO's (0, 1e-6) at eps = 0 is still (-0.7071, 0.7071)). Measured over 6,000
random cancelling groups (G 2-256, K 2-5, float32 and float64, offsets up to 1e4): the residue
never exceeded 2.5 ulp M_g, whatever G and K (M_g already sums the K terms); 16 leaves a
margin of 6. The batch statistics need no
rule of their own: S has zero mean in every group, so once residue groups are exactly 0 the batch
std of S is exactly 0 precisely when no group carries signal.

Identical reward rows give identical totals: GRPO's weights multiply the differences from the
group's smallest values, summed one reward at a time (never a BLAS product, whose blocking rounds
equal rows differently), so equal rows give bitwise equal totals and the group has zero spread.

Precision: the statistics are computed in float64 whatever the input dtype (float32 rewards are
exact in float64); advantages come back float64 for float64 input, else float32. Exactness of the
zero-spread rule does not depend on rounding: values are shifted by a member of their group before
any statistic is taken, so equal values give exactly zero deviations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from gdpo_ray.group_layout import UniformGroups, layout
from gdpo_ray.normalization import (GroupNormalized, cancel_residue, normalize_batch, normalize_in_groups,
                                    reject_infinite)
from gdpo_ray.registry import Registry

__all__ = [
    "ESTIMATORS",
    "AdvantageDetails",
    "EstimatorOutput",
    "compute_advantages",
    "compute_advantage_details",
    "informative_groups",
]


@dataclasses.dataclass(frozen=True)
class AdvantageDetails:
    """Advantages with the intermediate values, for metrics (numpy arrays, whatever came in).

    C is the number of normalized columns: K for gdpo*, 1 (the weighted total) for grpo*.
    Everything but ``advantages`` is float64.
    """

    advantages: Any  # [N] final advantages, the type of the input (what compute_advantages returns)
    summed: np.ndarray  # [N] before batch normalization (S for gdpo*, equal to advantages for grpo*)
    reward_advantages: np.ndarray  # [N, C] unweighted group-normalized values (0 where NaN/degenerate)
    contributions: np.ndarray  # [N, K] reward k's weighted part of summed (sums to summed over k,
    #                            except in cancelled groups, where summed is 0)
    scored: np.ndarray  # [N] bool: the rollout entered the statistics (has a valid reward)
    group_labels: np.ndarray  # [B] the group_index value of each group
    group_sizes: np.ndarray  # [B] rollouts per group
    group_count: np.ndarray  # [B, C] valid values per group and column
    group_mean: np.ndarray  # [B, C] mean of the valid values (NaN where none)
    group_std: np.ndarray  # [B, C] unbiased std of the valid values (NaN where fewer than two)
    zero_spread: np.ndarray  # [B, C] bool: the column contributes 0 for the group
    cancelled: np.ndarray  # [B] bool: a reward of non-zero weight varies, but the weighted sum
    #                        has no spread (up to rounding residue): the rewards cancel, S = 0
    batch_mean: float  # mean of S over scored rollouts: 0 by construction (NaN for grpo*)
    batch_std: float  # unbiased std of S over scored rollouts (NaN for grpo*)


# --------------------------------------------------------------------------------------------
# Estimators. An estimator is a function (rewards [N, K] float64 in contiguous group layout,
# groups (gdpo_ray.group_layout), weights [K], eps, ulp of the input dtype) -> EstimatorOutput,
# registered under a name (@ESTIMATORS.register("name"); the config's training.estimator picks
# it). normalize_in_groups, cancel_residue and normalize_batch (gdpo_ray.normalization) are its
# building blocks; _gdpo and _grpo below are written in them.


@dataclasses.dataclass
class EstimatorOutput:
    """What an estimator returns (in group layout; ``compute_advantage_details`` turns it into
    ``AdvantageDetails`` in the caller's row order)."""

    advantages: np.ndarray  # [N] final advantages
    summed: np.ndarray  # [N] before batch normalization
    scored: np.ndarray | None  # [N] bool: entered the statistics (None: every rollout)
    normalized: GroupNormalized  # the group statistics of the normalized columns
    batch_mean: float
    batch_std: float
    cancelled: np.ndarray  # [B] bool
    group_offset: np.ndarray  # [B, C] added to the normalized column's group mean (GRPO's reference total)
    contributions: Callable[[], np.ndarray]  # -> [N, K] each reward's weighted part of summed


#: (rewards [N, K] float64 in contiguous groups, groups, weights [K], eps, ulp of the input dtype)
Estimator = Callable[[np.ndarray, Any, np.ndarray, float, float], EstimatorOutput]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def _gdpo_summed(rewards: np.ndarray, groups: Any, weights: np.ndarray, eps: float, ulp: float,
                 use_std: bool, finite: bool | None = None):
    """GDPO before batch normalization (group-local): (norm, S, cancelled groups, scored rows)."""
    norm = normalize_in_groups(rewards, groups, use_std, eps, finite)
    summed = norm.contributions(groups, np.broadcast_to(weights, norm.mean_d.shape))
    flat = cancel_residue(summed, groups, norm.magnitude() @ np.abs(weights), ulp)
    cancelled = flat & ~norm.degenerate[:, weights != 0].all(axis=1)
    return norm, summed, cancelled, None if norm.valid is None else norm.valid.any(axis=1)


def _gdpo(rewards: np.ndarray, groups: Any, weights: np.ndarray, eps: float, ulp: float,
          use_std: bool):
    norm, summed, cancelled, scored = _gdpo_summed(rewards, groups, weights, eps, ulp, use_std)
    advantages, mean, std = normalize_batch(summed, scored, eps)
    return EstimatorOutput(advantages, summed, scored, norm, mean, std, cancelled,
                            np.zeros_like(norm.ref), lambda: norm.per_column(groups) * weights)


def _grpo(rewards: np.ndarray, groups: Any, weights: np.ndarray, eps: float, ulp: float,
          use_std: bool):
    x, unscorable = rewards, None
    if not np.isfinite(rewards).all():
        reject_infinite(rewards, "rewards")
        unscorable = np.isnan(rewards).any(axis=1)  # a NaN reward makes the rollout unscorable
        x = rewards.copy()
        x[unscorable] = np.nan
    # each reward shifted by a member of its group (0 where unscorable), with its statistics
    per_reward = normalize_in_groups(x, groups, use_std=False, eps=eps)
    d = per_reward.d
    total = d[:, 0] * weights[0]
    for k in range(1, len(weights)):  # one reward at a time: equal rows give bitwise equal totals
        total += d[:, k] * weights[k]
    if unscorable is not None:
        total[unscorable] = np.nan
    flat = cancel_residue(total, groups, per_reward.magnitude() @ np.abs(weights), ulp)
    cancelled = flat & ~per_reward.degenerate[:, weights != 0].all(axis=1)
    norm = normalize_in_groups(total[:, None], groups, use_std, eps)
    advantages = norm.contributions(groups, np.ones_like(norm.mean_d))
    scored = None if norm.valid is None else norm.valid[:, 0]

    def contributions() -> np.ndarray:  # w_k (r_k - mean_g r_k) / (std_g t + eps) per reward
        out = per_reward.per_column(groups) * weights * groups.expand(norm.inv_std)
        if unscorable is not None:
            out[unscorable] = 0.0
        return out

    offset = (per_reward.ref @ weights)[:, None]  # t = sum_k w_k (ref_k + d_k)
    return EstimatorOutput(advantages, advantages, scored, norm, float("nan"), float("nan"),
                            cancelled, offset, contributions)


@ESTIMATORS.register("gdpo")
def gdpo(rewards, groups, weights, eps, ulp):
    """Each reward normalized in its group (std), weighted sum, batch normalization."""
    return _gdpo(rewards, groups, weights, eps, ulp, use_std=True)


@ESTIMATORS.register("gdpo_no_std")
def gdpo_no_std(rewards, groups, weights, eps, ulp):
    """Each reward centred in its group, weighted sum, batch normalization."""
    return _gdpo(rewards, groups, weights, eps, ulp, use_std=False)


@ESTIMATORS.register("grpo")
def grpo(rewards, groups, weights, eps, ulp):
    """Weighted sum of the rewards, normalized in its group (std)."""
    return _grpo(rewards, groups, weights, eps, ulp, use_std=True)


@ESTIMATORS.register("grpo_no_std")
def grpo_no_std(rewards, groups, weights, eps, ulp):
    """Weighted sum of the rewards, centred in its group; no batch normalization."""
    return _grpo(rewards, groups, weights, eps, ulp, use_std=False)


# --------------------------------------------------------------------------------------------
# Public entry points.


def compute_advantages(
    rewards: Any,
    group_index: Any,
    *,
    estimator: str,
    weights: Any = None,
    eps: float = 1e-6,
) -> Any:
    """One advantage per rollout.

    Args:
        rewards: [N, K] rewards of N rollouts (a [N] vector means K = 1); NaN = could not be
            computed. numpy array or torch tensor.
        group_index: [N] the prompt group of each rollout (integers, or any labels numpy can
            sort). Groups need >= 2 rollouts, may differ in size, rows may come in any order.
        estimator: a name in ``ESTIMATORS``: "gdpo", "gdpo_no_std", "grpo", "grpo_no_std".
        weights: [K] finite reward weights (default all 1).
        eps: added to every std before dividing (>= 0; 0 reproduces the paper's numbers).

    Returns:
        [N] advantages, a torch tensor (on the input's device) if ``rewards`` is one, else a
        numpy array; float64 for float64 input, else float32.
    """
    chunked = _chunked(rewards, group_index, estimator, weights, eps)
    if chunked is not None:
        return chunked
    run = _Run(rewards, group_index, estimator, weights, eps)
    return run.result(run.out.advantages)


#: rows per chunk of ``compute_advantages`` on a large batch of equal contiguous groups: the
#: float64 temporaries of one chunk stay in the cache (benchmarks/advantages.py)
CHUNK_ROWS = 1 << 15
#: the built-in estimators, by how their advantages come from group-local parts: GDPO's S is
#: group-local then batch-normalized; GRPO's advantages are group-local
_LOCAL = {"gdpo": True, "gdpo_no_std": False}
_GROUP_ONLY = {"grpo": True, "grpo_no_std": False}


def _chunked(rewards: Any, group_index: Any, estimator: str, weights: Any, eps: float) -> Any:
    """``compute_advantages`` of a built-in estimator over a large batch of equal contiguous
    groups in rows order, computed chunk by chunk of whole groups (the same arithmetic per
    group; GDPO's batch normalization over the whole batch after); None for any other input."""
    x, like = _to_numpy(rewards, "rewards")
    index, _ = _to_numpy(group_index, "group_index")
    if (estimator not in _LOCAL and estimator not in _GROUP_ONLY) or x.ndim != 2 or len(x) < 2 * CHUNK_ROWS \
            or x.dtype.kind != "f" or index.shape != (len(x),) or index.dtype.kind not in "iu":
        return None
    order, _, groups = layout(index)
    if order is not None or not isinstance(groups, UniformGroups):
        return None
    w = _check_weights(weights, x.shape[1])
    if not (np.isfinite(eps) and eps >= 0):
        return None  # _Run says what is wrong
    finite = bool(np.isfinite(x).all())
    if not finite:
        reject_infinite(x, "rewards")  # the row of the whole batch, not of a chunk
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    ulp, g = float(np.finfo(dtype).eps), groups.group_size
    step = max(CHUNK_ROWS // g, 1) * g
    out = np.empty(len(x), np.float64)
    scored = None
    for a in range(0, len(x), step):
        chunk = x[a:a + step] if x.dtype in (np.float32, np.float64) else np.asarray(x[a:a + step], np.float64)
        part = UniformGroups(len(chunk) // g, g)
        if estimator in _LOCAL:  # the float32 rewards as they are: the statistics are float64
            _, out[a:a + len(chunk)], _, ok = _gdpo_summed(chunk, part, w, float(eps), ulp, _LOCAL[estimator],
                                                           finite if finite else None)
            if ok is not None:
                if scored is None:
                    scored = np.ones(len(x), bool)
                scored[a:a + len(chunk)] = ok
        else:
            out[a:a + len(chunk)] = _grpo(np.asarray(chunk, np.float64), part, w, float(eps), ulp,
                                          _GROUP_ONLY[estimator]).advantages
    if estimator in _LOCAL:
        out = normalize_batch(out, scored, eps)[0]
    return like(out.astype(dtype, copy=False))


def compute_advantage_details(
    rewards: Any,
    group_index: Any,
    *,
    estimator: str,
    weights: Any = None,
    eps: float = 1e-6,
) -> AdvantageDetails:
    """Like ``compute_advantages``, with per-reward advantages and group statistics.

    Everything but ``advantages`` is a numpy array, in the input's row order (rows) or in group
    order (``group_labels``: first appearance for contiguous groups, sorted labels otherwise).
    """
    run = _Run(rewards, group_index, estimator, weights, eps)
    out, norm = run.out, run.out.normalized
    count = np.asarray(norm.count)
    with np.errstate(invalid="ignore"):
        group_mean = np.where(count > 0, out.group_offset + norm.ref + norm.mean_d, np.nan)
    return AdvantageDetails(
        advantages=run.result(out.advantages),
        summed=run.rows(out.summed),
        reward_advantages=run.rows(norm.per_column(run.groups)),
        contributions=run.rows(out.contributions()),
        scored=run.rows(np.ones(len(out.summed), bool) if out.scored is None else out.scored),
        group_labels=run.labels,
        group_sizes=np.asarray(run.groups.sizes),
        group_count=count.astype(np.int64),
        group_mean=group_mean,
        group_std=np.where(count >= 2, norm.std, np.nan),
        zero_spread=norm.degenerate,
        cancelled=out.cancelled,
        batch_mean=out.batch_mean,
        batch_std=out.batch_std,
    )


def informative_groups(
    rewards: Any,
    group_index: Any,
    *,
    estimator: str,
    weights: Any = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """[B] bool, one per group in the order the groups first appear in ``group_index``: the
    group would get a non-zero training advantage before batch normalization (S for gdpo*, the
    advantage for grpo*) under these weights. What dynamic sampling keeps: a group in which only
    a weight-0 reward varies, or whose rewards cancel (rounding residue), is not informative; a
    GRPO group whose weighted totals differ is, even where no single reward is constant.

    Arguments as for ``compute_advantages``.
    """
    run = _Run(rewards, group_index, estimator, weights, eps)
    nonzero = run.rows(run.out.summed != 0)
    index, _ = _to_numpy(group_index, "group_index")
    _, first, inverse = np.unique(index, return_index=True, return_inverse=True)
    flags = np.zeros(len(first), bool)
    np.logical_or.at(flags, inverse.reshape(-1), nonzero)
    return flags[np.argsort(first, kind="stable")]


class _Run:
    """Checks the arguments, lays the rows out in contiguous groups and runs the estimator."""

    def __init__(self, rewards: Any, group_index: Any, estimator: str, weights: Any, eps: float):
        fn = ESTIMATORS.get(estimator)
        x, self.like = _to_numpy(rewards, "rewards")
        if x.ndim == 1:
            x = x[:, None]
        if x.ndim != 2:
            raise ValueError(f"rewards must be [N, K] (N rollouts, K rewards); got shape {x.shape}")
        self.dtype = np.float64 if x.dtype == np.float64 else np.float32
        x = np.asarray(x, dtype=np.float64)
        index, _ = _to_numpy(group_index, "group_index")
        if index.shape != (x.shape[0],):
            raise ValueError(
                f"group_index must be [N] with N = {x.shape[0]} (one group per rollout of "
                f"rewards); got shape {index.shape}"
            )
        w = _check_weights(weights, x.shape[1])
        if not (np.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
        if x.shape[0] == 0:
            raise ValueError("rewards is empty: there must be at least one group of rollouts")
        self.order, self.labels, self.groups = layout(index)
        ulp = float(np.finfo(self.dtype).eps)  # the resolution of the values as they came in
        self.out = fn(x if self.order is None else x[self.order], self.groups, w, float(eps), ulp)

    def result(self, a: np.ndarray) -> Any:
        """Final advantages in the caller's row order, dtype and array type."""
        return self.like(self.rows(a).astype(self.dtype, copy=False))

    def rows(self, a: np.ndarray) -> np.ndarray:
        """Back from group layout to the caller's row order."""
        if self.order is None:
            return a
        out = np.empty_like(a)
        out[self.order] = a
        return out


def _check_weights(weights: Any, k: int) -> np.ndarray:
    if weights is None:
        return np.ones(k)
    w, _ = _to_numpy(weights, "weights")
    w = np.asarray(w, dtype=np.float64).reshape(-1)
    if w.shape != (k,):
        raise ValueError(f"weights must have one entry per reward (K = {k}); got {w.size}")
    if not np.isfinite(w).all():
        raise ValueError(f"weights must be finite numbers; got {w.tolist()}")
    return w


def _to_numpy(a: Any, name: str) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """(numpy view of a, function that returns a result in a's array type)."""
    if type(a).__module__.startswith("torch"):
        import torch

        device = a.device
        t = a.detach()
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            t = t.float()
        return t.cpu().numpy(), lambda r: torch.from_numpy(r).to(device)
    try:
        return np.asarray(a), lambda r: r
    except Exception as err:  # pragma: no cover - numpy's own conversion errors
        raise ValueError(f"{name} must be a numpy array or torch tensor: {err}") from err
