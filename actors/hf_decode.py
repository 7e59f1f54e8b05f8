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

from actors.kv_store import RowKV
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
           stop_check: StopCheck | None = None, reused: Sequence[tuple[int, RowKV] | None] | None = None,
           kept: list | None = None) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """n samples of each prompt: (token ids, their logprobs under logits / temperature truncated
    by ``truncation``, or untruncated where ``truncated_logprobs`` is False, the finish reason)
    per sample, prompt-major (prompt i's samples are rows i*n .. i*n+n-1).
    A sample ends with an EOS token (included; reason "stop"), when ``stop_check`` says so
    (reason "stop"; the caller cuts it at the stop string), or after ``max_tokens`` ("length").

    ``reused`` (n = 1): per prompt, the KV of its first m tokens from an earlier call (``(m,
    per layer (keys, values) [heads, m, dim])``, ``actors.kv_store``) or None: only the rest is
    prefilled. ``kept``: a list that receives, per sample, (its prompt's tokens and its own but
    the last, their KV) for a later call to reuse."""
    import torch

    device = next(model.parameters()).device
    if reused is not None and n != 1:
        raise ValueError("reused KV is for one sample per prompt (n = 1)")
    done = [0 if r is None else r[0] for r in (reused or [None] * len(prompts))]
    held = max(done)  # the reused KV's columns, each row's right-aligned
    width = held + max(len(p) - m for p, m in zip(prompts, done))
    ids = torch.full((len(prompts), width - held), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    positions = torch.zeros_like(ids)
    for i, (p, m) in enumerate(zip(prompts, done)):  # left-padded: [pad, reused | pad, the rest]
        rest = len(p) - m
        ids[i, ids.shape[1] - rest:] = torch.as_tensor(list(p[m:]), dtype=torch.long)
        mask[i, held - m:held] = 1
        mask[i, width - rest:] = 1
        positions[i, ids.shape[1] - rest:] = torch.arange(m, len(p))
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
    taken: dict = {}  # output row -> its KV (``kept``)
    cache = new_cache(model)
    with torch.inference_mode():
        if held:
            _fill(cache, reused, done, held, device)
        logits = _last_logits(model, ids.to(device), mask.to(device), positions.to(device), cache)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, 0)
        where = np.arange(rows_n)  # batch row -> output row
        live = np.ones(rows_n, bool)  # per batch row: still decoding
        position = positions[:, -1:].repeat_interleave(n, 0).to(device)
        for step in range(max_tokens):
            scores = logits.float() / temperature
            cut = narrowed(scores, truncation)
            lp = torch.log_softmax(cut if truncated_logprobs else scores, dim=-1)
            token = draw(lp.exp() if truncated_logprobs or not truncation.active else cut.softmax(dim=-1),
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
                if kept is not None:
                    _take(cache, attention, where, np.flatnonzero(~live), width, ends, taken)
                keep = np.flatnonzero(live)
                index = torch.as_tensor(keep, device=device)
                cache.batch_select_indices(index)
                token, position, attention = token[index], position[index], attention[index]
                where, live = where[keep], np.ones(len(keep), bool)
            position = position + 1
            logits = _last_logits(model, token[:, None], attention[:, :width + step + 1], position, cache)
        if kept is not None:
            _take(cache, attention, where, np.arange(len(where)), width, ends, taken)
    if kept is not None:
        for r in range(rows_n):
            prompt = list(prompts[r // n])
            kept.append((prompt + tokens[r, :max(ends[r] - 1, 0)].tolist(), taken[r]))
    return [(tokens[r, :ends[r]], logprobs[r, :ends[r]], reasons[r]) for r in range(rows_n)]


def _fill(cache: Any, reused: Sequence, done: Sequence[int], held: int, device: Any) -> None:
    """``cache`` holding the reused KV, each row's m columns right-aligned in ``held`` (zeros
    before them, which the attention mask leaves out)."""
    import torch

    first = next(r for r in reused if r is not None)[1]
    for layer, (k0, v0) in enumerate(first):
        keys = torch.zeros((len(done), k0.shape[0], held, k0.shape[-1]), dtype=k0.dtype, device=device)
        values = torch.zeros((len(done), v0.shape[0], held, v0.shape[-1]), dtype=v0.dtype, device=device)
        for i, r in enumerate(reused):
            if r is not None:
                m, kv = r
                keys[i, :, held - m:] = kv[layer][0]
                values[i, :, held - m:] = kv[layer][1]
        cache.update(keys, values, layer)


def _take(cache: Any, attention: Any, where: np.ndarray, rows: np.ndarray, width: int, ends: np.ndarray,
          taken: dict) -> None:
    """Into ``taken`` (output row -> per layer (keys, values)): the KV of batch rows ``rows``:
    the prompt's columns the mask keeps, then those of the row's tokens fed (all but its last)."""
    import torch

    for b in rows:
        r = int(where[b])
        if r in taken:
            continue
        fed = max(int(ends[r]) - 1, 0)
        columns = torch.cat([torch.nonzero(attention[b, :width], as_tuple=True)[0],
                             torch.arange(width, width + fed, device=attention.device)])
        taken[r] = [(layer.keys[b].index_select(1, columns), layer.values[b].index_select(1, columns))
                    for layer in cache.layers]


def _last_logits(model: Any, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
    """The logits of each row's last position ([B, V])."""
    return cached_call(model, ids, mask, positions, cache, last_only=True).logits[:, -1]
