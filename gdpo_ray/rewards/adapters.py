"""Bring-your-own reward functions: import paths and verl-style ``compute_score``."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from typing import Any, Callable

RewardFn = Callable[..., list]  # fn(prompts, completions, **columns) -> list[float | None]


def import_object(path: str) -> Any:
    """``package.module:attribute`` -> the attribute."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward import path must look like 'package.module:function'; got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of reward {path!r}: {err}") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward {path!r})")
        obj = getattr(obj, part)
    return obj


def from_verl(compute_score: Callable[..., Any], score_key: str = "score") -> RewardFn:
    """Wraps verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``,
    which returns a float or a dict holding ``score_key``, as a TRL-style batch function.
    Columns ``data_source`` and ``extra_info`` are passed when the dataset has them."""

    @functools.wraps(compute_score)
    def reward(prompts, completions, *, ground_truth, data_source=None, extra_info=None, **_):
        n = len(completions)
        sources = data_source if data_source is not None else [None] * n
        infos = extra_info if extra_info is not None else [None] * n
        out = []
        for completion, truth, source, info in zip(completions, ground_truth, sources, infos):
            value = compute_score(source, completion, truth, info)
            if isinstance(value, dict):
                if score_key not in value:
                    raise ValueError(f"compute_score returned a dict without {score_key!r}: {sorted(value)}")
                value = value[score_key]
            out.append(None if value is None else float(value))
        return out

    return reward


def bind_params(fn: Callable[..., Any], params: dict, name: str) -> RewardFn:
    """A user function with its configured keyword parameters; unknown ones fail now."""
    if not params:
        return fn
    sig = inspect.signature(fn)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in params if k not in sig.parameters and not takes_kwargs]
    if unknown:
        raise ValueError(f"reward {name!r}: {fn.__name__} takes no parameter(s) {unknown}")
    return functools.partial(fn, **params)


def to_floats(values: Any, n: int, name: str) -> list[float]:
    """Checks a reward function's result: n numbers or None (-> NaN)."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward {name!r} must return a list of {n} values; got {got}")
    out = []
    for v in values:
        x = math.nan if v is None else float(v)
        if math.isinf(x):
            raise ValueError(f"reward {name!r} returned {x}; use None for 'could not be computed'")
        out.append(x)
    return out
