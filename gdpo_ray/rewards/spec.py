"""A reward as configured: ``{name, fn, params, weight, condition, timeout_s}``; conditions."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gdpo_ray.judges.rubric import JUDGE, expand_judges, rubric_of
from gdpo_ray.rewards.adapters import bind_params
from gdpo_ray.rewards.registry import get


@dataclasses.dataclass(frozen=True)
class Condition:
    """The paper's conditioned reward: paid only when reward ``on`` is >= ``min``."""

    on: str  # name of the gating reward
    min: float  # threshold t


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One reward column."""

    name: str  # column name, unique; metrics are rewards/<name>/...
    fn: str | Callable | None = None  # built-in name, "package.module:function" or a callable; default: name
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # keywords of the function
    weight: float = 1.0  # w_k of DESIGN.md §1
    condition: Condition | None = None  # paid only when another reward is >= a threshold
    timeout_s: float | None = None  # per sample and call; default: 30 s, or more for code rewards
    # a column read from the rollout's environment: its value where the rollout's own call stopped
    # the environment (a tool call killed at its time limit, or that ended the process); default 0
    floor: float | None = None

    _KEYS = ("name", "fn", "params", "weight", "condition", "timeout_s", "floor")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "RewardSpec") -> "RewardSpec":
        if isinstance(d, RewardSpec):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"a reward is a mapping {{name, fn, params, weight, condition, "
                             f"timeout_s, floor}}; got {d!r} (e.g. {{name: correct, fn: math_correctness}})")
        unknown = sorted(set(d) - set(cls._KEYS), key=str)
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), cls._KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"reward {d.get('name', '?')!r}: unknown key(s) {unknown}{hint}; "
                             f"allowed: {list(cls._KEYS)}")
        if "name" not in d:
            raise ValueError(f"a reward needs a name: {dict(d)}")
        cond = plain_declaration(d).get("condition")
        if cond is not None and not isinstance(cond, Condition):
            if not isinstance(cond, Mapping) or set(cond) != {"on", "min"}:
                raise ValueError(f"reward {d['name']!r}: condition must be {{on: <reward name>, min: <threshold>}}; got {cond!r}")
            cond = Condition(on=str(cond["on"]), min=float(cond["min"]))
        return cls(name=str(d["name"]), fn=d.get("fn"), params=dict(d.get("params") or {}),
                   weight=float(d.get("weight", 1.0)), condition=cond, timeout_s=d.get("timeout_s"),
                   floor=d.get("floor"))

    @property
    def from_judge(self) -> bool:
        """``fn: judge``: one criterion of a judge's rubric (``gdpo_ray.judges.rubric``), scored by
        the rollout actor's judges, not by a function."""
        return self.fn == JUDGE

    @property
    def scored_by_function(self) -> bool:
        return not (self.from_environment or self.from_judge)

    @property
    def from_environment(self) -> bool:
        """``fn: environment``: the column is the rollout environment's (``get_rewards()[name]``,
        or ``get_reward()`` for the one column named after its class), not a function's."""
        return self.fn == ENVIRONMENT

    def resolve(self) -> Callable:
        """The reward function, params bound (fails now on unknown names or params)."""
        if not self.scored_by_function:
            by = "its environment" if self.from_environment else "a judge"
            raise ValueError(f"reward {self.name!r} is scored by {by} (fn: {self.fn}): no function to call")
        fn = self.fn if self.fn is not None else self.name
        if callable(fn):
            return bind_params(fn, dict(self.params), self.name)
        return get(fn, **self.params)

    def call_timeout_s(self, fn: Callable) -> float:
        """Per-sample timeout: configured, or a default above the function's own bound."""
        floor = getattr(fn, "min_timeout_s", 0.0)
        if self.timeout_s is None:
            return max(30.0, floor + 10.0)
        if self.timeout_s <= floor:
            raise ValueError(
                f"reward {self.name!r}: timeout_s ({self.timeout_s}) must exceed {floor:.0f} s, the "
                "sandbox's worst case, so that a misbehaving program never becomes a reward "
                "timeout; raise timeout_s or lower the sandbox limits (wall_s, max_tests)"
            )
        return float(self.timeout_s)


def reward_specs(declarations: Sequence[Any]) -> list[RewardSpec]:
    """``training.rewards`` as its K columns: a judge's entry gives one per criterion
    (``gdpo_ray.judges.rubric.expand_judges``), any other entry one."""
    return [RewardSpec.from_dict(d) for d in expand_judges(declarations)]


def plain_declaration(reward: Any) -> Any:
    """A reward declaration as plain data (JSON-able, for Tune): YAML 1.1 reads an unquoted
    ``on:`` key of a condition as the boolean True; it becomes "on" again (a judge's criteria's
    conditions too)."""
    if not isinstance(reward, Mapping):
        return reward
    out = dict(reward)
    if isinstance(out.get("condition"), Mapping):
        out["condition"] = {("on" if k is True else k): v for k, v in out["condition"].items()}
    if isinstance(out.get("criteria"), list):
        out["criteria"] = [plain_declaration(c) for c in out["criteria"]]
    return out


