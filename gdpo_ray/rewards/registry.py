"""The reward registry: built-ins by name, user functions by import path.

``get(name, **params)`` returns a ready function: a built-in of ``REWARDS`` by name, a user
function by import path ``package.module:function`` (its params bound as keywords), or a
verl-style ``compute_score`` by ``verl:package.module:function``.
"""

from __future__ import annotations

from typing import Any, Callable

from gdpo_ray.registry import Registry
from gdpo_ray.rewards.adapters import RewardFn, bind_params, from_verl, import_object
from gdpo_ray.rewards.agent import tool_turn_format
from gdpo_ray.rewards.code import code_bug, code_passrate
from gdpo_ray.rewards.length import length
from gdpo_ray.rewards.math_answer import exact_answer, math_correctness
from gdpo_ray.rewards.pattern import regex
from gdpo_ray.rewards.toolrl import toolrl_correctness, toolrl_format

#: name -> factory(**params) -> reward function
REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward")
REWARDS.register("toolrl_format")(toolrl_format)
REWARDS.register("toolrl_correctness")(toolrl_correctness)
REWARDS.register("math_correctness")(math_correctness)
REWARDS.register("exact_answer")(exact_answer)
REWARDS.register("tool_turn_format")(tool_turn_format)
REWARDS.register("length")(length)
REWARDS.register("regex")(regex)
REWARDS.register("code_passrate")(code_passrate)
REWARDS.register("code_bug")(code_bug)


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
