"""A correct sample of any suite, defined from its metrics: ``--correct 'NAME>=VALUE'``.

Each condition is a metric of the suite (a reward column of the ``rewards:`` suite, or any
metric a suite reports), an operator (``>=``, ``>``, ``<=``, ``<``, ``==``) and a number; a sample
is correct when every condition holds (``training.eval_correct`` in training). A sample whose
metric could not be computed (NaN: the reward failed) does not satisfy a condition on it: a
failed reward never counts as solved. Per sample:

- ``accuracy``: 1 where every condition holds, else 0 (pass@k counts it: ``--pass-k``);
- ``<NAME>/pass_rate``: 1 where every condition on NAME holds, else 0.

A column that does not apply to a sample (TRL's dict form of environments: another class's)
satisfies its conditions; its pass rate is not counted for that sample.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Any, Callable, Mapping, Sequence

#: the operators, longest first (so ``>=`` is not read as ``>``)
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
ACCURACY = "accuracy"
PASS_RATE = "/pass_rate"
_FORM = re.compile(r"^\s*(?P<name>[^<>=]+?)\s*(?P<op>>=|<=|==|>|<)\s*(?P<value>[^<>=]+?)\s*$")


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    op: str
    value: float

    def holds(self, sample: Mapping[str, Any]) -> bool:
        v = float(sample[self.name])
        return not math.isnan(v) and OPERATORS[self.op](v, self.value)

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}"


def parse_correct(texts: Sequence[str] | str, metrics: Sequence[str], where: str = "--correct",
                  of: str = "this suite") -> tuple[Condition, ...]:
    """The conditions of ``texts`` ('NAME>=VALUE', each; NAME may hold "/": ``quality/helpful``),
    every NAME one of ``metrics`` (those ``of`` reports); a ValueError naming ``where``, the text
    and the fix for anything else."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, (list, tuple)) or not texts:
        raise ValueError(f"{where} must be one or more conditions like 'answer>=1'; got {texts!r}")
    out = []
    for text in texts:
        match = _FORM.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{where} {text!r}: write NAME OP VALUE, e.g. 'answer>=1' or 'tool_errors<1' "
                             f"(OP one of {', '.join(OPERATORS)})")
        name, op = match["name"], match["op"]
        try:
            value = float(match["value"])
        except ValueError:
            raise ValueError(f"{where} {text!r}: {match['value']!r} is not a number") from None
        if name not in metrics:
            raise ValueError(f"{where} {text!r}: {name!r} is not a metric of {of}; its metrics: "
                             f"{', '.join(metrics)}")
        out.append(Condition(name, op, value))
    return tuple(out)


def correct_metrics(conditions: Sequence[Condition]) -> tuple[str, ...]:
    """The metrics ``judge`` adds: ``accuracy``, then ``<NAME>/pass_rate`` per named metric."""
    return (ACCURACY, *dict.fromkeys(c.name + PASS_RATE for c in conditions))


def judge(conditions: Sequence[Condition], sample: Mapping[str, Any]) -> dict[str, float]:
    """A scored sample's ``correct_metrics`` (see the module docstring). A condition on a column
    that does not apply to the sample (its ``not_applicable``: another class's, in TRL's dict
    form of environments) holds, and that column's pass rate is NaN (left out of its mean)."""
    absent = set(sample.get("not_applicable") or ())
    out: dict[str, float] = {}
    for c in conditions:
        key = c.name + PASS_RATE
        out[key] = math.nan if c.name in absent else float(out.get(key, 1.0) == 1.0 and c.holds(sample))
    return {ACCURACY: float(all(v == 1.0 for v in out.values() if not math.isnan(v))), **out}
