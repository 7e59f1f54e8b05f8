"""``bfcl`` / ``bfcl:<category>``: the Berkeley Function Calling Leaderboard's single-turn
Python categories, from the data the ``bfcl-eval`` package ships (``pip install --no-deps
bfcl-eval==2026.3.23``: 1.9 MB; its BFCL v4 files ``data/BFCL_v4_<category>.json`` and
``data/possible_answer/``, JSON lines).

Prompts: the ``tool_calling`` preset's system prompt (``gdpo_ray.tasks.TOOL_SYSTEM``) listing
the item's function docs, each description ending with BFCL's " Note that the provided function
is in Python 3 syntax.", placed before the item's own system message as BFCL places its own;
then the item's turn. Completions are read in that format (``<tool_call>`` with one JSON call
per line, ``{"name", "parameters" | "arguments"}``) and in BFCL's own output forms (Python call
syntax in brackets, JSON call objects or lists, either in a fenced block: ``decode``), and
converted to the checker's input, a list of ``{name: {param: value}}``.

Scoring is BFCL's, reimplemented here (``ast_valid``, ``relevance_valid``) because its own
checker module imports every model handler of the leaderboard and cannot join this environment;
``tests/unit/test_bfcl.py`` proves the verdicts equal to ``bfcl_eval``'s ``ast_checker`` (run in
``.venv-bfcl``, ``scripts/test-bfcl-checker.sh``) on every possible answer and on perturbations
of each. Its rules, as that checker has them:

- ``simple*``: exactly one call; ``multiple*``: exactly one call, of the answer's function;
  ``parallel*``: as many calls as the answer, each answer call taking the first unmatched call
  that passes it (order free);
- a call passes when its name is the answer's, every required parameter is given, every given
  one is in the doc and in the answer, each value has the doc's type (``type(v) is T``: no bool
  for an integer, no 10.0 for an integer; an int is taken for a float parameter; list items
  checked one level deep; a value of the answer's own type is a "variable", compared as is) and
  is one of the allowed values (strings without spaces and ``,./-_*^``, lowercased, ``'`` as
  ``"``; lists whole and in order; dicts key by key one level deep, lists of dicts position by
  position), and every answer parameter not given allows ``""``;
- ``irrelevance``, ``live_irrelevance``: right when no call decodes; ``live_relevance``: right
  when a non-empty call decodes (arguments not checked).

Metrics: ``accuracy`` (the above) and ``format_ratio`` (ToolRL's format reward,
``gdpo_ray.rewards.toolrl.format_matches``: ``<think>…</think>`` then a ``<tool_call>`` block,
or a ``<response>`` for the irrelevance categories; a right call in another form, or without
the ``<think>`` block, scores 0 on it by design). Each sample also keeps ``reason``: "" when
right, else BFCL's error type (``ast_decoder:decoder_failed``, ``simple_function_checker:
missing_required``, ``value_error:string``, ``irrelevance_error:decoder_success``, ...: those of
its eval runner and ``ast_checker``, proven equal by the same test) and, in parentheses, what
it is about (the parameter, the value, why the output did not decode).

``bfcl`` (every category below) also reports the leaderboard's v4 groups restricted to these
categories: ``non_live`` (the unweighted mean of simple_python, multiple, parallel,
parallel_multiple), ``live`` (the four live AST categories weighted by items),
``irrelevance`` (the mean of irrelevance and live_irrelevance), and ``accuracy`` = their
unweighted mean (the v4 overall's equal weights on these three; its multi-turn and agentic
parts, and the Java/JavaScript simple categories, are not evaluated here).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Sequence

from gdpo_ray.bfcl.data import load_category
from gdpo_ray.bfcl.decode import NotACall, read_calls
from gdpo_ray.eval.report import nanmean
from gdpo_ray.eval.suite import Completion, EvalItem, Suite
from gdpo_ray.tool_format import in_block

NON_LIVE_AST = ("simple_python", "multiple", "parallel", "parallel_multiple")
LIVE_AST = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE = ("irrelevance", "live_irrelevance")
RELEVANCE = ("live_relevance",)
CATEGORIES = NON_LIVE_AST + LIVE_AST + IRRELEVANCE + RELEVANCE
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."

TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
         "dict": dict, "any": str}
_STRIP = re.compile(r"[ ,./\-_*^]")


# --- the checker's rules --------------------------------------------------------------------

def standardize(text: str) -> str:
    return _STRIP.sub("", text).lower().replace("'", '"')


def _answer_type(allowed: Sequence[Any]) -> type | None:
    """The type of an answer's first allowed value that is not the optional mark ""."""
    return next((type(v) for v in allowed if v != ""), None)


