"""The hf engine's KV cache kept across a rollout's turns: after a turn, each row's keys and values
(of its context and the tokens it sampled but the last) are kept under the rollout's key; at its
next turn, whose context begins with those tokens (then the last sampled token and the tool's
answer), only what follows the longest common prefix is prefilled (``actors.hf_decode.decode``,
``reused``). A causal model's KV of a prefix depends on that prefix alone, so a context that
diverges (a stop string cut the turn short) still reuses what they share.

Entries hold the weights they were computed with: a push clears them (``clear``), as does a
rollout's end (``release``). Used where the model's cache is plain (every layer a full
``DynamicLayer``): a sliding-window layer keeps only its window, which a later turn cannot extend.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

#: per layer, (keys, values) of one row: [heads, tokens, dim]
RowKV = list[tuple[Any, Any]]


@dataclasses.dataclass
class Kept:
    tokens: np.ndarray  # the tokens whose KV it holds
    kv: RowKV


class KVStore:
    """Rows' KV by rollout key."""

    def __init__(self) -> None:
        self._rows: dict[Hashable, Kept] = {}
        self.reused_tokens = 0  # tokens whose prefill a reuse saved, since the start
        self.prefilled_tokens = 0  # tokens prefilled, since the start

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def put(self, key: Hashable, tokens: Sequence[int], kv: RowKV) -> None:
        self._rows[key] = Kept(np.asarray(tokens, np.int64), kv)

    def take(self, key: Hashable, context: Sequence[int]) -> tuple[int, RowKV] | None:
        """(m, the KV of the first m tokens of ``context``) for the longest prefix it shares with
        what ``key`` kept, at most all but its last token (whose logits the next turn needs);
        None where nothing is kept or shared. The entry leaves the store."""
        kept = self._rows.pop(key, None)
        if kept is None:
            return None
        context = np.asarray(context, np.int64)
        limit = min(len(kept.tokens), len(context) - 1)
        differ = np.flatnonzero(kept.tokens[:limit] != context[:limit])
        m = int(differ[0]) if len(differ) else limit
        if m <= 0:
            return None
        return m, [(k[:, :m], v[:, :m]) for k, v in kept.kv]

    def release(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._rows.pop(key, None)

    def clear(self) -> None:
        self._rows.clear()


def plain_cache(cache: Any) -> bool:
    """Whether every layer of ``cache`` (a fresh one of the model) keeps all its tokens."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
