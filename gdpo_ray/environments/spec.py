"""An environment class as configured: loaded, checked, and its tools described.

A TRL environment is a class whose public methods are its tools (``async`` ones too); their type hints and
Google-style docstrings give the JSON schema the model sees (``transformers``'
``get_json_schema``, as TRL builds it). ``reset(**row)`` starts a rollout; ``get_reward()``
(one reward column, named after the class) or ``get_rewards()`` (ours: several columns, named by
its keys) score it. One instance per rollout, made by calling the class with no arguments.

Beyond TRL (ours, optional): an environment whose tools depend on the row (BFCL's items each
involve other APIs) defines ``tool_schemas()`` (after ``reset``: this rollout's tools as JSON
schemas) and ``call_tool(name, arguments)`` (runs one), and has no tool methods of its own; one
whose conversation has several user turns defines ``next_message()`` (asked when the model
answers without a call: the next user message, or None to end the rollout); a ``get_rewards``
with a ``completion`` parameter gets the rollout's messages after the prompt; one that knows its
columns before any rollout defines ``reward_columns()`` (a classmethod: ``{name: default
weight}``), and those not declared are added, as TRL adds a ``get_reward()`` class's column.
``get_rewards()`` may return NeMo-Gym's ``reward_components`` shape
(``gdpo_ray.environments.columns``).

``verifiers:<taskset id>`` names a verifiers environment (``gdpo_ray.environments.verifiers_env``).

``load_environment`` checks a class before any actor starts and names what is wrong and how to
fix it: not importable, not a class, no ``reset``, no tool, a tool whose schema cannot be built.
``with_environment_columns`` adds the column of a ``get_reward()`` class, as TRL does.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, Mapping, Sequence

#: public methods that are not tools
NOT_TOOLS = frozenset({"reset", "get_reward", "get_rewards", "tool_schemas", "call_tool", "next_message",
                       "reward_columns"})
#: ``data.tool_environment: verifiers:<taskset id>``: a verifiers taskset as an environment
VERIFIERS = "verifiers:"


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    """A checked environment class: ``tools`` (method names), ``schemas`` (their JSON schemas,
    for the chat template's ``tools=``), ``reward_getter`` (``get_rewards``, ``get_reward`` or
    None); ``dynamic``: its tools are per rollout (``tool_schemas``, ``call_tool``; ``tools`` and
    ``schemas`` are empty); ``converses``: it has ``next_message``."""

    path: str
    cls: type
    tools: tuple[str, ...]
    schemas: tuple[dict, ...]
    reward_getter: str | None
    dynamic: bool = False
    converses: bool = False

    def new(self) -> Any:
        return self.cls()


def tool_names(cls: type) -> list[str]:
    """The public methods of ``cls`` that are tools, in definition order (base classes first):
    as TRL finds them (the bound methods of an instance), plain, async and class methods, not
    static methods or properties."""
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object's methods are never tools
        for name, value in vars(klass).items():
            if not name.startswith("_") and name not in NOT_TOOLS and (
                    inspect.isfunction(value) or isinstance(value, classmethod)):
                names[name] = None
    return list(names)


#: the row column that names a row's environment in TRL's dict form
ROW_COLUMN = "environment"


def environment_paths(setting: Any) -> dict[str | None, str]:
    """``data.tool_environment`` as {name: 'module:Class'}: one class is ``{None: path}``; TRL's
    dict form ``{name: path}`` (the row's ``environment`` column names its class)."""
    if isinstance(setting, str):
        return {None: setting}
    if isinstance(setting, dict) and setting and all(isinstance(k, str) and k for k in setting):
        return dict(setting)
    raise ValueError(f"data.tool_environment must be 'module:Class', or a mapping of names to "
                     f"'module:Class' (TRL's dict form, each row naming its class in a "
                     f"'{ROW_COLUMN}' column); got {setting!r}")


def with_environment_columns(rewards: Sequence[Any], setting: Any, limit_s: float = 30.0) -> list:
    """``rewards`` (declarations) with TRL's rule applied: an environment class of ``setting``
    (``data.tool_environment``) that scores with ``get_reward()`` and whose column is not declared
    gets one, named after the class, weight 1 (``{name: <Class>, fn: environment}``), after the
    declared ones (``limit_s``: ``load_environment``'s). Declaring it (for a weight or a
    condition) still works; an environment whose one class declares its column under another
    name is left for validation to name. A class with ``reward_columns()`` (a verifiers
    environment: one per rubric function) gets each of its columns not declared, with its default
    weight."""
    from gdpo_ray.rewards.spec import ENVIRONMENT

    out = list(rewards)
    if setting is None:
        return out
    envs = [load_environment(path, limit_s) for path in environment_paths(setting).values()]
    declared = {_name(r) for r in out}
    from_environment = [r for r in out if _fn(r) == ENVIRONMENT]
    for env in envs:
        name = env.cls.__name__
        if env.reward_getter == "get_reward" and name not in declared and not (len(envs) == 1 and from_environment):
            out.append({"name": name, "fn": ENVIRONMENT})
            declared.add(name)
        for column, weight in reward_columns(env).items():
            if column not in declared:
                out.append({"name": column, "fn": ENVIRONMENT, "weight": weight})
                declared.add(column)
    return out


def reward_columns(env: EnvironmentSpec) -> dict[str, float]:
    """``{name: default weight}`` of a class that names its columns (``reward_columns()``), else {}."""
    names = getattr(env.cls, "reward_columns", None)
    if not callable(names):
        return {}
    try:
        columns = dict(names())
    except Exception as err:  # noqa: BLE001 - the class's own error, with its path
        raise ValueError(f"environment {env.path!r}: reward_columns() raised {type(err).__name__}: {err}") from err
    bad = [(k, v) for k, v in columns.items() if not isinstance(k, str) or isinstance(v, bool)
           or not isinstance(v, (int, float))]
    if bad:
        raise ValueError(f"environment {env.path!r}: reward_columns() must map column names to weights "
                         f"(numbers); got {bad[0][0]!r}: {bad[0][1]!r}")
    return {k: float(v) for k, v in columns.items()}


def _name(declaration: Any) -> Any:
    return declaration.get("name") if isinstance(declaration, Mapping) else getattr(declaration, "name", None)


def _fn(declaration: Any) -> Any:
    return declaration.get("fn") if isinstance(declaration, Mapping) else getattr(declaration, "fn", None)


def load_environment(path: str, limit_s: float = 30.0) -> EnvironmentSpec:
    """``module:Class`` imported and checked (see the module docstring); one instance is made,
    within ``limit_s`` (``generation.tool_timeout``)."""
    from gdpo_ray.rewards.adapters import import_object

    if isinstance(path, str) and path.startswith(VERIFIERS):
        try:
            from gdpo_ray.environments.verifiers_env import environment_class
        except ImportError as err:
            raise ValueError(f"data.tool_environment {path!r} needs the verifiers package ({err}): pip install "
                             "-c constraints/cpu.txt 'gdpo-ray[verifiers]'") from err
        return _checked(path, environment_class(path[len(VERIFIERS):]), limit_s)
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"data.tool_environment must be 'module:Class' (a class whose public methods are "
                         f"the tools, importable from the run's working directory); got {path!r}")
    cls = import_object(path, "environment")
    if not inspect.isclass(cls):
        raise ValueError(f"data.tool_environment {path!r} is a {type(cls).__name__}, not a class: name the "
                         "class whose public methods are the tools (one instance is made per rollout)")
    return _checked(path, cls, limit_s)


