"""The update's forward without padding: a micro-batch's rows packed end to end into lines, each
distinct prompt once per line followed by the responses after it, in one forward.

A line is a sequence of segments: a prompt (one group's, once), then each of its rows' response
tokens but the last (a response's last token predicts nothing the loss needs), then the next
group's prompt, and so on. Position ids restart with each prompt (a response continues its
prompt's); attention is confined by a mask: a prompt token sees its prompt's earlier tokens, a
response token its prompt and its own response's earlier tokens (within the model's sliding
window where it has one: the mask applies it, per layer kind where layers differ). A response's
first token is predicted at its prompt's last position, its token t at its own position t - 1:
the values of one plain forward of prompt + response per row, up to float rounding
(``tests/unit/test_packing.py``, values and gradients, on the model families tested).

A line's attention is computed over every pair of its tokens (CPU attention has no
variable-length kernel), so a line's length is chosen per forward (``best_line``): the one of
128, 256, ... 4,096 tokens whose estimated cost is least, each token's projections and MLP
(8h^2 + 6hi multiply-adds, h the hidden size, i the MLP's) plus 4h per pair of tokens in its
line; a row longer than that takes a line of its own. The lines are balanced so that what is
padded is their difference. ``packable`` says which models take such a mask: transformers'
``sdpa`` and ``eager`` attention with position ids, full or sliding-window layers only (no
ALiBi, no chunked, recurrent or linear-attention layers), and a probe's packed outputs equal to
its plain ones (``packs_exactly``); others keep the padded forward, as does a forward whose line
would exceed ``MAX_LINE_TOKENS`` (its mask alone would be W^2 bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from gdpo_ray.causal_lm import unwrapped

#: the line lengths a forward chooses from (``best_line``), and the longest line packed at all
LINE_CHOICES = (128, 256, 512, 1024, 2048, 4096)
MAX_LINE_TOKENS = 8192
LINE_TOKENS = 1024  # where no choice is made (the tests)
#: the layer kinds a packed mask serves (transformers' names), and config keys of other attention
LAYER_KINDS = ("full_attention", "sliding_attention")
OTHER_ATTENTION = ("alibi", "window_size", "attention_layers", "attention_chunk_size")
#: the attention implementations whose masks are taken as given (a 4-D mask or one per layer kind)
MASKED_ATTENTION = ("sdpa", "eager")

#: a forward (a thunk) -> the per-position outputs it yields, [L, W, X]
Outputs = Callable[[Callable[[], Any]], Any]


def packable(model: Any) -> bool:
    """Whether ``model``'s kind takes a packed forward (module docstring; ``packs_exactly`` then
    probes the model itself)."""
    from gdpo_ray.causal_lm import _parameters

    inner = unwrapped(model)
    config = getattr(inner, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in MASKED_ATTENTION:
        return False
    if getattr(config, "is_encoder_decoder", False) or "position_ids" not in _parameters(type(inner)):
        return False
    if any(getattr(config, key, None) for key in OTHER_ATTENTION) or \
            getattr(config, "position_embedding_type", None) == "alibi":
        return False
    return set(getattr(config, "layer_types", None) or ()) <= set(LAYER_KINDS)


def packs_exactly(model: Any, device: Any) -> bool:
    """Whether ``model``'s packed forward gives its plain one's logits on a probe (two prompts,
    four responses, lines of 16 tokens: two responses after one prompt on a line, a prompt on two
    lines), within float rounding; an error is a no. Called in eval mode without gradient, on
    every rank at once (sharded weights)."""
    import torch

    if not packable(model):
        return False
    vocab = unwrapped(model).config.vocab_size
    prompts = [np.arange(5) % vocab + 1, np.arange(3, 7) % vocab + 1]
    responses = [np.arange(10, 16) % vocab, np.arange(20, 24) % vocab, np.arange(30, 35) % vocab,
                 np.arange(40, 43) % vocab]
    row_prompt = np.array([0, 0, 0, 1])
    try:
        packed, _ = packed_outputs(model, prompts, row_prompt, responses, device, lambda f: f().logits, 16)
        plain = []
        for i, r in enumerate(responses):
            p = prompts[row_prompt[i]]
            ids = torch.from_numpy(np.concatenate([p, r])[None]).to(device)
            plain.append(model(input_ids=ids).logits[0, len(p) - 1:len(p) - 1 + len(r)])
        plain = torch.cat(plain)
    except Exception:  # noqa: BLE001 - a forward that cannot take the mask: not packed
        return False
    return packed.shape == plain.shape and bool(torch.allclose(packed.float(), plain.float(), rtol=1e-3, atol=1e-3))


def best_line(model: Any, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                row_prompt: np.ndarray) -> int:
    """The line length of ``LINE_CHOICES`` whose packed forward is estimated cheapest (module
    docstring): lines x width x (8h^2 + 6hi + 4h width)."""
    config = unwrapped(model).config
    h = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1024
    i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    per_token, per_pair = 8 * h * h + 6 * h * i, 4 * h

    def cost(capacity: int) -> float:
        lines = lines_of(prompts, responses, row_prompt, capacity)
        width = max(_sizes(prompts, responses, lines))
        return len(lines) * width * (per_token + per_pair * width)

    return min(LINE_CHOICES, key=cost)


@dataclasses.dataclass
class Layout:
    """Where every token of a packed forward goes: ``ids``/``positions`` [L, W], per position
    its segment (``block``: the group's place in the line, ``row``: -1 for a prompt, else the
    row) and whether it is real; ``at`` [N]: the flat position whose output predicts each
    response token, rows in order."""

    ids: np.ndarray
    positions: np.ndarray
    block: np.ndarray
    row: np.ndarray
    real: np.ndarray
    at: np.ndarray

    @property
    def computed(self) -> int:
        return int(self.ids.size)

    @property
    def padded(self) -> int:
        return int(self.ids.size - self.real.sum())


def lines_of(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], row_prompt: np.ndarray,
             line_tokens: int = LINE_TOKENS) -> list[list[tuple[int, list[int]]]]:
    """Lines as [(prompt index, [rows after it])]: the groups in order of first appearance, each
    row's cost its response's length - 1, a prompt's its length once per line it is on; the
    rows cut into n = ceil(total / line_tokens) (or n + 1, whichever pads less) runs whose
    longest is as short as can be (a binary search of the capacity; the runs keep the rows'
    order, so a group stays together or is split between neighbouring lines)."""
    first = _first(row_prompt)  # a group's rows together, longest first: lines of like lengths
    order = sorted(range(len(row_prompt)), key=lambda i: (first[int(row_prompt[i])], -len(responses[i]), i))
    cost = lambda i: max(len(responses[i]) - 1, 0)
    total = sum(len(p) for p in prompts if len(p)) + sum(cost(i) for i in order)

    def fill(capacity: int) -> list[list[tuple[int, list[int]]]]:
        lines: list[list[tuple[int, list[int]]]] = [[]]
        size = 0
        for i in order:
            u = int(row_prompt[i])
            opened = bool(lines[-1]) and lines[-1][-1][0] == u
            extra = cost(i) + (0 if opened else len(prompts[u]))
            if size and size + extra > capacity:
                lines.append([])
                size, opened, extra = 0, False, cost(i) + len(prompts[u])
            if not opened:
                lines[-1].append((u, []))
            lines[-1][-1][1].append(i)
            size += extra
        return [line for line in lines if line]

    def sizes(lines) -> list[int]:
        return _sizes(prompts, responses, lines)

    def tightest(wanted: int):  # the smallest capacity that needs no more than `wanted` lines
        low = max([cost(i) + len(prompts[int(row_prompt[i])]) for i in order] + [-(-total // wanted)])
        high = max(total, low)
        while low < high:
            mid = (low + high) // 2
            if len(fill(mid)) <= wanted:
                high = mid
            else:
                low = mid + 1
        return fill(low)

    fewest = max(1, -(-total // line_tokens))
    candidates = [tightest(fewest), tightest(fewest + 1)]  # the one with less padding
    return min(candidates, key=lambda lines: len(lines) * max(sizes(lines)) - sum(sizes(lines)))


def _sizes(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], lines) -> list[int]:
    """Each line's tokens: its prompts once, its rows' responses but their last tokens."""
    return [sum(len(prompts[u]) + sum(max(len(responses[i]) - 1, 0) for i in rows) for u, rows in line)
            for line in lines]


def _first(row_prompt: np.ndarray) -> dict[int, int]:
    """Each prompt's first row."""
    out: dict[int, int] = {}
    for i, u in enumerate(row_prompt):
        out.setdefault(int(u), i)
    return out


