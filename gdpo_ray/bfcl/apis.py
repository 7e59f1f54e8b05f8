"""The executable state of one BFCL multi-turn item, as BFCL's checker builds and runs it, with
model-written calls parsed, never evaluated.

BFCL's multi-turn categories run the model's calls against Python classes that the
``bfcl-eval`` package ships (``bfcl_eval/eval_checker/multi_turn_eval/func_source_code``:
``GorillaFileSystem``, ``MathAPI``, ``MessageAPI``, ``TwitterAPI``, ``TicketAPI``,
``TradingBot``, ``TravelAPI``, ``VehicleControlAPI``). They are imported from there (a
dependency, ``pip install --no-deps bfcl-eval==2026.3.23``), never copied. An item's state
(``ApiState``) follows BFCL 2026.3.23's ``execute_multi_turn_func_call``:

- one instance per class of the item's ``involved_classes``, made with no arguments; every class
  but the stateless ones (``MathAPI``) then loads ``initial_config[class]`` (a deep copy; ``{}``
  for a class the config does not name, which loads the class's defaults) with ``long_context``
  true when the item's category (its id without the trailing number) contains ``long_context``
  or ``composite``; config entries of classes not involved are ignored;
- a call's name is looked up among the public methods of those instances (a name two classes
  share goes to the later class of ``involved_classes``; none of the shipped classes share one);
- its result, as BFCL records it: a ``str`` as it is, a ``dict`` as ``json.dumps`` (``str`` when
  that fails), anything else ``str()``; an exception ``e`` as ``"Error during execution: {e}"``.
  That includes calling an unknown name (``name 'foo' is not defined``, Python's words), bad
  arguments (the method's ``TypeError``), a syntax error (the text ``eval`` gives, as the call
  is parsed as ``eval`` parses it), and BFCL's block list (``kill``, ``exit``, ``quit``,
  ``remove``, ``unlink``, ``popen``, ``Popen``, ``run``: ``Function call run is not allowed.``).

Where this differs from BFCL on purpose: BFCL hands the call string to ``eval`` (after
prefixing every ``name(`` in it, inside string literals too, with an instance's name); here the
string is parsed (``ast``) and must be one plain call ``name(...)`` whose arguments are
literals (``ast.literal_eval``): an attribute, a nested call, a variable, ``*``/``**`` or an
f-string is answered ``"Error during execution: not a plain call with literal arguments: ..."``
and nothing runs. String arguments are passed as written (BFCL would rewrite ``ls(`` inside
them; no ground-truth call has such a string). A call whose cost grows with an argument past what
an evaluation can wait for is answered with an error and does not run (``GUARDS``; a thread or a
signal cannot stop it, as it computes in C holding the GIL). Each call runs with the
``decimal`` context and ``mpmath`` precision of the process restored afterwards (``MathAPI``
sets them globally; its results are the same, as it sets them before every use).

Tool docs (``tool_docs``): the ``multi_turn_func_doc`` docs of each involved class, in order, as
BFCL's ``populate_test_cases_with_predefined_functions`` and its Python hint make them: a
``miss_func`` item's ``missed_function`` docs are taken out and returned per turn (the turn at
which BFCL adds them back), and only the docs given from the start get the hint " Note that the
provided function is in Python 3 syntax." (BFCL appends it after moving the missed ones aside).
``excluded_function`` is ignored, as BFCL 2026.3.23 ignores it.

The guards (``GUARDS``), each answered ``"Error during execution: <method>: ..."`` naming the
argument and the bound; BFCL's own classes would compute for minutes, fill the memory or loop
forever:

- ``MathAPI``: ``logarithm`` and ``square_root`` past ``PRECISION_DIGITS`` digits of precision
  (mpmath, decimal); ``power`` and ``multiply`` of two integers whose result would have over
  ``INT_BITS`` bits (Python writes no integer of over 4,300 decimal digits, about 14,300 bits,
  so BFCL records those results as errors too, after computing them); ``round_number`` of an
  integer to ``decimal_places`` below ``-MAX_ROUND_DIGITS`` (Python computes
  ``10 ** -decimal_places``: ``round_number(number=5, decimal_places=-1000000000)`` ran for
  minutes; BFCL would answer 0 when it returned) or of an integer over ``INT_BITS`` bits to
  negative places (a long division);
- ``GorillaFileSystem``: ``find`` and ``du`` of a tree with over ``MAX_WALK`` entries as they
  walk it (``cp`` of a directory shares its subdirectories, so seven calls double the walk:
  22 doublings took 7 s and 630 MB; a directory copied into itself is a cycle);
- ``MessageAPI``: ``send_message`` once its ``MESSAGE_IDS`` ids are taken.

Every other method of the eight classes was read for costs that grow with an argument and has
none past the call's own length: arguments are literals (a decimal integer has at most 4,300
digits; a hexadecimal one is as long as its text), and sums, comparisons, ``in``, sorting and
string operations are linear in them or in the state the calls wrote
(``TravelAPI.compute_exchange_rate`` repeats a string argument at most 110 times, its largest
rate); no method loops on a count it is given. What is left (a long call text, many calls) is
bounded where the calls run: the eval's killable scoring process
(``gdpo_ray.eval.time_limit.ScoringPool``), a rollout's tool timeout.

This module is the basement's: it imports nothing of the eval suites, actors or the driver;
``bfcl_eval`` is imported when an item is first built.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import decimal
import importlib
import importlib.util
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

ERROR_PREFIX = "Error during execution: "
#: names BFCL refuses to run (its ``execute_multi_turn_func_call``), whatever they name
BLOCKED = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
#: the most digits of precision ``MathAPI.logarithm`` (mpmath) and ``square_root`` (decimal)
#: compute (~0.2 s at 10,000)
PRECISION_DIGITS = 10_000
#: the largest integer ``MathAPI`` computes, in bits: a power's, a product's, a rounding's
#: ``10 ** -decimal_places`` or number (~0.05 s for ``3 ** 630_000``; a rounding at most ~0.6 s)
INT_BITS = 1_000_000
#: the most decimal places below zero an integer is rounded to: 10 ** 301_029 has INT_BITS bits
MAX_ROUND_DIGITS = math.floor(INT_BITS * math.log10(2))
#: the most entries ``GorillaFileSystem.find`` and ``du`` walk (BFCL's largest tree has 124)
MAX_WALK = 100_000
#: the message ids ``MessageAPI`` draws from (10000-99999): once all are taken it loops forever
MESSAGE_IDS = 90_000
_QUOTE = 80


class UnsafeCall(ValueError):
    """A call string that is not one plain call with literal arguments."""


def package_dir() -> Path:
    """bfcl-eval's package directory (its data and classes)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("BFCL multi-turn needs the bfcl-eval package (its data and API classes): "
                         "pip install --no-deps bfcl-eval==2026.3.23")
    return Path(list(spec.submodule_search_locations)[0])


