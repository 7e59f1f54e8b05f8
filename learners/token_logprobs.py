"""Token logprobs from the LM head in slices of rows: the [tokens, vocab] logits never exist whole.

For N response tokens and a vocabulary of V, the plain path holds several [N, V] tensors at once
(the logits kept for backward, the softmax's gradient, the gather's): at a 152k vocabulary and
16k tokens, 10 GB each. ``token_logprobs`` computes, per slice of rows, logits = h @ W.T / T
(float32), a token's logprob (its logit minus the slice's logsumexp) and the entropy, and keeps
only the hidden states, the weight and the logsumexp; backward recomputes each slice's logits
(d logprob / d logits = onehot(target) - softmax, over T) and accumulates the gradients of the
hidden states and, where it is trained, of the weight. One more matmul per slice for memory
O(slice x V). The same values as log_softmax then gather, up to float rounding.

``head_input`` runs a model's forward with its output embedding short-circuited (a forward
pre-hook hands it no positions) and returns the hidden states it would have projected; ``fused_head``
says whether a model's logits are exactly its output embedding's product (a probe: no soft cap,
no scale, no bias, not partitioned by ZeRO-3; under FSDP2 the weight read after the forward, the
root's gathered one), else the learner keeps the plain path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gdpo_ray.causal_lm import unwrapped
from gdpo_ray.truncation import Truncation, narrowed

#: bytes of one slice's float32 logits
SLICE_BYTES = 64 << 20


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, rows: int, truncation: Truncation):
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], rows):
            end = start + rows
            logits = torch.nn.functional.linear(hidden[start:end], weight).float() / temperature
            full = torch.logsumexp(logits, -1)
            logp = logits - full[:, None]
            entropy[start:end] = -(logp.exp() * logp).sum(-1)  # of the full distribution
            if truncation.active:
                logits = narrowed(logits, truncation, always=targets[start:end])
                full = torch.logsumexp(logits, -1)
            lse[start:end] = full
            logprobs[start:end] = logits.gather(1, targets[start:end, None])[:, 0] - full
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.rows, ctx.truncation = temperature, rows, truncation
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.rows):
            end = start + ctx.rows
            h = hidden[start:end]
            logits = torch.nn.functional.linear(h, weight).float() / ctx.temperature
            if ctx.truncation.active:  # the same support as forward's: 0 outside it
                logits = narrowed(logits, ctx.truncation, always=targets[start:end])
            g = -(logits - lse[start:end, None]).exp()  # d logprob / d logits: onehot - softmax
            g.scatter_add_(1, targets[start:end, None], torch.ones_like(g[:, :1]))
            g *= grad_logprobs[start:end, None] / ctx.temperature
            g = g.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = g @ weight
            if grad_weight is not None:
                grad_weight += (g.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, truncation: Truncation = Truncation()) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] logprobs of ``targets`` under softmax(hidden @ weight.T / T), renormalized over the
    ``truncation``'s support where it is active (``gdpo_ray.truncation``), [N] entropies of the
    full distributions, no gradient), in slices of rows of at most ``SLICE_BYTES`` of logits."""
    rows = max(1, SLICE_BYTES // (4 * weight.shape[0]))
    return _TokenLogprobs.apply(hidden, weight, targets.long(), float(temperature), rows, truncation)


def output_embedding(model: Any) -> Any:
    """The module that projects hidden states to logits (through DeepSpeed's and PEFT's wrappers)."""
    return unwrapped(model).get_output_embeddings()


def head_input(model: Any, head: Any, forward: Callable[[], Any]) -> torch.Tensor:
    """The hidden states ``forward()`` (a call of ``model``) hands its output embedding ``head``,
    which then projects no rows (so no logits are made)."""
    taken = {}

    def take(_module, args):
        taken["hidden"] = args[0]
        return (args[0][..., :0, :],)  # no positions (no rows, for a flattened input)

    handle = head.register_forward_pre_hook(take)
    try:
        forward()
    finally:
        handle.remove()
    return taken["hidden"]


def fused_head(model: Any, device: Any) -> bool:
    """Whether ``model``'s logits are exactly its output embedding's weight times the hidden
    states (checked on a probe of 8 tokens, no gradient; the model in eval mode)."""
    head = output_embedding(model)
    weight = getattr(head, "weight", None)
    if (type(head) is not torch.nn.Linear or head.bias is not None or weight is None
            or hasattr(weight, "ds_id") or weight.dim() != 2):
        return False  # a LoRA-wrapped head, a bias, or a ZeRO-3 partition: the plain path
    ids = torch.arange(1, 9, device=device)[None, :] % weight.shape[0]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        hidden = head_input(model, head, lambda: model(input_ids=ids))
        weight = head.weight  # after the forward: FSDP2's root keeps its gathered weight until backward
        if hasattr(weight, "full_tensor"):  # still a shard (a DTensor): not a product to take here
            return False
        mine = torch.nn.functional.linear(hidden, weight).float()
    return mine.shape == logits.shape and torch.allclose(mine, logits, rtol=1e-4, atol=1e-4)