def layout(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], row_prompt: np.ndarray,
           line_tokens: int = LINE_TOKENS) -> Layout:
    """The packed forward's layout (``Layout``) for rows whose prompt is ``prompts[row_prompt[i]]``."""
    lines = lines_of(prompts, responses, row_prompt, line_tokens)
    segments = []  # per line: [(tokens, positions, block, row)]
    for line in lines:
        parts = []
        for b, (u, rows) in enumerate(line):
            p = np.asarray(prompts[u], np.int64)
            parts.append((p, np.arange(len(p)), b, -1))
            for i in rows:
                r = np.asarray(responses[i], np.int64)[:-1]
                parts.append((r, len(p) + np.arange(len(r)), b, i))
        segments.append(parts)
    width = max(sum(len(t) for t, _, _, _ in parts) for parts in segments)
    n_lines = len(lines)
    ids = np.zeros((n_lines, width), np.int64)
    positions = np.zeros((n_lines, width), np.int64)
    block = np.full((n_lines, width), -1, np.int64)
    row = np.full((n_lines, width), -2, np.int64)
    real = np.zeros((n_lines, width), bool)
    first = np.zeros(len(responses), np.int64)  # flat position predicting each row's first token
    start = np.zeros(len(responses), np.int64)  # flat position of each row's segment
    for li, parts in enumerate(segments):
        at, last_prompt = 0, 0
        for tokens, pos, b, r in parts:
            n = len(tokens)
            ids[li, at:at + n], positions[li, at:at + n] = tokens, pos
            block[li, at:at + n], row[li, at:at + n], real[li, at:at + n] = b, r, True
            if r == -1:
                last_prompt = li * width + at + n - 1
            else:
                first[r], start[r] = last_prompt, li * width + at
            at += n
        pad = np.arange(at, width)
        block[li, pad] = -1 - np.arange(len(pad))  # padding: a block of its own each (sees itself)
        positions[li, pad] = 0
    lengths = np.array([len(r) for r in responses])
    at_parts = [np.concatenate(([first[i]], start[i] + np.arange(n - 1))) for i, n in enumerate(lengths) if n]
    at = np.concatenate(at_parts) if at_parts else np.zeros(0, np.int64)
    return Layout(ids, positions, block, row, real, at)


