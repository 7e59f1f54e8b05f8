"""Calling a transformers causal LM with a KV cache, whatever wraps it (a DeepSpeed engine, PEFT)
and whatever its transformers version names the cache: the hf engine's decoding loop
(``actors/hf_decode.py``) and the learners' shared-prompt forward (``learners/shared_prompts.py``)
both go through here."""

from __future__ import annotations

import functools
import inspect
from typing import Any


def unwrapped(model: Any) -> Any:
    """The transformers model inside a DeepSpeed engine and a PEFT wrapper."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT


def takes_cache(model: Any) -> bool:
    """Whether the model's forward takes position ids and a cache (every decoder-only model of
    transformers here; ALiBi's take no position ids)."""
    params = _parameters(type(unwrapped(model)))
    return "position_ids" in params and bool({"cache", "past_key_values"} & params)


def new_cache(model: Any) -> Any:
    """An empty cache whose layers are the model's (sliding windows where it has them)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=unwrapped(model).config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def cached_call(model: Any, ids: Any, mask: Any, positions: Any, cache: Any, last_only: bool = False) -> Any:
    """``model``'s output for ``ids`` after what ``cache`` holds (which it extends): ``mask``
    covers the cached positions and these, ``positions`` are these tokens' (left padding: a
    row's first token is at 0). ``last_only``: logits of each row's last position alone, where
    the model takes ``logits_to_keep``. A model without position ids places tokens by the mask."""
    params = _parameters(type(unwrapped(model)))
    kwargs = {"logits_to_keep": 1} if last_only and "logits_to_keep" in params else {}
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    kwargs["cache" if "cache" in params else "past_key_values"] = cache  # the name since transformers 5.25
    return model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs)


@functools.lru_cache(maxsize=None)
def _parameters(model_class: type) -> frozenset:
    return frozenset(inspect.signature(model_class.forward).parameters)