def is_long_context(item_id: str) -> bool:
    """BFCL's ``long_context`` flag of an item: its category names long_context or composite."""
    category = item_id.rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category


# --- parsing a call -----------------------------------------------------------------------------

def parse_call(text: str) -> tuple[str, tuple, dict[str, Any]]:
    """``(name, args, kwargs)`` of one call string. Raises ``SyntaxError`` (with the text
    ``eval`` would give: the string is parsed as ``eval`` parses it, leading blanks and tabs
    stripped) or ``UnsafeCall`` for anything but ``name(literal, ..., key=literal, ...)``."""
    call = _call_node(text)
    return call.func.id, *_arguments(call, text)


def _call_node(text: str) -> ast.Call:
    """The call's syntax tree, checked to be ``name(...)``."""
    if not isinstance(text, str):
        raise UnsafeCall(f"a call must be a string; got {type(text).__name__}")
    call = ast.parse(text.lstrip(" \t"), "<string>", "eval").body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise UnsafeCall(f"not a plain call with literal arguments: {text.strip()[:_QUOTE]!r}")
    return call


def _arguments(call: ast.Call, text: str) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments, each a literal (``ast.literal_eval``), else ``UnsafeCall``."""
    try:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise ValueError("* or **")
        return (tuple(ast.literal_eval(a) for a in call.args),
                {k.arg: ast.literal_eval(k.value) for k in call.keywords})
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise UnsafeCall(f"not a plain call with literal arguments: {text.strip()[:_QUOTE]!r}") from None


def blocked_name(text: str) -> str | None:
    """The name BFCL's block list refuses in ``text``, found as BFCL finds it (the text before
    the first ``(``, and of that the part after the first ``.`` if it has one), or None."""
    head = text.split("(")[0]
    if "." in head:
        head = head.split(".")[1]
    return head if head in BLOCKED else None


def call_string(name: str, arguments: Mapping[str, Any]) -> str:
    """A JSON tool call as BFCL's function-calling handlers write it for execution
    (``convert_to_function_call``): ``name(k1=repr(v1),k2=repr(v2))``."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


