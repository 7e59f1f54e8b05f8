"""The policy loss (pure torch: tensors in, a scalar and metrics out).

Per response token t of rollout i, with A_i the rollout's (GDPO) advantage:

    r_it   = exp(logp_it - old_it)                      ratio to the policy at the step's start
    pg_it  = max(-A_i r_it, -A_i clip(r_it, 1 - clip_eps_low, 1 + clip_eps_high))
             (DAPO's clip-higher when clip_eps_high > clip_eps_low)
    dual clip (c > 1): where A_i < 0, pg_it = min(pg_it, -A_i c)
    off-policy correction (``training.off_policy``, ``gdpo_ray.off_policy``): pg_it *= w_it, a
             weight without gradient from exp(old_it - rollout_it) (rollout_it: the logprob the
             policy version that sampled the token recorded), truncated or masked, by token or
             by sequence; under GSPO a rollout's term takes the mean of its tokens' weights
    GSPO (ratio_level="sequence"): s_i = exp(mean_t(logp_it - old_it)) replaces r_it, the clip
             acts on s_i and the loss is the mean over rollouts of the per-rollout term
    KL to a reference policy, added as kl_coef * agg(k):
             k1 = logp - ref;  k2 = (logp - ref)^2 / 2;  k3 = exp(ref - logp) - (ref - logp) - 1

Aggregation over the response mask M (``loss_agg``):
    token_mean           sum_it pg M / num_tokens                 (DAPO; the paper's math/code)
    seq_mean_token_mean  sum_i (sum_t pg M / sum_t M) / num_sequences
    seq_mean_token_sum   sum_i sum_t pg M / num_sequences
``num_tokens`` and ``num_sequences`` default to this batch's; a learner that accumulates
gradients over micro-batches passes the mini-batch's totals, so that the sum of the micro-batch
losses is exactly the mini-batch loss.

Shapes: logprobs, old_logprobs, rollout_logprobs, ref_logprobs, mask [N, T]; advantages [N] or
[N, T]. Degenerate cases: a rollout with an empty response contributes nothing; a batch without
response tokens gives loss 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gdpo_ray.config import default
from gdpo_ray.off_policy import OffPolicy, Tally, correct

if TYPE_CHECKING:  # imported where the math runs: the driver reads PolicyLossConfig, not torch
    import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The loss settings; defaults are the training fields of the same names (``gdpo_ray.config``)."""

    clip_eps_low: float = default("clip_eps_low")
    clip_eps_high: float = default("clip_eps_high")  # > clip_eps_low: DAPO's clip-higher
    dual_clip: float | None = default("dual_clip")  # c > 1 bounds the loss of negative advantages
    loss_agg: str = default("loss_agg")
    ratio_level: str = default("ratio_level")  # "sequence": GSPO
    off_policy: Any = OffPolicy.parse(default("off_policy"))  # a mapping or "none" is read (OffPolicy.parse)
    kl_coef: float = default("kl_coef")
    kl_estimator: str = default("kl_estimator")

    @classmethod
    def of(cls, config: Any) -> "PolicyLossConfig":
        """The loss settings of a config (any object with the training fields, e.g. ``GDPOConfig``)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def __post_init__(self) -> None:
        if not (self.clip_eps_low >= 0 and self.clip_eps_high >= 0):
            raise ValueError(f"clip_eps_low ({self.clip_eps_low}) and clip_eps_high "
                             f"({self.clip_eps_high}) must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or None); got {self.dual_clip}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg {self.loss_agg!r} is not one of {LOSS_AGGREGATIONS}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level must be 'token' or 'sequence' (GSPO); got {self.ratio_level!r}")
        object.__setattr__(self, "off_policy", OffPolicy.parse(self.off_policy))
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator {self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0; got {self.kl_coef}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str,
              num_tokens: float | None = None, num_sequences: float | None = None) -> torch.Tensor:
    """[N, T] per-token values -> scalar (see the module docstring)."""
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        total = mask.sum() if num_tokens is None else num_tokens
        return (values * mask).sum() / max(float(total), 1.0)
    seqs = values.shape[0] if num_sequences is None else num_sequences
    per_seq = (values * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"loss_agg {mode!r} is not one of {LOSS_AGGREGATIONS}")
    return per_seq.sum() / max(float(seqs), 1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens."""
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        return diff.neg().exp() + diff - 1.0
    raise ValueError(f"kl_estimator {estimator!r} is not one of {KL_ESTIMATORS}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropy of softmax(logits)."""
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    staleness: torch.Tensor | None = None,
    tally: Tally | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimize and its metrics (see the module docstring). The off-policy
    correction's metrics go to ``tally`` where one is given (``staleness`` [N, T] splits them),
    else into the metrics returned."""
    import torch

    c = config
    mask_f = mask.to(logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = adv.to(logprobs.dtype).expand_as(logprobs)
    log_ratio = logprobs - old_logprobs.detach()
    own = Tally() if tally is None else None
    weight = None if rollout_logprobs is None or not c.off_policy.active else correct(
        old_logprobs.detach(), rollout_logprobs, mask, c.off_policy, staleness, tally or own)
    if c.ratio_level == "sequence":  # GSPO: every term is per rollout ([N, 1])
        def seq_mean(x: torch.Tensor) -> torch.Tensor:
            return ((x * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0))[:, None]

        log_ratio, adv = seq_mean(log_ratio), adv[:, :1]
        weight = None if weight is None else seq_mean(weight)
        units = (mask_f.sum(-1, keepdim=True) > 0).to(mask_f.dtype)
        agg, agg_tokens = "seq_mean_token_sum", None
    else:
        units, agg, agg_tokens = mask_f, c.loss_agg, num_tokens
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - c.clip_eps_low, 1.0 + c.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    low = (ratio < 1.0 - c.clip_eps_low) & (adv < 0)
    high = (ratio > 1.0 + c.clip_eps_high) & (adv > 0)
    dual = torch.zeros_like(low)
    if c.dual_clip is not None:
        bound = -adv * c.dual_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    if weight is not None:
        pg = pg * weight
    loss = aggregate(pg, units, agg, agg_tokens, num_sequences)
    metrics: dict[str, float] = {"pg_loss": float(loss.detach())}
    if ref_logprobs is not None and c.kl_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), c.kl_estimator)
        kl_loss = aggregate(kl, mask, c.loss_agg, num_tokens, num_sequences)
        loss = loss + c.kl_coef * kl_loss
        metrics["kl"] = float(kl_loss.detach())
    n = units.sum().clamp(min=1.0)

    def frac(x: torch.Tensor) -> float:  # mean over the units (tokens, or rollouts for GSPO)
        return float((x.detach().to(units.dtype).expand_as(units) * units).sum() / n)

    metrics.update({"loss": float(loss.detach()), "ratio/mean": frac(ratio),
                    "clip_frac/low": frac(low), "clip_frac/high": frac(high),
                    "clip_frac/dual": frac(dual), "tokens": float(mask_f.sum())})
    if own is not None:
        metrics.update(own.metrics())
    return loss, metrics