#: the ``fn`` of a reward column an environment gives (``RewardSpec.from_environment``)
ENVIRONMENT = "environment"
#: the largest |weight| of a reward: weights are relative, and far larger ones overflow the
#: weighted sums of rewards (GRPO) or of normalized advantages (GDPO) in float64
MAX_WEIGHT = 1e6
#: the longest per-sample timeout of a reward (an hour)
MAX_TIMEOUT_S = 3600.0


def check_specs(specs: Sequence[RewardSpec]) -> list[Callable | None]:
    """Validates a reward list (before any worker starts); returns the resolved functions (None
    for an environment's column and a judge's)."""
    if not specs:
        raise ValueError("rewards: at least one reward is needed")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"rewards: names must be unique; repeated: {dupes}")
    for s in specs:
        if not (math.isfinite(s.weight) and abs(s.weight) <= MAX_WEIGHT):
            raise ValueError(f"reward {s.name!r}: weight must be a finite number within "
                             f"+-{MAX_WEIGHT:g}; got {s.weight} (weights are relative: scale them "
                             f"all down, e.g. 1 and 0.5; larger ones overflow the weighted sums)")
        if s.timeout_s is not None and not (isinstance(s.timeout_s, (int, float))
                                            and not isinstance(s.timeout_s, bool)
                                            and 0 < s.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"reward {s.name!r}: timeout_s must be a number of seconds in "
                             f"(0, {MAX_TIMEOUT_S:g}]; got {s.timeout_s!r} (a reward that may take "
                             f"longer stalls its whole group)")
        if s.condition is not None:
            if s.condition.on == s.name or s.condition.on not in names:
                others = [n for n in names if n != s.name]
                raise ValueError(f"reward {s.name!r}: condition.on must name another reward {others}; got {s.condition.on!r}")
            if not math.isfinite(s.condition.min):
                raise ValueError(f"reward {s.name!r}: condition.min must be finite; got {s.condition.min}")
    _condition_order(specs)
    fns = [s.resolve() if s.scored_by_function else None for s in specs]
    for s, fn in zip(specs, fns):
        if s.from_judge:
            rubric_of(s.params)  # (names what is wrong)
            if s.floor is not None or s.timeout_s is not None:
                raise ValueError(f"reward {s.name!r} is a judge's criterion: it takes no floor or timeout_s "
                                 "(judge.timeout_s bounds each request)")
            continue
        if s.floor is not None:
            from gdpo_ray.rewards.adapters import takes_environments

            if not (isinstance(s.floor, (int, float)) and not isinstance(s.floor, bool)
                    and math.isfinite(s.floor)):
                raise ValueError(f"reward {s.name!r}: floor must be a finite number; got {s.floor!r}")
            if fn is not None and not takes_environments(fn):
                raise ValueError(f"reward {s.name!r}: floor applies only to a column read from the rollout's "
                                 f"environment (fn: {ENVIRONMENT}, or a function taking environments=): it is "
                                 "the value where the rollout's own tool call stopped its environment")
        if fn is not None:
            s.call_timeout_s(fn)
        elif s.params or s.timeout_s is not None:
            raise ValueError(f"reward {s.name!r} is the environment's (fn: {ENVIRONMENT}): it takes no "
                             "params or timeout_s (generation.tool_timeout bounds get_rewards)")
    return fns


def _condition_order(specs: Sequence[RewardSpec]) -> list[int]:
    """Column indices with every gate before the rewards it gates; cycles are errors."""
    index = {s.name: i for i, s in enumerate(specs)}
    order: list[int] = []
    state: dict[int, str] = {}

    def visit(i: int, path: list[str]) -> None:
        if state.get(i) == "done":
            return
        if state.get(i) == "open":
            raise ValueError(f"rewards: conditions form a cycle: {' -> '.join(path + [specs[i].name])}")
        state[i] = "open"
        cond = specs[i].condition
        if cond is not None:
            visit(index[cond.on], path + [specs[i].name])
        state[i] = "done"
        order.append(i)

    for i in range(len(specs)):
        visit(i, [])
    return order


def apply_conditions(values: np.ndarray, specs: Sequence[RewardSpec]) -> np.ndarray:
    """[N, K] scored values -> [N, K] stored values: a conditioned reward keeps its value where
    its gate is >= min, is 0 where the gate is below, NaN where the gate is NaN. A gate that is
    itself conditioned acts with its conditioned value."""
    out = np.array(values, dtype=np.float32, copy=True)
    index = {s.name: i for i, s in enumerate(specs)}
    for k in _condition_order(specs):
        cond = specs[k].condition
        if cond is None:
            continue
        gate = out[:, index[cond.on]]
        with np.errstate(invalid="ignore"):
            out[:, k] = np.where(np.isnan(gate), np.nan, np.where(gate >= cond.min, out[:, k], 0.0))
    return out