def _checked(path: str, cls: type, limit_s: float) -> EnvironmentSpec:
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"environment {path!r} has no reset method: add `def reset(self, **row)` "
                         "(it starts a rollout; it may return text to append to the prompt)")
    tools = tool_names(cls)
    dynamic = callable(getattr(cls, "call_tool", None))
    if dynamic != callable(getattr(cls, "tool_schemas", None)):
        raise ValueError(f"environment {path!r} defines only one of call_tool and tool_schemas: an "
                         "environment whose tools depend on the row needs both (tool_schemas() lists "
                         "this rollout's tools, call_tool(name, arguments) runs one)")
    if dynamic and tools:
        raise ValueError(f"environment {path!r} has call_tool and tool methods ({', '.join(tools)}): "
                         "the model's calls go to call_tool, so make those methods private ('_name')")
    if not tools and not dynamic:
        raise ValueError(f"environment {path!r} has no tool: its public methods (not starting with '_', "
                         f"other than {', '.join(sorted(NOT_TOOLS))}) are the tools the model may call")
    instance = _made(path, cls, limit_s)
    getter = next((g for g in ("get_rewards", "get_reward") if callable(getattr(cls, g, None))), None)
    return EnvironmentSpec(path, cls, tuple(tools), tuple(_schema(path, instance, t) for t in tools), getter,
                           dynamic, callable(getattr(cls, "next_message", None)))


def _made(path: str, cls: type, limit_s: float) -> Any:
    """``cls()``, on a thread given ``limit_s`` (an ``__init__`` that waits on a server that does
    not answer fails the check instead of hanging it)."""
    box: dict[str, Any] = {}

    def make() -> None:
        try:
            box["instance"] = cls()
        except BaseException as err:  # noqa: BLE001 - reported with the path
            box["error"] = err

    thread = threading.Thread(target=make, daemon=True, name="gdpo-env-check")
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise ValueError(f"environment {path!r}: {cls.__name__}() did not return within {limit_s:g} s "
                         "(generation.tool_timeout): its __init__ must not wait on anything slow; connect "
                         "or load in reset, or raise generation.tool_timeout")
    if "error" in box:
        err = box["error"]
        raise ValueError(f"environment {path!r} cannot be made with no arguments ({type(err).__name__}: "
                         f"{err}): one instance is made per rollout as {cls.__name__}()") from err
    return box["instance"]


def _schema(path: str, instance: Any, name: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(getattr(instance, name))
    except Exception as err:  # noqa: BLE001 - transformers' parsing errors, reported with the tool
        raise ValueError(f"environment {path!r}: the tool {name!r} cannot be described to the model "
                         f"({type(err).__name__}: {err}); give every argument a type hint and the "
                         "method a Google-style docstring with an Args: line per argument") from err
