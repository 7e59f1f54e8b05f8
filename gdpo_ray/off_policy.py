"""The off-policy correction of an asynchronous update (``training.off_policy``): the weight a
response token's policy-gradient term takes for having been sampled by an older policy.

With ``old_it`` the logprob of token t of rollout i under the policy at the update's start (PPO's
"old" policy) and ``rollout_it`` the one the sampling policy version recorded, over the tokens the
policy sampled (M_it = 1; a tool turn's are not):

    token ratio   rho_it = exp(old_it - rollout_it)

    level  token      u_it = rho_it                                    one unit per token
           sequence   u_i  = exp(sum_t M_it (old_it - rollout_it) / sum_t M_it)
                                                                       the geometric mean, per rollout
           product    u_i  = exp(sum_t M_it (old_it - rollout_it))    the sequence's likelihood ratio
    mode   truncate   w = min(u, cap)                                  truncated IS (TIS)
           mask       w = u if low <= u <= high, else 0               masked IS: a unit outside leaves the loss
           none       w = 1
    outlier [outlier_low, outlier_high]: a rollout with a sampled token whose rho_it lies outside
           leaves the loss (w = 0 on all its tokens), whatever the level and mode.

A sequence unit's weight is each of its tokens'. A sampled token whose ratio is not a number (a
NaN logprob) leaves the loss (its rollout, at the sequence levels), counted as masked; a token
outside the mask is never read. The bounds keep the ratio 1 (``cap >= 1``, ``low <= 1 <= high``,
the outlier bounds likewise): a token the current policy sampled always counts. Weights carry no gradient: the loss's term of
token t is ``pg_it * w_it`` (under GSPO, ``training.ratio_level: sequence``, a rollout's one term
is multiplied by the mean of its sampled tokens' weights). A token that leaves the loss still
counts in ``loss_agg``'s denominators: masking removes its term, it does not scale the others up.

``OffPolicy.parse`` reads the setting (a mapping, ``none``, or null) and names a bad key with the
fix; ``correct`` computes the weights and fills a ``Tally`` (the metrics: see ``Tally.metrics``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

LEVELS = ("token", "sequence", "product")
MODES = ("truncate", "mask", "none")
#: today's default: the truncated token ratio at 2 (what ``training.is_cap: 2`` was)
DEFAULT = {"level": "token", "mode": "truncate", "cap": 2.0}
#: exp() of a log ratio is taken after clamping it here: a product over a long sequence stays finite
LOG_RATIO_BOUND = 80.0


@dataclasses.dataclass(frozen=True)
class OffPolicy:
    """The setting, read (``parse``) and checked."""

    level: str = "token"
    mode: str = "truncate"
    cap: float | None = 2.0  # truncate's bound (> 0)
    low: float | None = None  # mask's bounds: 0 <= low < high (either may be left out: no bound)
    high: float | None = None
    outlier_low: float | None = None  # the outlier-token mask's bounds (token ratios)
    outlier_high: float | None = None

    @classmethod
    def parse(cls, value: Any, where: str = "training.off_policy") -> "OffPolicy":
        """A mapping of these fields, ``"none"`` / null (no correction), or an ``OffPolicy``."""
        if isinstance(value, OffPolicy):
            return value._checked(where)
        if value is None or value == "none":
            return cls(mode="none", cap=None)
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a mapping such as {{level: token, mode: truncate, cap: 2}} "
                             f"or none; got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
                raise ValueError(f"{where}: {key!r} is not one of its keys ({', '.join(names)})"
                                 + (f"; did you mean {near[0]!r}?" if near else ""))
        mode = value.get("mode", "truncate")
        given = dict(value)
        if mode == "truncate":
            given.setdefault("cap", DEFAULT["cap"])
        else:
            given.setdefault("cap", None)
        return cls(**given)._checked(where)

    def _checked(self, where: str) -> "OffPolicy":
        if self.level not in LEVELS:
            raise ValueError(f"{where}.level must be one of {', '.join(LEVELS)} (sequence: the geometric "
                             f"mean of a rollout's token ratios); got {self.level!r}")
        if self.mode not in MODES:
            raise ValueError(f"{where}.mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("cap", "low", "high", "outlier_low", "outlier_high"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ValueError(f"{where}.{name} must be a number >= 0 (or null); got {v!r}")
        if self.mode == "truncate":
            if self.cap is None or not self.cap >= 1:
                raise ValueError(f"{where}: mode truncate needs cap >= 1 (the weight's bound, e.g. 2: below 1 "
                                 f"it would scale down tokens sampled by the current policy); got {self.cap!r}")
            if self.low is not None or self.high is not None:
                raise ValueError(f"{where}: low/high are mode mask's bounds; with mode truncate use cap")
        elif self.cap is not None:
            raise ValueError(f"{where}: cap is mode truncate's bound; mode {self.mode} takes none "
                             f"(mask: low and high)")
        if self.mode == "mask":
            if self.low is None and self.high is None:
                raise ValueError(f"{where}: mode mask needs low and/or high (the ratios kept, e.g. "
                                 f"low: 0.5, high: 2)")
        elif self.low is not None or self.high is not None:
            raise ValueError(f"{where}: low/high are mode mask's bounds; mode {self.mode} takes none")
        for lo, hi, name in ((self.low, self.high, "low/high"),
                             (self.outlier_low, self.outlier_high, "outlier_low/outlier_high")):
            if lo is not None and hi is not None and not lo < hi:
                raise ValueError(f"{where}: {name} must have low < high; got {lo} and {hi}")
            if (lo is not None and lo > 1) or (hi is not None and hi < 1):
                raise ValueError(f"{where}: {name} must keep the ratio 1 (low <= 1 <= high): a token the "
                                 f"current policy sampled has ratio 1, and would leave the loss; got {lo} and {hi}")
        return self

    @property
    def active(self) -> bool:
        """Whether any weight can differ from 1."""
        return self.mode != "none" or self.outlier_low is not None or self.outlier_high is not None


def _outside(x: "torch.Tensor", low: float | None, high: float | None) -> "torch.Tensor":
    out = x != x  # NaN is outside any bound
    if low is not None:
        out |= x < low
    if high is not None:
        out |= x > high
    return out


def correct(old: "torch.Tensor", rollout: "torch.Tensor", mask: "torch.Tensor", c: OffPolicy,
            staleness: "torch.Tensor | None" = None, tally: "Tally | None" = None) -> "torch.Tensor":
    """[N, T] weights (no gradient) of the sampled tokens (``mask``; 0 elsewhere), from the old
    and rollout logprobs [N, T]; ``tally`` (if given) takes the metrics, ``staleness`` [N, T]
    (per token: the update's version minus the one that sampled it) splits them by staleness."""
    import torch

    with torch.no_grad():
        m = mask.to(torch.bool)
        mf = m.to(old.dtype)
        # (where, not a product: a non-finite logprob of a token outside the mask stays outside)
        log_rho = torch.where(m, old - rollout, torch.zeros_like(old))
        bad = m & log_rho.isnan()  # a NaN logprob: its token leaves the loss (counted as masked)
        log_rho = log_rho.nan_to_num(0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho = torch.exp(log_rho)
        if c.level == "token":
            unit = rho
        else:
            total = log_rho.sum(-1, keepdim=True)
            if c.level == "sequence":
                total = total / mf.sum(-1, keepdim=True).clamp(min=1.0)
            unit = torch.exp(total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(rho)
        if c.mode == "truncate":
            weight, beyond = unit.clamp(max=c.cap), rho > c.cap
        elif c.mode == "mask":
            weight = torch.where(_outside(unit, c.low, c.high), torch.zeros_like(unit), unit)
            beyond = _outside(rho, c.low, c.high)
        else:
            weight, beyond = torch.ones_like(unit), torch.zeros_like(m)
        weight = torch.where(bad, torch.zeros_like(weight), weight)
        if c.level != "token":
            weight = torch.where(bad.any(-1, keepdim=True), torch.zeros_like(weight), weight)
        dropped = (weight == 0) & m
        if c.outlier_low is not None or c.outlier_high is not None:
            outlier = (_outside(rho, c.outlier_low, c.outlier_high) & m).any(-1, keepdim=True)
            dropped = dropped | (outlier & m)
            weight = torch.where(outlier, torch.zeros_like(weight), weight)
        weight = weight * mf
        if tally is not None:
            tally.add_tokens(rho, weight, dropped, beyond & m, m, staleness)
            if c.level != "token":
                rows = m.any(-1)
                tally.add_units("is/seq_ratio", unit[:, 0][rows])
            if c.mode == "truncate":
                over = unit > c.cap
                tally.add_mean("is/truncated_frac", over[m] if c.level == "token" else over[:, 0][m.any(-1)])
    return weight


class Tally:
    """The correction's metrics over an update: sums, counts and extremes, merged over
    micro-batches (``add_*``) and ranks (``merge``), read by ``metrics``:

    ``is/ratio_mean|max|min``      token ratios rho over the sampled tokens
    ``is/weight_mean``             the weights w over the sampled tokens
    ``is/masked_frac``             share of sampled tokens out of the loss (mask mode, outliers)
    ``is/beyond_frac``             share of sampled tokens whose rho lies beyond the mode's bounds
                                   (truncate: above cap; mask: outside [low, high])
    ``is/truncated_frac``          share of units whose ratio the cap truncated (truncate mode)
    ``is/seq_ratio_mean|max|min``  the rollouts' ratios u_i (levels sequence and product)
    ``is/staleness_<s>/...``       ratio_mean|max|min, masked_frac, beyond_frac over the tokens
                                   sampled s versions before the update's policy
    """

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # key -> [sum, count]
        self.extremes: dict[str, list[float]] = {}  # key -> [max, min]

    def add_mean(self, key: str, values: "torch.Tensor") -> None:
        entry = self.sums.setdefault(key, [0.0, 0.0])
        entry[0] += float(values.double().sum())
        entry[1] += float(values.numel())

    def add_units(self, prefix: str, values: "torch.Tensor") -> None:
        if not values.numel():
            return
        self.add_mean(f"{prefix}_mean", values)
        entry = self.extremes.setdefault(prefix, [-math.inf, math.inf])
        entry[0], entry[1] = max(entry[0], float(values.max())), min(entry[1], float(values.min()))

    def add_tokens(self, rho, weight, dropped, beyond, m, staleness) -> None:
        self.add_units("is/ratio", rho[m])
        self.add_mean("is/weight_mean", weight[m])
        self.add_mean("is/masked_frac", dropped[m])
        self.add_mean("is/beyond_frac", beyond[m])
        if staleness is None:
            return
        for s in staleness[m].unique().tolist():
            at = m & (staleness == s)
            self.add_units(f"is/staleness_{int(s)}/ratio", rho[at])
            self.add_mean(f"is/staleness_{int(s)}/masked_frac", dropped[at])
            self.add_mean(f"is/staleness_{int(s)}/beyond_frac", beyond[at])

    def merge(self, other: "Tally") -> None:
        for key, (total, count) in other.sums.items():
            entry = self.sums.setdefault(key, [0.0, 0.0])
            entry[0] += total
            entry[1] += count
        for key, (hi, lo) in other.extremes.items():
            entry = self.extremes.setdefault(key, [-math.inf, math.inf])
            entry[0], entry[1] = max(entry[0], hi), min(entry[1], lo)

    def metrics(self) -> dict[str, float]:
        out = {key: total / count for key, (total, count) in self.sums.items() if count}
        for key, (hi, lo) in self.extremes.items():
            out[f"{key}_max"], out[f"{key}_min"] = hi, lo
        return out