def _type_error(value: Any, allowed: Sequence[Any], want: type, item_type: type | None) -> tuple[str, bool]:
    """(the checker's type error, "" when the value's type passes; it is a "variable": of the
    answer's own type, not the doc's)."""
    answer_type = _answer_type(allowed)
    variable = answer_type is not None and answer_type is not want
    error = "type_error:simple"
    if type(value) is want:
        if item_type is None:
            return "", variable
        # list items, one level deep: against the first allowed alternative that is not a list
        # (always passes) or whose items all type-check
        for alternative in allowed:
            if not isinstance(alternative, list) or all(
                    not _type_error(v, alternative, item_type, None)[0] for v in value):
                return "", variable
        error = "type_error:nested"
        if type(value) is answer_type:
            return error, True
        return "type_error:simple", variable
    if answer_type is not None and type(value) is answer_type:
        return "", True
    return error, variable


def _string_ok(value: str, allowed: Sequence[Any]) -> bool:
    return standardize(value) in [standardize(a) for a in allowed if isinstance(a, str)]


def _std_items(values: Sequence[Any]) -> list:
    return [standardize(v) if isinstance(v, str) else v for v in values]


def _list_ok(value: list, allowed: Sequence[Any]) -> bool:
    return _std_items(value) in [_std_items(list(a)) for a in allowed]  # "" (optional) is []


def _dict_error(value: dict, allowed: Sequence[Any]) -> str:
    """"" when the dict is one of the allowed ones, key by key; else the last alternative's error."""
    if not isinstance(value, dict):  # an item of a list of dicts that is not one
        return "value_error:dict_value"
    error = "dict_checker:unclear"  # no alternative but the optional mark
    for alternative in allowed:
        if alternative == "":
            continue
        error = next(("value_error:dict_key" if k not in alternative else "value_error:dict_value"
                      for k, v in value.items() if k not in alternative or
                      (standardize(v) if isinstance(v, str) else v) not in _std_items(alternative[k])), "")
        if any(k not in value and "" not in vs for k, vs in alternative.items()):
            error = "value_error:dict_key"
        if not error:
            return ""
    return error


def _list_of_dicts_error(value: list, allowed: Sequence[Any]) -> str:
    error = "list_dict_checker:unclear"
    for alternative in allowed:
        if len(value) != len(alternative):
            error = "value_error:list_dict_count"
            continue
        error = next((e for i in range(len(value)) if (e := _dict_error(value[i], [alternative[i]]))), "")
        if not error:
            return ""
    return error


def _clip(text: str, limit: int = 60) -> str:
    """A model's text in a reason, cut short."""
    return text if len(text) <= limit else text[:limit] + "..."


def _short(value: Any) -> str:
    return _clip(repr(value))


