"""The truncated distribution a token is drawn from under min-p, top-k and top-p sampling, and
its logprobs (``generation.truncated_logprobs``).

From the scores s = logits / temperature of one position ([B, V]), in vLLM's order:

    min-p   keep tokens with p_v >= min_p * max_v p_v         (p = softmax(s))
    top-k   keep the k highest scores (tokens tied with the k-th stay)
    top-p   keep the smallest set of the most likely kept tokens whose renormalized mass reaches
            top_p (the most likely token always stays): transformers' and vLLM's rule
    logprob of a kept token v:  s_v - logsumexp over the kept tokens of s

The sampler draws from, and records the logprob under, this distribution (``hf_decode``; vLLM
records the same as its "processed" logprobs); the learners take the logprob of each sampled
token under the same rule applied to their own scores (``support(..., always=targets)``: the
sampled token counts as kept even where the learner's policy would now cut it, so a logprob is
never -inf). Then the importance ratio pi/mu compares two probabilities of one distribution
family; without it, a ratio between a truncated behaviour and a full learner probability is
below 1 even on-policy, and a full one on both sides is not the sampling distribution's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Sampling's truncation settings (all off by default)."""

    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    @property
    def active(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def of(cls, config: Any) -> "Truncation":
        """The learners' rule for a config: its sampling's, or none where
        ``generation.truncated_logprobs`` is false (TRL's behaviour: the full distribution)."""
        if not config.truncated_logprobs:
            return cls()
        return cls(top_k=config.top_k, top_p=config.top_p, min_p=config.min_p)


def support(scores: "torch.Tensor", t: Truncation, always: "torch.Tensor | None" = None) -> "torch.Tensor":
    """[B, V] bool: the tokens kept (module docstring); ``always`` [B] token ids kept whatever
    the rule says."""
    import torch

    keep = torch.ones_like(scores, dtype=torch.bool)
    if t.min_p > 0.0:
        probs = scores.softmax(dim=-1)
        keep &= probs >= t.min_p * probs.amax(dim=-1, keepdim=True)
    if t.top_k and t.top_k < scores.shape[-1]:
        kth = scores.topk(t.top_k, dim=-1).values[:, -1:]
        keep &= scores >= kth
    if t.top_p < 1.0:
        ordered, order = scores.masked_fill(~keep, -torch.inf).sort(dim=-1)  # ascending
        outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - t.top_p
        outside[:, -1] = False  # the most likely token stays
        keep &= ~outside.scatter(1, order, outside)
    if always is not None:
        keep.scatter_(1, always[:, None], True)
    return keep


def narrowed(scores: "torch.Tensor", t: Truncation, always: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``scores`` with the tokens outside the support at -inf."""
    import torch

    return scores.masked_fill(~support(scores, t, always), -torch.inf) if t.active else scores