# --- results ------------------------------------------------------------------------------------

def as_result(value: Any) -> str:
    """A method's return value as BFCL records it."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except Exception:  # noqa: BLE001 - BFCL falls back to str() on any failure
            return str(value)
    return str(value)


@contextlib.contextmanager
def _precision_kept() -> Iterator[None]:
    """The thread's decimal context and mpmath's precision, as they were, after the block."""
    mpmath = sys.modules.get("mpmath")
    prec = mpmath.mp.prec if mpmath is not None else None
    try:
        with decimal.localcontext():
            yield
    finally:
        if mpmath is not None:
            mpmath.mp.prec = prec


def _integers(*values: Any) -> bool:
    return all(isinstance(v, int) for v in values)  # bool too: it is an int to Python's arithmetic


def _short(value: Any) -> str:
    """An argument as the guards' messages quote it (a long integer by its size)."""
    if isinstance(value, int) and abs(value).bit_length() > 64:
        return f"<an integer of {abs(value).bit_length():,} bits>"
    return repr(value)


def _precision(instance: Any, args: Mapping[str, Any]) -> str | None:
    value = args.get("precision")
    if type(value) in (int, float) and value > PRECISION_DIGITS:
        return f"precision={_short(value)} is over {PRECISION_DIGITS:,}, the most this evaluation computes"
    return None


def _power(instance: Any, args: Mapping[str, Any]) -> str | None:
    base, exponent = args.get("base"), args.get("exponent")
    if _integers(base, exponent) and abs(base) > 1 and exponent * abs(base).bit_length() > INT_BITS:
        return f"{_short(base)}**{_short(exponent)} has over {INT_BITS:,} bits, more than this evaluation computes"
    return None


def _multiply(instance: Any, args: Mapping[str, Any]) -> str | None:
    a, b = args.get("a"), args.get("b")
    if _integers(a, b) and a and b and abs(a).bit_length() + abs(b).bit_length() - 1 > INT_BITS:
        return f"{_short(a)}*{_short(b)} has over {INT_BITS:,} bits, more than this evaluation computes"
    return None


def _round_number(instance: Any, args: Mapping[str, Any]) -> str | None:
    number, places = args.get("number"), args.get("decimal_places", 0)
    if not _integers(number, places) or places >= 0:
        return None  # a float rounds in constant time; an int to places >= 0 is itself
    if -places > MAX_ROUND_DIGITS:
        return (f"decimal_places={_short(places)} is below -{MAX_ROUND_DIGITS:,}, the fewest this evaluation "
                f"rounds an integer to (10**{_short(-places)} has over {INT_BITS:,} bits)")
    if abs(number).bit_length() > INT_BITS:
        return f"number has over {INT_BITS:,} bits, more than this evaluation rounds to negative decimal places"
    return None


def _entries_over(directory: Any, limit: int) -> bool:
    """Whether a walk of ``directory`` (BFCL's ``find`` and ``du`` recurse into every
    subdirectory, a shared one once per path to it) meets more than ``limit`` entries."""
    stack, seen = [directory], 0
    while stack:
        for item in getattr(stack.pop(), "contents", {}).values():
            seen += 1
            if seen > limit:
                return True
            if hasattr(item, "contents"):
                stack.append(item)
    return False


def _walk(instance: Any, args: Mapping[str, Any], name: str) -> str | None:
    path = args.get("path", ".") if name == "find" else None
    try:
        start = instance._navigate_to_directory(path)
    except Exception:  # noqa: BLE001 - a bad path: the call itself answers it
        return None
    if not isinstance(start, dict) and _entries_over(start, MAX_WALK):
        return (f"the tree it would walk has over {MAX_WALK:,} entries (directories copied into one "
                f"another), more than this evaluation walks")
    return None


def _send_message(instance: Any, args: Mapping[str, Any]) -> str | None:
    ids = getattr(instance, "generated_ids", ())
    if len(ids) >= MESSAGE_IDS and sum(isinstance(i, int) and 10_000 <= i <= 99_999 for i in ids) >= MESSAGE_IDS:
        return f"all {MESSAGE_IDS:,} message ids are taken (MessageAPI would draw a free one forever)"
    return None