def attention_mask(lay: Layout, window: int | None, dtype: Any, device: Any, additive: bool) -> Any:
    """[L, 1, W, W]: token q sees token k where both are in one block, k is not after q, and k is
    the block's prompt or q's own response; within ``window`` positions where one is given.
    Boolean (True: sees), or additive (0 / the dtype's minimum) for eager attention."""
    import torch

    block, row, pos = (torch.from_numpy(a.astype(np.int32)).to(device) for a in (lay.block, lay.row, lay.positions))
    index = torch.arange(block.shape[1], device=device, dtype=torch.int32)
    sees = block[:, :, None] == block[:, None, :]  # [L, W, W] bools, combined in place
    sees &= index[None, None, :] <= index[None, :, None]
    sees &= (row[:, None, :] == -1) | (row[:, None, :] == row[:, :, None])
    if window is not None:
        sees &= pos[:, None, :] > pos[:, :, None] - window
    sees = sees[:, None]
    if not additive:
        return sees
    return torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill(~sees, torch.finfo(dtype).min)


def _masks(model: Any, lay: Layout, device: Any) -> Any:
    """The mask the model's forward takes: one, or one per layer kind where its layers differ."""
    import torch

    config = unwrapped(model).config
    additive = config._attn_implementation == "eager"
    dtype = next(unwrapped(model).parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        return {kind: attention_mask(lay, window if "sliding" in kind else None, dtype, device, additive)
                for kind in kinds}
    if kinds and "sliding" not in next(iter(kinds)):
        window = None  # every layer attends in full (Qwen2's default: a window configured, unused)
    return attention_mask(lay, window, dtype, device, additive)


def packed_outputs(model: Any, prompts: Sequence[np.ndarray], row_prompt: np.ndarray,
                   responses: Sequence[np.ndarray], device: Any, outputs: Outputs,
                   line_tokens: int = LINE_TOKENS) -> tuple[Any, Layout] | None:
    """([N, X]: for each response token (rows in order, tokens in order), ``outputs`` at the
    position that predicts it, from one packed forward; the layout, for its padding), or None
    where a line would exceed ``MAX_LINE_TOKENS``."""
    import torch

    lay = layout(prompts, responses, row_prompt, line_tokens)
    if lay.ids.shape[1] > MAX_LINE_TOKENS:
        return None
    ids = torch.from_numpy(lay.ids).to(device)
    positions = torch.from_numpy(lay.positions).to(device)
    mask = _masks(model, lay, device)
    out = outputs(lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False))
    flat = out.reshape(-1, *out.shape[2:])
    return flat.index_select(0, torch.from_numpy(lay.at).to(device)), lay