def call_error(doc: Mapping[str, Any], call: Mapping[str, Any], answer: Mapping[str, Any]) -> str:
    """Why one model call (``{name: {param: value}}``) fails one answer call and its doc: the
    checker's error type then what it is about, e.g. ``simple_function_checker:missing_required
    (parameter 'unit')``; "" when it passes."""
    allowed_by_param = next(iter(answer.values()))
    name = doc["name"]
    if name not in call:
        called = _clip(", ".join(map(str, call)))
        return f"simple_function_checker:wrong_func_name (called {called}, not {name})"
    given = call[name]
    properties, required = doc["parameters"]["properties"], doc["parameters"]["required"]
    missing = next((p for p in required if p not in given), None)
    if missing is not None:
        return f"simple_function_checker:missing_required (parameter {missing!r})"
    for param, value in given.items():
        if param not in properties or param not in allowed_by_param:
            return f"simple_function_checker:unexpected_param (parameter {_short(param)})"
        allowed = allowed_by_param[param]
        kind = properties[param]["type"]
        want = TYPES[kind]
        item_type = TYPES[properties[param]["items"]["type"]] if kind in ("array", "tuple") else None
        if kind == "tuple" and type(value) is tuple:
            value = list(value)
        if kind == "float" and type(value) is int:
            value = float(value)
        error, variable = _type_error(value, allowed, want, item_type)
        if error == "type_error:nested":
            items = properties[param]["items"]["type"]
            return f"{error} (parameter {param!r}: an item is not of the doc's type {items})"
        if error:
            return f"{error} (parameter {param!r}: {type(value).__name__}, the doc's type is {kind})"
        if not variable:
            if want is dict:
                error = _dict_error(value, allowed)
            elif want is list and item_type is dict:
                error = _list_of_dicts_error(value, allowed)
            elif want is str:
                error = "" if _string_ok(value, allowed) else "value_error:string"
            elif want is list:
                error = "" if _list_ok(value, allowed) else "value_error:list/tuple"
            elif value not in allowed:
                error = "value_error:others"
        elif value not in allowed:
            error = "value_error:others"
        if error:
            return f"{error} (parameter {param!r}: {_short(value)} is not allowed)"
    missing = next((p for p in allowed_by_param if p not in given and "" not in allowed_by_param[p]), None)
    if missing is not None:
        return f"simple_function_checker:missing_optional (parameter {missing!r})"
    return ""


def call_valid(doc: Mapping[str, Any], call: Mapping[str, Any], answer: Mapping[str, Any]) -> bool:
    """One model call against one answer call and its doc (``call_error``)."""
    return not call_error(doc, call, answer)


def _doc(functions: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((f for f in functions if f["name"] == name), None)


def ast_error(functions: Sequence[Mapping[str, Any]], calls: Sequence[Mapping[str, Any]],
              answer: Sequence[Mapping[str, Any]], category: str) -> str:
    """Why the decoded ``calls`` of an item of ``category`` fail BFCL's AST checker ("" when
    they pass): its error type, then what it is about."""
    checker = ("parallel_function_checker_no_order" if "parallel" in category else
               "multiple_function_checker" if "multiple" in category else "simple_function_checker")
    if len(calls) != len(answer):
        return f"{checker}:wrong_count ({len(calls)} calls, the answer has {len(answer)})"
    if "parallel" in category:
        used: set[int] = set()
        for k, gold in enumerate(answer):
            doc = _doc(functions, next(iter(gold)))
            error = ""
            for i, call in enumerate(calls):
                if i in used:
                    continue
                error = call_error(doc, call, gold)
                if not error:
                    used.add(i)
                    break
            if error:
                return (f"{checker}:cannot_find_match (no call left matches the answer's call {k + 1}, "
                        f"{doc['name']}; the last tried: {error})")
        return ""
    if "multiple" in category:
        return call_error(_doc(functions, next(iter(answer[0]))), calls[0], answer[0])
    return call_error(functions[0], calls[0], answer[0])


def ast_valid(functions: Sequence[Mapping[str, Any]], calls: Sequence[Mapping[str, Any]],
              answer: Sequence[Mapping[str, Any]], category: str) -> bool:
    """BFCL's AST verdict for the decoded ``calls`` of an item of ``category`` (``ast_error``)."""
    return not ast_error(functions, calls, answer, category)


def is_call_list(calls: Any) -> bool:
    """The checker's input shape: a list of one-key dicts whose value is a dict."""
    return isinstance(calls, list) and all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict) for c in calls)


def relevance_valid(calls: Any, category: str) -> bool:
    """irrelevance categories: no call (nothing decodes, or an empty one); live_relevance: a call."""
    has_call = is_call_list(calls) and len(calls) > 0 and not (len(calls) == 1 and len(calls[0]) == 0)
    return not has_call if "irrelevance" in category else has_call


# --- completions ------------------------------------------------------------------------------

def decode(completion: str) -> list[dict] | None:
    """The calls of a completion as the checker's input (``gdpo_ray.bfcl.decode``: a
    ``<tool_call>`` block, JSON calls or Python call syntax, fenced or not); None when none
    decode."""
    try:
        return read_calls(completion)
    except NotACall:
        return None


