"""How reward functions are called: TRL's keyword convention, chat completions, import paths,
verl-style ``compute_score``, and the failure classes.

A reward is called as TRL's GRPOTrainer calls it, with keywords only::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)

``prompts`` and ``completions`` are strings, or, where the dataset's prompt is a list of chat
messages (a conversational dataset), the message lists and ``[{"role": "assistant", "content":
text}]``. ``completion_ids`` are the response's token ids, ``trainer_state.global_step`` the
policy version that generated them, ``columns`` the dataset row's (``ground_truth``, ...) and
the rollout's (``response_length``). A function without ``**kwargs`` is given only the
keywords it names, so ``def f(completions, answer)`` works as well as ``def f(completions,
**kwargs)``. ``async def`` functions are run to completion. The result is a list of one number
or None (could not be computed: NaN) per completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import math
from typing import Any, Callable, Mapping, Sequence

RewardFn = Callable[..., list]  # fn(*, prompts, completions, completion_ids, **columns) -> list

#: keywords every call passes besides the columns
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")
#: columns every rollout has besides the dataset's
ROLLOUT_COLUMNS = ("response_length",)
#: the keyword of TRL's reward functions that read the rollouts' environment instances
ENVIRONMENTS = "environments"


class RewardInfraError(RuntimeError):
    """Raised by a reward when the scoring infrastructure failed (a sandbox, a judge server),
    not the reward on this completion: the call is retried before the value becomes NaN."""


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a reward can know of the run (TRL's ``trainer_state.global_step``)."""

    global_step: int = 0


def completion_text(completion: Any) -> str:
    """A completion as text: a string as it is; chat messages (TRL's conversational format)
    joined by the contents of the assistant's (a multi-turn completion's tool messages are left
    out)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
        # the model's messages: a multi-turn completion's tool messages are not its text
        return "".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")
    raise TypeError(f"a completion is a string or a list of chat messages; got {type(completion).__name__}")


def _parameters(fn: Callable) -> tuple[frozenset[str] | None, frozenset[str]]:
    """(the keywords ``fn`` accepts, None = any; those it requires)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None, frozenset()
    params = sig.parameters.values()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = frozenset(p.name for p in named if p.default is p.empty)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, required
    return frozenset(p.name for p in named), required


def required_columns(fn: Callable) -> list[str]:
    """The columns ``fn`` cannot be called without (its required parameters that are not one
    of ``CALL_KEYWORDS``)."""
    _, required = _parameters(fn)
    return sorted(required - set(CALL_KEYWORDS) - {ENVIRONMENTS})


def takes_environments(fn: Callable) -> bool:
    """Whether ``fn`` names TRL's ``environments`` parameter: it reads the rollouts' environment
    instances, so it runs where they live (the rollout actor), not in a scoring process."""
    accepted, required = _parameters(fn)
    return ENVIRONMENTS in required or (accepted is not None and ENVIRONMENTS in accepted)


def call_reward(fn: Callable, **kwargs: Any) -> Any:
    """Calls ``fn`` TRL's way: keywords only, those it does not accept left out (when it has
    no ``**kwargs``); an ``async def`` function (or one returning an awaitable) is awaited."""
    accepted, _ = _parameters(fn)
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result

        result = asyncio.run(wait())
    return result


#: characters of a reward's error text kept
ERROR_CHARS = 500


def failure_text(err: BaseException) -> str:
    """``Type: message`` of what a reward raised (``Type`` where the message is empty), at most
    ``ERROR_CHARS`` characters; an exception whose own text fails (its ``__str__`` raises) is
    named by its type."""
    try:
        text = str(err)
        return (f"{type(err).__name__}: {text}" if text else type(err).__name__)[:ERROR_CHARS]
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - its message cannot be made
        return f"{type(err).__name__} (its message cannot be shown)"[:ERROR_CHARS]


def import_object(path: str, what: str = "reward") -> Any:
    """``package.module:attribute`` -> the attribute; ``what`` names it in errors."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} import path must look like 'package.module:name'; got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"cannot import module {module_name!r} of {what} {path!r}: {err}; run from the folder "
            f"that holds it (it is put on the path), add that folder to PYTHONPATH, or install "
            f"it") from err
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - the module itself is broken (SyntaxError, sys.exit(), ...)
        raise ValueError(f"importing module {module_name!r} of {what} {path!r} failed: "
                         f"{failure_text(err)}") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r})")
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
            value = compute_score(source, completion_text(completion), truth, info)
            if isinstance(value, dict):
                if score_key not in value:
                    raise ValueError(f"compute_score returned a dict without {score_key!r}: {sorted(value)}")
                value = value[score_key]
            out.append(None if value is None else float(value))
        return out

    del reward.__wrapped__  # its own signature (keywords), not compute_score's
    return reward


def bind_params(fn: Callable[..., Any], params: dict, name: str) -> RewardFn:
    """A user function with its configured keyword parameters; unknown ones fail now."""
    if not params:
        return fn
    accepted, _ = _parameters(fn)
    unknown = [k for k in params if accepted is not None and k not in accepted]
    if unknown:
        raise ValueError(f"reward {name!r}: {getattr(fn, '__name__', fn)} takes no parameter(s) "
                         f"{unknown}; its parameters: {sorted(accepted or ())}")
    return functools.partial(fn, **params)


#: the largest magnitude a reward may take: rewards are stored as float32 (DESIGN.md §3)
FLOAT32_MAX = 3.4028234663852886e38


def to_floats(values: Any, n: int, name: str) -> list[float]:
    """Checks a reward function's result: n numbers or None (-> NaN); a text, a value that is not
    a number, an infinity or one beyond float32's range is refused naming the reward."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy, torch
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward {name!r} must return a list of {n} value{'s' * (n != 1)} (one "
                         f"per completion); got {got}")
    out = []
    for v in values:
        if isinstance(v, (str, bytes)):  # float("0.5") would pass a text off as a score
            raise ValueError(f"reward {name!r} returned {v!r} (a {type(v).__name__}); return numbers, "
                             f"or None where a value cannot be computed")
        try:
            x = math.nan if v is None else float(v)
        except (TypeError, ValueError):
            raise ValueError(f"reward {name!r} returned {v!r} ({type(v).__name__}), not a number; "
                             f"return numbers, or None where a value cannot be computed") from None
        if math.isinf(x):
            raise ValueError(f"reward {name!r} returned {x}; use None for 'could not be computed'")
        if abs(x) > FLOAT32_MAX:
            raise ValueError(f"reward {name!r} returned {x:g}, beyond the float32 range (+-{FLOAT32_MAX:.4g}) "
                             f"in which rewards are stored; scale the reward down")
        out.append(x)
    return out
