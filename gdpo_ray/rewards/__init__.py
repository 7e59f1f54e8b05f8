"""Reward functions: the registry, the built-ins of the paper's three tasks, user adapters.

A reward function has TRL's signature ``fn(prompts, completions, **columns) -> list[float |
None]`` (None = could not be computed, stored as NaN). Columns are the dataset row's and the
rollout's, at least ``ground_truth`` and ``response_length`` (tokens).

``get(name, **params)`` returns a ready function: a built-in by name, a user function by
import path ``package.module:function`` (its params bound as keywords), or a verl-style
``compute_score`` by ``verl:package.module:function``. Built-ins:
``toolrl_format``, ``toolrl_correctness``, ``math_correctness``, ``length``, ``regex``,
``code_passrate``, ``code_bug``. ``from_verl`` adapts verl's ``compute_score``.
"""

from __future__ import annotations

from typing import Any, Callable

from gdpo_ray.registry import Registry
from gdpo_ray.rewards import code, length, math_answer, pattern, toolrl
from gdpo_ray.rewards.adapters import RewardFn, bind_params, from_verl, import_object, to_floats
from gdpo_ray.rewards.spec import Condition, RewardSpec, apply_conditions, check_specs

#: name -> factory(**params) -> reward function
REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward")
REWARDS.register("toolrl_format")(toolrl.toolrl_format)
REWARDS.register("toolrl_correctness")(toolrl.toolrl_correctness)
REWARDS.register("math_correctness")(math_answer.math_correctness)
REWARDS.register("length")(length.length)
REWARDS.register("regex")(pattern.regex)
REWARDS.register("code_passrate")(code.code_passrate)
REWARDS.register("code_bug")(code.code_bug)


def get(name: str, **params: Any) -> RewardFn:
    """The reward function ``name`` (a built-in, ``package.module:function`` or
    ``verl:package.module:function``) with params."""
    if name.startswith("verl:"):
        return from_verl(bind_params(import_object(name[len("verl:"):]), params, name))
    if ":" in name:
        obj = import_object(name)
        if not callable(obj):
            raise ValueError(f"reward {name!r} is not callable")
        return bind_params(obj, params, name)
    factory = REWARDS.get(name)
    try:
        return factory(**params)
    except TypeError as err:
        raise ValueError(f"reward {name!r}: bad params {params}: {err}") from None


__all__ = ["REWARDS", "Condition", "RewardFn", "RewardSpec", "apply_conditions", "check_specs",
           "from_verl", "get", "to_floats"]