def completion_error(completion: str, entry: Mapping[str, Any], category: str) -> str:
    """Why a completion of an item is wrong, in BFCL's error types (its eval runner's, then its
    checker's) with what it is about; "" when it is right."""
    try:
        calls, why = read_calls(completion), ""
    except NotACall as err:
        calls, why = None, str(err)
    if category in IRRELEVANCE + RELEVANCE:
        if relevance_valid(calls, category):
            return ""
        if "irrelevance" in category:
            called = _clip(", ".join(n for c in calls for n in c))
            return f"irrelevance_error:decoder_success (it calls {called})"
        return f"relevance_error:decoder_failed ({why or 'no call'})"
    if calls is None:
        return f"ast_decoder:decoder_failed ({why})"
    if not is_call_list(calls):
        return "ast_decoder:decoder_wrong_output_format"
    return ast_error(entry["function"], calls, entry["ground_truth"], category)


def prompt_of(item: Mapping[str, Any]) -> list[dict]:
    """The chat messages of a BFCL item (see the module docstring)."""
    from gdpo_ray.tasks import TOOL_SYSTEM

    docs = [dict(f, description=f.get("description", "") + PYTHON_HINT) for f in item["function"]]
    system = TOOL_SYSTEM.format(tools="\n".join(json.dumps(d) for d in docs))
    messages = [dict(m) for m in item["question"][0]]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


_CALL_FORMAT = "<think></think>\n" + in_block("{}")
_RESPONSE_FORMAT = "<think></think>\n<response></response>"


class BFCL(Suite):
    metrics = ("accuracy", "format_ratio")  # per sample; ``overall`` of bfcl adds its groups
    max_tokens = 512

    def __init__(self, category: str | None = None, length_limit: int | None = None) -> None:
        if category is not None and category not in CATEGORIES:
            raise ValueError(f"unknown BFCL category {category!r}; the Python single-turn ones: "
                             f"{', '.join(CATEGORIES)} (or bfcl for all)")
        self.categories = (category,) if category else CATEGORIES
        self.name = f"bfcl:{category}" if category else "bfcl"
        if length_limit is not None:
            self.length_limit = length_limit
        self._items = [(c, entry) for c in self.categories for entry in load_category(c)]

    def all_items(self) -> list[EvalItem]:
        return [EvalItem(e["id"], prompt_of(e), c, e) for c, e in self._items]

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards.toolrl import format_matches

        category, entry = item.category, item.reference
        wants_call = category not in IRRELEVANCE
        out = []
        for c in completions:
            reason = completion_error(c.text, entry, category)
            shape = _CALL_FORMAT if wants_call else _RESPONSE_FORMAT
            out.append({"accuracy": float(not reason), "format_ratio": float(format_matches(c.text, shape)),
                        "reason": reason})
        return out

    def overall(self, items: Mapping[str, Mapping[str, Any]], categories: Mapping[str, Mapping]) -> dict:
        """One category: the means over its items; ``bfcl``: the leaderboard's groups."""
        return {**self._grouped("accuracy", items, categories),
                "format_ratio": nanmean(i["format_ratio"] for i in items.values())}

    def overall_of(self, metric: str, items: Mapping[str, Mapping[str, Any]],
                   categories: Mapping[str, Mapping]) -> float:
        """pass@k grouped as ``accuracy`` is (``bfcl``: the mean of the leaderboard's groups)."""
        return self._grouped(metric, items, categories)["accuracy"]

    def _grouped(self, metric: str, items: Mapping[str, Mapping[str, Any]],
                 categories: Mapping[str, Mapping]) -> dict:
        """``metric`` as the leaderboard groups accuracy: one category, the mean over its items;
        ``bfcl``, the mean of non_live (over its categories), live (over its items) and
        irrelevance (over its categories), under ``accuracy``, with the three groups."""
        if len(self.categories) == 1:
            return {"accuracy": nanmean(i[metric] for i in items.values())}

        def acc(cat: str) -> float:
            return categories[cat][metric] if cat in categories else math.nan

        non_live = nanmean(acc(c) for c in NON_LIVE_AST)
        counts = {c: categories[c]["items"] for c in LIVE_AST if c in categories}
        live = (sum(acc(c) * n for c, n in counts.items()) / sum(counts.values())) if counts else math.nan
        irrelevance = nanmean(acc(c) for c in IRRELEVANCE)
        return {"accuracy": nanmean([non_live, live, irrelevance]), "non_live": non_live, "live": live,
                "irrelevance": irrelevance}
