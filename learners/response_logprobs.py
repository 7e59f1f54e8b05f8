"""The logprobs of a micro-batch's response tokens under the model: logits / T, over the truncated
distribution the rollouts sampled from where ``generation.truncated_logprobs`` says so
(``gdpo_ray.truncation``; the sampled token always counts as kept).

The forward: ``packed`` (``learners/packing.py``: rows end to end in lines, each prompt once per
line, no padding but the lines' ends; any backend, one forward), else rows that share a prompt
(``shared``) run it once through a cache (``learners/shared_prompts.py``), else one right-padded
row per rollout. Where the model's logits are its head's product (``fused``), the head runs on the
positions that predict a response token alone, in slices of rows (``learners/token_logprobs.py``):
neither a prompt's positions nor a short row's padding become [V]-wide logits, and those that do
never exist whole. Otherwise (ZeRO-3, a head with a scale or soft cap) every position's logits, as
the model computes them. ``tokens`` (a dict) adds up the positions the forward computed
(``computed``) and those that were a prompt's or a response's (``real``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gdpo_ray.losses import entropy_from_logits
from gdpo_ray.truncation import Truncation, narrowed
from learners.packing import best_line, packed_outputs
from learners.rows import Row
from learners.shared_prompts import distinct_prompts, response_outputs

#: logits rows per slice of the entropy metric
ENTROPY_ROWS = 256


def response_logprobs(model: Any, rows: list[Row], *, device: Any, temperature: float, truncation: Truncation,
                      shared: tuple | None, fused: bool, want_entropy: bool = False, packed: bool = False,
                      tokens: dict | None = None):
    """([B, R] logprobs of the response tokens, the [B, R] loss mask (the tokens the policy
    sampled: a multi-turn rollout's tool turns are out), the entropy sum of the full
    distributions at the sampled tokens (0 unless ``want_entropy``, on the unfused path))."""
    import torch

    lengths = [len(r.prompt) + len(r.response) for r in rows]
    width, rlen = max(lengths), max(max(len(r.response) for r in rows), 1)
    ids = np.zeros((len(rows), width), np.int64)
    attn = np.zeros((len(rows), width), np.int64)
    keep = np.zeros((len(rows), width), bool)  # the positions whose logits predict a response token
    present = np.zeros((len(rows), rlen), bool)  # a response token (the rest: padding)
    mask = np.zeros((len(rows), rlen), bool)  # a token the policy sampled
    for i, r in enumerate(rows):
        p, n = len(r.prompt), len(r.response)
        ids[i, :p], ids[i, p:p + n], attn[i, :p + n] = r.prompt, r.response, 1
        keep[i, p - 1:p - 1 + n], present[i, :n] = True, True
        mask[i, :n] = True if r.sampled is None else r.sampled.astype(bool)
    targets = torch.from_numpy(np.concatenate([r.response for r in rows]).astype(np.int64)).to(device)
    keep_t, mask_t, present_t = (torch.from_numpy(a).to(device) for a in (keep, mask, present))
    sampled = mask_t[present_t]  # per response token, row-major: the policy sampled it

    def forward():
        return model(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(attn).to(device))

    count = tokens if tokens is not None else {}
    responses = [r.response for r in rows]

    def tally(computed: int, real: int) -> None:
        count["computed"] = count.get("computed", 0) + computed
        count["real"] = count.get("real", 0) + real

    def at_responses(outputs):  # [N, X]: what predicts each response token, row-major as the mask
        if packed:  # rows end to end, each distinct prompt once per line
            firsts, row_prompt = distinct_prompts([r.prompt for r in rows])
            line = best_line(model, firsts, responses, row_prompt)
            done = packed_outputs(model, firsts, row_prompt, responses, device, outputs, line)
            if done is not None:  # (None: a line too long to mask; the paths below)
                out, lay = done
                tally(lay.computed, lay.computed - lay.padded)
                return out
        if shared is not None:  # each distinct prompt forwarded once
            firsts, _ = shared
            rest = max(max(len(r) for r in responses) - 1, 0)
            tally(len(firsts) * max(len(f) for f in firsts) + len(rows) * rest,
                  sum(len(f) for f in firsts) + sum(max(len(r) - 1, 0) for r in responses))
            return response_outputs(model, *shared, responses, device, outputs)
        tally(int(attn.size), int(attn.sum()))
        return outputs(forward)[keep_t]

    if fused:  # the response positions' [N, V] logits in slices only
        from learners.token_logprobs import head_input, output_embedding, token_logprobs

        head = output_embedding(model)
        # (the weight read after the forward: a sharded model's gathered one, FSDP2's)
        flat, entropies = token_logprobs(at_responses(lambda f: head_input(model, head, f)), head.weight,
                                         targets, temperature, truncation)
        entropy = entropies[sampled].sum()
    else:  # every position's logits, then the response positions'
        picked = at_responses(lambda f: f().logits).float()  # [N, V]
        if temperature != 1.0:
            picked = picked / temperature
        kept = narrowed(picked, truncation, always=targets)
        flat = kept.gather(1, targets[:, None])[:, 0] - torch.logsumexp(kept, -1)
        entropy = torch.zeros((), device=device)
        if want_entropy:  # a metric: in slices of rows, so its [N, V] temporaries stay small
            entropy = sum(entropy_from_logits(part).sum() for part in picked.detach()[sampled].split(ENTROPY_ROWS))
    out = torch.zeros(mask_t.shape, dtype=flat.dtype, device=device).masked_scatter(present_t, flat)
    return out, mask_t, entropy
