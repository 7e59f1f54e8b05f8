"""An environment's reward columns: what its ``get_rewards()`` gives, and the one set of names
(its schema) that every rollout keeps.

``get_rewards()`` returns ``{name: value}``, or NeMo-Gym's verify-response shape: a mapping (or
an object, as NeMo-Gym's ``BaseMultiRewardVerifyResponse``) with ``reward_components``
(``{name: value}``) beside the total ``reward`` and other fields. Then the components are the
columns, and the total (their sum) and the other fields are not: GDPO normalizes each component
apart, which is what the components are for (``given``).

The names a rollout gives must be the declared ``fn: environment`` columns (one class), or within
them and the same in every rollout of its class (TRL's dict form, where each class gives some of
them). Anything else is a ``SchemaError`` naming both sides and the fix, never a column dropped in
silence nor a NaN that reads as a failed reward: checked at start-up where it can be
(``gdpo_ray.environments.process.probe``: an instance reset with the first row and scored before
any tool call, as ``gdpo-ray check`` does) and at every rollout (``Schema.check``), which stops
the run at the first one that differs.
A rollout whose ``get_rewards()`` raised, or whose environment stopped or never started, gives
no names: its columns are NaN (or the floor) by the usual rules, and the check waits for one that
does.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

#: NeMo-Gym's field of named components beside the total ``reward``
COMPONENTS = "reward_components"


class SchemaError(ValueError):
    """The names an environment's rewards give differ from the declared columns, or between two
    of its rollouts."""


def given(value: Any) -> Any:
    """The columns of one ``get_rewards()`` value: ``value`` itself, or its ``reward_components``
    (NeMo-Gym's shape, a mapping or an object with that field); the value unchanged where it is
    neither (the caller names what it is)."""
    components = value.get(COMPONENTS, value) if isinstance(value, Mapping) else getattr(value, COMPONENTS, value)
    if components is None:  # NeMo-Gym's field is optional: a verify response without components
        raise TypeError(f"get_rewards returned NeMo-Gym's shape with {COMPONENTS} None: give each "
                        f"component by name in {COMPONENTS} (the total 'reward' is not a column)")
    return dict(components) if isinstance(components, Mapping) else components


def _listed(names: Any) -> str:
    return "[" + ", ".join(repr(n) for n in sorted(names, key=str)) + "]"


def mismatch(label: str, keys: Sequence[str], declared: Sequence[str], where: str, partial: bool = False) -> str:
    """Why ``keys`` (what ``label``'s rewards gave, ``where``) do not fit the ``declared``
    environment columns, and the fix (empty: they fit)."""
    extra = sorted(set(keys) - set(declared), key=str)
    missing = [] if partial else sorted(set(declared) - set(keys), key=str)
    if not extra and not missing:
        return ""
    said = [f"environment {label}'s rewards gave the columns {_listed(keys)} ({where}), and the config "
            f"declares {_listed(declared)} (fn: environment)"]
    if extra:
        said.append(f"{_listed(extra)} not declared: their values would be dropped; declare each "
                    f"({{name: {extra[0]}, fn: environment}}; weight 0 records it without training on it) "
                    "or stop returning it")
    if missing:
        said.append(f"{_listed(missing)} declared but not given: every rollout's value would be NaN; "
                    "return it from get_rewards, or remove its declaration")
    return "; ".join(said)


class Schema:
    """The names each environment class's rewards give, checked at every rollout (thread-safe).
    ``declared``: the ``fn: environment`` columns; ``partial``: TRL's dict form (a class gives
    some of them, the same ones in every rollout)."""

    def __init__(self, declared: Sequence[str], partial: bool = False) -> None:
        self.declared, self.partial = list(declared), partial
        self._first: dict[str, tuple[tuple[str, ...], str]] = {}  # class -> (names, which rollout)
        self._lock = threading.Lock()

    def check(self, label: str, keys: Sequence[str], where: str) -> None:
        """``keys``: what a rollout of class ``label`` gave (``where``: which rollout). Raises
        ``SchemaError`` where they differ from the declared columns or from its class's first."""
        keys = tuple(sorted(map(str, keys)))
        with self._lock:
            first = self._first.setdefault(label, (keys, where))
        why = mismatch(label, keys, self.declared, where, self.partial)
        if not why and first[0] != keys:
            why = (f"environment {label}'s rewards gave the columns {_listed(keys)} ({where}), and "
                   f"{_listed(first[0])} ({first[1]}): a column is given in one rollout and not the "
                   f"other. Give the same names in every rollout (a value that cannot be computed "
                   "is None or NaN, not a missing name)")
        if why:
            raise SchemaError(why)