#: (class, method) -> a check of the instance and the call's bound arguments: why the call must
#: not run, or None
GUARDS: dict[tuple[str, str], Callable[[Any, Mapping[str, Any]], str | None]] = {
    ("MathAPI", "logarithm"): _precision,
    ("MathAPI", "square_root"): _precision,
    ("MathAPI", "power"): _power,
    ("MathAPI", "multiply"): _multiply,
    ("MathAPI", "round_number"): _round_number,
    ("GorillaFileSystem", "find"): lambda instance, args: _walk(instance, args, "find"),
    ("GorillaFileSystem", "du"): lambda instance, args: _walk(instance, args, "du"),
    ("MessageAPI", "send_message"): _send_message,
}


def refused(class_name: str, instance: Any, name: str, args: tuple, kwargs: dict) -> str | None:
    """Why the call ``name(*args, **kwargs)`` of ``instance`` must not run (``GUARDS``:
    ``"<name>: ..."``), or None (it runs; arguments the method does not take get its own TypeError)."""
    guard = GUARDS.get((class_name, name))
    if guard is None:
        return None
    try:
        bound = inspect.signature(getattr(instance, name)).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    reason = guard(instance, bound)
    return None if reason is None else f"{name}: {reason}"


# --- an item's state ----------------------------------------------------------------------------

class ApiState:
    """The instances of one item's ``involved_classes`` (see the module docstring), which the
    calls of one trajectory change; ``instances`` maps class name -> instance."""

    def __init__(self, involved_classes: Sequence[str], initial_config: Mapping[str, Any],
                 long_context: bool = False) -> None:
        from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES

        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, Any]] = {}
        for class_name in involved_classes:
            if class_name not in CLASS_FILE_PATH_MAPPING:
                raise ValueError(f"BFCL class {class_name!r} is not one of bfcl-eval's "
                                 f"({', '.join(CLASS_FILE_PATH_MAPPING)})")
            instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
            if class_name not in STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})),
                                        long_context=long_context)
            self.instances[class_name] = instance
            for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self._methods[name] = (class_name, instance)

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> "ApiState":
        """The state an item (a BFCL prompt entry: id, involved_classes, initial_config) starts in."""
        return cls(entry["involved_classes"], entry.get("initial_config", {}), is_long_context(entry["id"]))

    def execute(self, call: str) -> str:
        """One call string run, its result as BFCL records it (errors included). BFCL's order:
        the block list, then the name (Python evaluates it before the arguments), then the
        arguments and the method."""
        try:
            if isinstance(call, str) and blocked_name(call):
                raise UnsafeCall(f"Function call {blocked_name(call)} is not allowed.")
            node = _call_node(call)
            name = node.func.id
            if name not in self._methods:
                raise NameError(f"name '{name}' is not defined")
            args, kwargs = _arguments(node, call)
            class_name, instance = self._methods[name]
            reason = refused(class_name, instance, name, args, kwargs)
            if reason:
                raise UnsafeCall(reason)
            method = getattr(instance, name)
            with _precision_kept():
                return as_result(method(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - every failure is the call's recorded result
            return f"{ERROR_PREFIX}{err}"

    def run(self, calls: Sequence[str]) -> list[str]:
        """The calls in order, their results."""
        return [self.execute(c) for c in calls]

    def public_state(self) -> dict[str, dict[str, Any]]:
        """class name -> its public attributes (those BFCL's state check compares)."""
        return {name: {k: v for k, v in vars(inst).items() if not k.startswith("_")}
                for name, inst in self.instances.items()}


# --- tool docs ----------------------------------------------------------------------------------

def _doc_lines(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tool_docs(involved_classes: Sequence[str], missed_function: Mapping[str, Sequence[str]] | None = None
              ) -> tuple[list[dict], dict[int, list[dict]]]:
    """(the docs the model has from the first turn, turn -> the docs added at that turn), as the
    module docstring says BFCL makes them."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    root = package_dir() / "data" / "multi_turn_func_doc"
    docs = [doc for c in involved_classes for doc in _doc_lines(root / MULTI_TURN_FUNC_DOC_FILE_MAPPING[c])]
    added: dict[int, list[dict]] = {}
    for turn, names in (missed_function or {}).items():
        added[int(turn)] = []
        for name in names:
            at = next((i for i, d in enumerate(docs) if d["name"] == name), None)
            if at is not None:
                added[int(turn)].append(docs.pop(at))
    return [dict(d, description=d["description"] + PYTHON_HINT) for d in docs], added
