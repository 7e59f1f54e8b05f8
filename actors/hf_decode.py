"""The hf engine's decoding loop (``decode``): n samples of each prompt from a causal LM.

What it does that ``model.generate(num_return_sequences=n)`` does not:

- each prompt is prefilled once, and its cache is shared by its n samples (generate prefills
  every prompt n times);
- one uniform number per row and step picks the token, by the inverse of the CDF (generate's
  multinomial draws a number per vocabulary entry: on the demo's model, a fifth of its time);
- rows that finished leave the batch once half of it has (generate decodes them to the end);
- what is sampled is the policy's own distribution, logits / temperature truncated by the call's
  min-p, top-k and top-p (``gdpo_ray.truncation``: vLLM's order; top-k and top-p as transformers'
  warpers), and the logprob recorded is the token's under that truncated distribution (or, with
  ``truncated_logprobs=False``, under the full one); generate adds the model's
  ``generation_config`` defaults too: a repetition penalty, say, that the learners' logprobs know
  nothing of.

On the demo's model it takes half of generate's time, with one torch thread or two
(``benchmarks/vs_trl.py`` measures the whole step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from gdpo_ray.causal_lm import cached_call, new_cache
from gdpo_ray.truncation import Truncation, narrowed

#: a row's tokens so far -> whether it has produced a stop string (checked after each token)
StopCheck = Callable[[list[int]], bool]


def draw(probs: Any, generator: Any) -> Any:
    """One token per row of ``probs`` ([B, V], rows need not sum to exactly 1): the first whose
    cumulative mass exceeds a uniform number in [0, mass), in float64. A token of zero
    probability is never drawn."""
    import torch

    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # < total, after rounding
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def decode(model: Any, prompts: Sequence[Sequence[int]], n: int, *, temperature: float,
           max_tokens: int, eos_ids: Sequence[int], pad_id: int, generator: Any,
           truncation: Truncation = Truncation(), truncated_logprobs: bool = True,
           stop_check: StopCheck | None = None) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """n samples of each prompt: (token ids, their logprobs under logits / temperature truncated
    by ``truncation``, or untruncated where ``truncated_logprobs`` is False, the finish reason)
    per sample, prompt-major (prompt i's samples are rows i*n .. i*n+n-1).
    A sample ends with an EOS token (included; reason "stop"), when ``stop_check`` says so
    (reason "stop"; the caller cuts it at the stop string), or after ``max_tokens`` ("length")."""
    import torch

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left-padded
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    rows_n = len(prompts) * n
    # the attention mask of every step at once: the prompt's, then the new tokens'
    attention = torch.ones((rows_n, width + max_tokens), dtype=torch.long)
    attention[:, :width] = mask.repeat_interleave(n, 0)
    attention = attention.to(device)
    tokens = np.full((rows_n, max_tokens), pad_id, np.int64)
    logprobs = np.zeros((rows_n, max_tokens), np.float32)
    ends = np.full(rows_n, max_tokens)
    reasons = ["length"] * rows_n
    eos = torch.as_tensor(list(eos_ids), device=device)
    cache = new_cache(model)
    with torch.inference_mode():
        logits = _last_logits(model, ids.to(device), mask.to(device), positions.to(device), cache)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, 0)
        where = np.arange(rows_n)  # batch row -> output row
        live = np.ones(rows_n, bool)  # per batch row: still decoding
        position = positions[:, -1:].repeat_interleave(n, 0).to(device)
        for step in range(max_tokens):
            scores = logits.float() / temperature
            kept = narrowed(scores, truncation)
            lp = torch.log_softmax(kept if truncated_logprobs else scores, dim=-1)
            token = draw(lp.exp() if truncated_logprobs or not truncation.active else kept.softmax(dim=-1),
                         generator)
            chosen = lp.gather(1, token[:, None])[:, 0]
            out = where[live]
            tokens[out, step] = token.cpu().numpy()[live]
            logprobs[out, step] = chosen.cpu().numpy()[live]
            finished = torch.isin(token, eos).cpu().numpy() & live
            if stop_check is not None:
                for b in np.flatnonzero(live & ~finished):
                    finished[b] = stop_check(tokens[where[b], :step + 1].tolist())
            for b in np.flatnonzero(finished):
                ends[where[b]], reasons[where[b]] = step + 1, "stop"
            live &= ~finished
            if step == max_tokens - 1 or not live.any():
                break
            if live.sum() <= len(live) // 2:  # the finished rows leave the batch
                keep = np.flatnonzero(live)
                index = torch.as_tensor(keep, device=device)
                cache.batch_select_indices(index)
                token, position, attention = token[index], position[index], attention[index]
                where, live = where[keep], np.ones(len(keep), bool)
            position = position + 1
            logits = _last_logits(model, token[:, None], attention[:, :width + step + 1], position, cache)
    return [(tokens[r, :ends[r]], logprobs[r, :ends[r]], reasons[r]) for r in range(rows_n)]


def _last_logits(model: Any, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
    """The logits of each row's last position ([B, V])."""
    return cached_call(model, ids, mask, positions, cache, last_only=True).logits[:, -1]
