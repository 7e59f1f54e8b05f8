"""The calls of a BFCL completion, in any of the forms a model answers in, as BFCL's checker
takes them: a list of ``{name: {param: value}}`` (``gdpo_ray.bfcl.single_turn``).

Read in this order (``read_calls``):

1. ``<tool_call>`` blocks anywhere in the completion (the ``tool_calling`` preset's format, the
   one the suite's prompt asks for): one JSON call per line, ``{"name", "parameters" |
   "arguments"}`` (``gdpo_ray.tool_format.calls_in``). A completion with a ``<tool_call>`` tag
   is read in this form only.
2. Otherwise the response: the text after the last ``</think>`` (as BFCL's handlers of reasoning
   models cut it), stripped, a leading ```` ```json ```` or ```` ```python ```` fence tag dropped
   (as its Phi handler does), then backticks, newlines and spaces stripped at both ends (as its
   ``default_decode_ast_prompting`` does: so a bare ```` ``` ```` fence goes too). It must be,
   as a whole, one of
   - JSON: a call object or a list of them, each ``{"name": str, "arguments": {...}}``,
     ``{"name": str, "parameters": {...}}`` or BFCL's JSON format ``{"function": str,
     "parameters": {...}}``;
   - Python call syntax, BFCL's prompting format: ``[f(a=1, b="x"), g(c=[1, 2])]``, the
     brackets optional. Parsed with ``ast``, never evaluated, as BFCL's decoder reads it:
     keyword arguments only (positional ones are dropped), literals as they are, a name as its
     string (``unit=celsius`` is ``"celsius"``), a call without keywords or a subscript as its
     source text, a call with keywords as a nested ``{name: {...}}``, ``...`` as ``"..."``.
     Arithmetic on numbers (``+ - * / // % **``, a unary minus or plus) and ``+`` on strings
     is computed (on integers of at most ``MAX_INT_BITS`` bits, giving one of at most that:
     a hexadecimal literal is as long as its text); anything else (``not``, ``**kwargs``, a
     lambda, a comprehension, an attribute, a string repeated) does not decode.

A completion that is none of these has no calls (``NotACall``, with the reason). Decoded
calls that nest lists and dicts past ``tool_format.MAX_DEPTH`` do not decode either, so the
checker's recursion stays bounded; every step is linear in the completion's length.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from gdpo_ray.tool_format import CLOSE, MAX_DEPTH, OPEN, Unparsable, calls_in, depth_ok

#: the JSON call objects read: (the name's key, the arguments' key)
JSON_CALL_KEYS = (("name", "arguments"), ("name", "parameters"), ("function", "parameters"))
FENCE_TAGS = ("```json", "```python")
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
               ast.Pow: operator.pow}
#: the largest integer arithmetic computes (bits); a larger result does not decode
MAX_INT_BITS = 4096


class NotACall(ValueError):
    """Why a completion has no calls that decode."""


def response_of(text: str) -> str:
    """The completion's response, as BFCL's prompting decoders see it (the module docstring)."""
    body = text.rsplit("</think>", 1)[-1].strip()
    for tag in FENCE_TAGS:
        if body.startswith(tag):
            body = body[len(tag):]
    return body.strip("`\n ")


def read_calls(text: str) -> list[dict]:
    """The completion's calls in the checker's input shape; raises ``NotACall``."""
    if OPEN in text:
        try:
            calls = calls_in(text)
        except Unparsable as err:
            raise NotACall(f"{OPEN} block does not parse: {err}") from None
        if calls is None:
            raise NotACall(f"{OPEN} without a closing {CLOSE}")
        return [{name: args} for name, args in calls]
    body = response_of(text)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        calls = _python_calls(body)
    else:
        calls = _json_calls(value, body)
    if not depth_ok(calls, MAX_DEPTH + 1):
        raise NotACall(f"nested deeper than {MAX_DEPTH} levels")
    return calls


def _json_calls(value: Any, body: str) -> list[dict]:
    objects = value if isinstance(value, list) else [value]
    calls = []
    for obj in objects:
        keys = next(((n, a) for n, a in JSON_CALL_KEYS if isinstance(obj, dict) and n in obj and a in obj),
                    None)
        if keys is None or not isinstance(obj[keys[0]], str) or not isinstance(obj[keys[1]], dict):
            raise NotACall("JSON that is not a call object {\"name\", \"arguments\"} (or a list of "
                           f"them): {_short(body)}")
        calls.append({obj[keys[0]]: obj[keys[1]]})
    return calls


def _python_calls(body: str) -> list[dict]:
    source = body if body.startswith("[") else "[" + body
    source = source if source.endswith("]") else source + "]"
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        raise NotACall(f"neither JSON nor Python call syntax: {_short(body)}") from None
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        raise NotACall(f"nested too deep to parse: {_short(body)}") from None
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        raise NotACall(f"not a list of calls: {_short(body)}")
    try:
        return [_call(e) for e in tree.elts]
    except RecursionError:  # a value nested past the interpreter's recursion limit (1 + 1 + ...)
        raise NotACall(f"nested too deep: {_short(body)}") from None
    except NotACall:
        raise
    except ValueError:  # a call or subscript taken as its text holds an integer too long to write
        raise NotACall(f"an integer of over 4,300 digits in a value taken as text: {_short(body)}") from None


def _call(node: ast.Call) -> dict:
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    args = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise NotACall(f"**{_source(keyword.value)} is not a keyword argument")
        args[keyword.arg] = _value(keyword.value)
    return {".".join(reversed(parts)): args}


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(v) for v in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise NotACall("a dict with ** does not decode")
        try:
            return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
        except TypeError:  # a key that is a list or a dict
            raise NotACall(f"a dict key that is not a literal: {_source(node)}") from None
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _call(node) if node.keywords else ast.unparse(node)
    if isinstance(node, ast.Subscript):
        return f"{ast.unparse(node.value)}[{ast.unparse(node.slice)}]"
    if isinstance(node, (ast.UnaryOp, ast.BinOp)):
        return _arithmetic(node)
    raise NotACall(f"{type(node).__name__} is not a value: {_source(node)}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _arithmetic(node: ast.AST) -> Any:
    """A unary minus or plus on a number; ``+ - * / // % **`` on numbers, ``+`` on strings."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        if _number(value):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, str) and isinstance(right, str):
            return left + right
        if _number(left) and _number(right):
            # an operand past the bound (a hexadecimal literal is as long as its text: a
            # product or a division of two of megabytes takes seconds to minutes), or a power
            # whose result would be, is refused before it is computed
            too_big = any(isinstance(v, int) and v.bit_length() > MAX_INT_BITS for v in (left, right)) or (
                isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int)
                and abs(left) > 1 and right * (left.bit_length() - 1) > MAX_INT_BITS)
            if too_big:
                raise NotACall(f"an integer past {MAX_INT_BITS} bits: {_source(node)}")
            try:
                result = _ARITHMETIC[type(node.op)](left, right)
            except (ArithmeticError, ValueError) as err:
                raise NotACall(f"{_source(node)}: {err}") from None
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise NotACall(f"an integer past {MAX_INT_BITS} bits: {_source(node)}")
            return result
    raise NotACall(f"not arithmetic on numbers: {_source(node)}")


def _source(node: ast.AST) -> str:
    """A node's source text as messages quote it."""
    try:
        return _short(ast.unparse(node))
    except ValueError:  # an integer of over 4,300 digits has no decimal text
        return f"<{type(node).__name__.lower()} holding an integer too long to write>"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
