"""BFCL: gold answers in our tool-call format score 1.0; the matcher gives BFCL's own verdict
and error type on every possible answer and on perturbations of each (the latter against
bfcl-eval's ast_checker in .venv-bfcl: scripts/test-bfcl-checker.sh); model outputs in BFCL's
own forms decode as bfcl-eval's handlers decode them (differences named in DECODE_TABLE); each
sample keeps the checker's reason."""

import copy
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

bfcl = pytest.importorskip("gdpo_ray.bfcl.single_turn")
if __import__("importlib").util.find_spec("bfcl_eval") is None:
    pytest.skip("needs bfcl-eval's data: pip install --no-deps bfcl-eval==2026.3.23", allow_module_level=True)

from gdpo_ray.eval.suite import Completion  # noqa: E402
from gdpo_ray.eval.suites import make_suite  # noqa: E402

#: possible answers no output can pass, under BFCL's checker too: a required parameter whose
#: allowed values are [] (live_simple 106, 112), a required parameter the doc does not have
#: (live_multiple 862), a parameter named otherwise than in the doc (live_multiple 964)
UNSATISFIABLE = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3",
                 "live_multiple_964-207-0"}


def _pick(allowed, required):
    """(keep it, its value): a parameter that may be left out ("" allowed, not required) is
    left out; else its first value that is not ""."""
    if "" in allowed and not required:
        return False, None
    values = [v for v in allowed if v != ""]
    return (True, values[0]) if values else (bool(allowed), "")


def gold_calls(entry):
    """The item's possible answer as the checker's input, one value per parameter."""
    docs = {f["name"]: f for f in entry["function"]}
    calls = []
    for gold in entry["ground_truth"]:
        (name, params), = gold.items()
        doc = docs.get(name, {"parameters": {"properties": {}, "required": []}})["parameters"]
        args = {}
        for param, allowed in params.items():
            keep, value = _pick(allowed, param in doc["required"])
            if not keep or (param not in doc["properties"] and "" in allowed):
                continue
            kind = doc["properties"].get(param, {})
            if kind.get("type") == "dict" and isinstance(value, dict):
                value = {k: v for k, a in value.items() for ok, v in [_pick(a, False)] if ok}
            elif kind.get("type") == "array" and kind.get("items", {}).get("type") == "dict":
                value = [{k: v for k, a in d.items() for ok, v in [_pick(a, False)] if ok} for d in value]
            args[param] = value
        calls.append({name: args})
    return calls


def as_completion(calls):
    lines = "\n".join(json.dumps({"name": n, "parameters": a}) for c in calls for n, a in c.items())
    return f"<think>The request needs these calls.</think>\n<tool_call>\n{lines}\n</tool_call>"


@pytest.fixture(scope="module")
def suite():
    return make_suite("bfcl")


def test_bfcl_gold_answers_as_completions_score_one(suite):
    items = suite.items()
    assert len(items) == 3491 and {it.category for it in items} == set(bfcl.CATEGORIES)
    wrong = []
    for it in items:
        if it.category in bfcl.IRRELEVANCE:
            text = "<think>No function fits.</think>\n<response>I cannot do that with these tools.</response>"
        elif it.category in bfcl.RELEVANCE:
            fn = it.reference["function"][0]
            text = as_completion([{fn["name"]: {}}])
        else:
            text = as_completion(gold_calls(it.reference))
        (scored,) = suite.score(it, [Completion(text)])
        assert scored["format_ratio"] == 1.0, it.id
        if scored["accuracy"] != 1.0:
            wrong.append(it.id)
    assert set(wrong) == UNSATISFIABLE


def test_bfcl_suite_report_groups_as_the_leaderboard(suite):
    from gdpo_ray.eval.report import build_report

    items = suite.items()
    # every item right except the unsatisfiable ones, and half the live_irrelevance items wrong
    scored, cats = {}, {}
    for i, it in enumerate(items):
        right = it.id not in UNSATISFIABLE and not (it.category == "live_irrelevance" and i % 2)
        scored[it.id] = [{"accuracy": float(right), "format_ratio": 1.0}]
        cats[it.id] = it.category
    report = build_report(suite, scored, cats, "p", {})
    live_irr = report["categories"]["live_irrelevance"]["accuracy"]
    assert report["overall"]["non_live"] == 1.0
    assert report["overall"]["live"] == pytest.approx((256 + 1051 + 16 + 24) / (258 + 1053 + 16 + 24))
    assert report["overall"]["irrelevance"] == pytest.approx((1.0 + live_irr) / 2)
    assert report["overall"]["accuracy"] == pytest.approx(
        (1.0 + report["overall"]["live"] + report["overall"]["irrelevance"]) / 3)


def test_relevance_and_decoding_rules():
    assert bfcl.decode("no block here") is None
    assert bfcl.decode("<tool_call>\nnot json\n</tool_call>") is None
    assert bfcl.decode('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>') == [{"f": {"x": 1}}]
    assert bfcl.relevance_valid(None, "irrelevance") and bfcl.relevance_valid([], "live_irrelevance")
    assert not bfcl.relevance_valid([{"f": {}}], "irrelevance")
    assert bfcl.relevance_valid([{"f": {}}], "live_relevance") and not bfcl.relevance_valid(None, "live_relevance")
    assert bfcl.standardize("U-N.I_T S'") == 'units"'
    with pytest.raises(ValueError, match="unknown BFCL category 'simple_java'"):
        make_suite("bfcl:simple_java")


# --- against BFCL's own checker ---------------------------------------------------------------

def _retype(value, rng):
    """A value of another JSON type that a lenient checker might take for it."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return rng.choice([float(value), str(value), value != 0])
    if isinstance(value, float):
        return rng.choice([int(value), str(value)])
    if isinstance(value, str):
        return rng.choice([[value], 1 if value else 0])
    if isinstance(value, list):
        return rng.choice([tuple(value), json.dumps(value), [_retype(v, rng) for v in value]])
    if isinstance(value, dict):
        return json.dumps(value)
    return "None"


def _restring(value, rng):
    """The same string in a form BFCL's normalisation may or may not forgive."""
    return rng.choice([value.upper(), value.replace(" ", "_"), f" {value}.", value + "x", value[:-1],
                       value.replace("'", '"'), ""])


def perturbations(calls, entry, rng):
    """Variants of ``calls``: each parameter dropped, retyped, restrung, an extra parameter, a
    call dropped, duplicated, renamed, the calls reversed, list values reversed."""
    out = [calls]
    for ci, call in enumerate(calls):
        (name, args), = call.items()
        for param, value in args.items():
            for change in ("drop", "retype", "restring", "reverse", "nest", "dict_key"):
                new = copy.deepcopy(calls)
                new_args = new[ci][name]
                if change == "drop":
                    del new_args[param]
                elif change == "retype":
                    new_args[param] = _retype(value, rng)
                elif change == "restring" and isinstance(value, str):
                    new_args[param] = _restring(value, rng)
                elif change == "reverse" and isinstance(value, list) and len(value) > 1:
                    new_args[param] = value[::-1]
                elif change == "nest" and isinstance(value, dict) and value:
                    key = rng.choice(sorted(value))
                    new_args[param] = {k: (_retype(v, rng) if k == key else v) for k, v in value.items()}
                elif change == "nest" and isinstance(value, list) and value and isinstance(value[0], dict):
                    new_args[param] = value[:-1]
                elif change == "dict_key" and isinstance(value, dict):
                    new_args[param] = {**value, "unexpected_key": 1}
                else:
                    continue
                out.append(new)
        extra = copy.deepcopy(calls)
        extra[ci][name]["unexpected_param"] = 1
        out.append(extra)
        renamed = copy.deepcopy(calls)
        renamed[ci] = {name + "_v2": args}
        out.append(renamed)
        doc = next((f for f in entry["function"] if f["name"] == name), None)
        if doc:  # every optional parameter of the doc given a value
            for param, spec in doc["parameters"]["properties"].items():
                if param not in args and "default" in spec:
                    fuller = copy.deepcopy(calls)
                    fuller[ci][name][param] = spec["default"]
                    out.append(fuller)
    out += [calls[::-1], calls[:-1], calls + calls[-1:]]
    return out


def error_type(reason):
    """BFCL's error type at the head of a sample's reason ("" when right)."""
    return reason.split(" (", 1)[0]


def run_bfcl(cases):
    """bfcl_checker.py's answers to ``cases`` in .venv-bfcl (GDPO_BFCL_PYTHON)."""
    python = os.environ.get("GDPO_BFCL_PYTHON")
    if not python:
        pytest.skip("set GDPO_BFCL_PYTHON to .venv-bfcl's python: scripts/test-bfcl-checker.sh")
    lines = "".join(json.dumps(c) + "\n" for c in cases)
    checker = Path(__file__).with_name("bfcl_checker.py")
    done = subprocess.run([python, str(checker)], input=lines, capture_output=True, text=True, check=False,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(v) for v in done.stdout.splitlines()]


@pytest.mark.bfcl
def test_the_matcher_gives_bfcls_own_verdicts_and_reasons(suite):
    rng = random.Random(0)
    cases = []
    for it in suite.items():
        if it.category in bfcl.IRRELEVANCE + bfcl.RELEVANCE:
            continue
        entry = it.reference
        for calls in perturbations(gold_calls(entry), entry, rng):
            cases.append({"functions": entry["function"], "calls": calls, "answer": entry["ground_truth"],
                          "category": it.category})
    theirs = run_bfcl(cases)
    assert len(theirs) == len(cases)
    # the checker's input is JSON: tuples arrive as lists, as they do from a completion
    ours = [bfcl.ast_error(c["functions"], json.loads(json.dumps(c["calls"])), c["answer"], c["category"])
            for c in cases]
    differ = [(c["calls"], o, t) for c, o, t in zip(cases, ours, theirs)
              if (not o, error_type(o)) != (t["valid"], t["error_type"])]
    assert not differ, f"{len(differ)} of {len(cases)} verdicts or reasons differ, e.g. {differ[:3]}"
    assert 0.2 < sum(t["valid"] for t in theirs) / len(theirs) < 0.8  # the perturbations pass and fail alike
    # the failures span the checker's error types (all it has for Python but dict_checker:unclear
    # and list_dict_checker:unclear, which no possible answer can reach)
    assert {t["error_type"] for t in theirs} == {
        "", "simple_function_checker:wrong_count", "simple_function_checker:wrong_func_name",
        "simple_function_checker:missing_required", "simple_function_checker:unexpected_param",
        "simple_function_checker:missing_optional", "multiple_function_checker:wrong_count",
        "parallel_function_checker_no_order:wrong_count",
        "parallel_function_checker_no_order:cannot_find_match",
        "type_error:simple", "type_error:nested", "value_error:string", "value_error:list/tuple",
        "value_error:others", "value_error:dict_key", "value_error:dict_value", "value_error:list_dict_count"}
    assert len(cases) > 20_000


# --- output forms, against bfcl-eval's own decoders ---------------------------------------------

SAME = "same"  # bfcl-eval decodes the output to the calls we read
CALL_F = [{"f": {"a": 1}}]
NAME_ARGUMENTS = '[{"name": "f", "arguments": {"a": 1}}]'

#: (model output, the calls we read: None when none decode, the bfcl-eval handler and return
#: format it is compared with (bfcl_checker.py: its decode_ast after BFCL's Qwen handler has cut
#: the reasoning off), that decoding: SAME, "error" (it does not decode) or the calls it reads)
DECODE_TABLE = [
    # Python call syntax, BFCL's prompting format: its default decoder (Qwen's and most handlers')
    ('[func(a=1, b="x"), other(c=[1, 2])]', [{"func": {"a": 1, "b": "x"}}, {"other": {"c": [1, 2]}}],
     "qwen", "python", SAME),
    ("func(a=1)", [{"func": {"a": 1}}], "qwen", "python", SAME),  # the brackets are optional
    ("<think>The area.</think>\n\n[calc.area(radius=-2.5, unit='cm', exact=True, tags=None)]",
     [{"calc.area": {"radius": -2.5, "unit": "cm", "exact": True, "tags": None}}], "qwen", "python", SAME),
    ("[f(unit=celsius, when=datetime.now(), at=g(h=1), item=xs[0], e=...)]",
     [{"f": {"unit": "celsius", "when": "datetime.now()", "at": {"g": {"h": 1}}, "item": "xs[0]",
             "e": "..."}}],
     "qwen", "python", SAME),
    ("[f(n=2*3+1, s='a' + 'b', p=2**10, q=7/2, r=-(3), m=10 % 4 // 1)]",
     [{"f": {"n": 7, "s": "ab", "p": 1024, "q": 3.5, "r": -3, "m": 2}}], "qwen", "python", SAME),
    # positional arguments are dropped, by BFCL's decoder too: the checker then finds one missing
    ("[f(1, b=2)]", [{"f": {"b": 2}}], "qwen", "python", SAME),
    ("[]", [], "qwen", "python", SAME),
    ("I cannot answer that.", None, "qwen", "python", "error"),
    ("Sure! [f(a=1)]", None, "qwen", "python", "error"),  # the whole response is the calls
    ("[1, 2]", None, "qwen", "python", "error"),
    ("[" * 5000, None, "qwen", "python", "error"),
    ("[f(x=lambda: 1)]", None, "qwen", "python", "error"),
    ("[f(x=2*y)]", None, "qwen", "python", "error"),
    # fenced: BFCL's default decoder strips backticks (a bare fence goes), its Phi handler drops a
    # ```python or ```json tag first
    ("```\nf(a=1)\n```", CALL_F, "qwen", "python", SAME),
    ("```python\n[f(x={'k': [1, 2.0]}, y=(1, 2))]\n```", [{"f": {"x": {"k": [1, 2.0]}, "y": (1, 2)}}],
     "phi", "python", SAME),
    # differs: the default decoder (Qwen's) keeps the tag and reads no call; we read the fence as
    # the Phi handler does (and as the issue asks), the tag being no part of the calls
    ("```python\n[f(a=1)]\n```", CALL_F, "qwen", "python", "error"),
    ("```py\n[f(a=1)]\n```", None, "phi", "python", "error"),  # only the json and python tags
    ("```python\n[f(a=1)]\n```\nThis calls f.", None, "phi", "python", "error"),  # nothing after it
    # differs, each a bug of BFCL's decoder or an eval we do not run: a unary operator negates
    # any operand (+5 is -5, `not True` -1); other arithmetic is eval'd (we compute + - * / // %
    # ** on numbers and + on strings, without eval); **kw becomes a parameter named None
    ("[f(n=+5)]", [{"f": {"n": 5}}], "qwen", "python", [{"f": {"n": -5}}]),
    ("[f(b=not True)]", None, "qwen", "python", [{"f": {"b": -1}}]),
    ("[f(s='a'*3)]", None, "qwen", "python", [{"f": {"s": "aaa"}}]),
    ("[f(**kw)]", None, "qwen", "python", [{"f": {"null": "kw"}}]),
    # JSON {"name", "arguments"}: BitAgent's and Salesforce's decoders (an object or a list),
    # Hammer's (a list, backticks removed)
    (NAME_ARGUMENTS[:-1] + ', {"name": "g", "arguments": {}}]', [{"f": {"a": 1}}, {"g": {}}],
     "bitagent", "python", SAME),
    ('{"name": "f", "arguments": {"a": 1, "b": [true, null]}}', [{"f": {"a": 1, "b": [True, None]}}],
     "bitagent", "python", SAME),
    (f"```\n{NAME_ARGUMENTS}\n```", CALL_F, "hammer", "python", SAME),
    # differs: Hammer removes the backticks but not the json tag, so its json.loads fails and it
    # reads no call (a bug: Phi drops the tag)
    (f"```json\n{NAME_ARGUMENTS}\n```", CALL_F, "hammer", "python", []),
    # JSON {"name", "parameters"}: Llama 3.1's decoder
    ('[{"name": "f", "parameters": {"a": 1, "b": "x"}}]', [{"f": {"a": 1, "b": "x"}}],
     "llama_3_1", "python", SAME),
    # JSON {"function", "parameters"}: BFCL's JSON return format, fenced as its prompt shows it
    ('```json\n[{"function": "f", "parameters": {"a": 1}}]\n```', CALL_F, "phi", "json", SAME),
    # differs: BFCL's JSON decoder (used by its format_sensitivity category only) looks for the
    # list inside other text; we read whole responses, as its Python decoder (every other
    # category) does
    ('Calls: [{"function": "f", "parameters": {"a": 1}}]', None, "phi", "json", CALL_F),
    # {name: {args}} is the checker's input (an FC handler's decoded result): no decoder of
    # bfcl-eval reads it from a model's text, and neither do we
    ('[{"f": {"a": 1}}]', None, "qwen", "python", "error"),
    ('[{"f": {"a": 1}}]', None, "bitagent", "python", "error"),
    # <tool_call> blocks, the suite's prompt's format: Qwen's FC decoder
    ('<think>x</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', [{"f": {"a": 1}}, {"g": {}}],
     "qwen_fc", "python", SAME),
    # differs: ToolRL's format has one call per line, several in a block, and "parameters";
    # Qwen's FC decoder reads one JSON object per block with "arguments", and skips the rest
    ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n{"name": "g", "parameters": {}}\n</tool_call>',
     [{"f": {"a": 1}}, {"g": {}}], "qwen_fc", "python", []),
]


def test_completions_decode_in_bfcls_output_forms():
    for text, calls, *_ in DECODE_TABLE:
        assert bfcl.decode(text) == calls, text


@pytest.mark.bfcl
def test_decoding_equals_bfcl_evals_own():
    theirs = run_bfcl([{"kind": "decode", "handler": h, "format": f, "text": t}
                       for t, _, h, f, _ in DECODE_TABLE])
    assert len(theirs) == len(DECODE_TABLE)
    for (text, ours, handler, _, expected), got in zip(DECODE_TABLE, theirs):
        if expected == "error":
            assert "error" in got, (text, handler, got)
        else:
            want = json.loads(json.dumps(ours)) if expected == SAME else expected
            assert got == {"calls": want}, (text, handler, got)


def test_each_sample_keeps_the_checkers_reason(suite):
    by_id = {it.id: it for it in suite.items()}

    def reasons(item_id, texts):
        scored = suite.score(by_id[item_id], [Completion(t) for t in texts])
        return [(s["accuracy"], s["reason"]) for s in scored]

    area = "calculate_triangle_area"
    assert reasons("simple_python_0", [
        f"[{area}(base=10, height=5)]",
        f'```json\n[{{"name": "{area}", "arguments": {{"base": 10, "height": 5}}}}]\n```',
        f"[{area}(base=10)]", f"[{area}(base=12, height=5)]", f"[{area}(base='10', height=5)]",
        f"[{area}(base=10, height=5, unit='meters')]", f"[{area}(base=10, height=5, color=1)]",
        "[triangle_area(base=10, height=5)]", f"[{area}(base=10, height=5), {area}(base=10, height=5)]",
        "The area is 25.", "<tool_call>\nnot json\n</tool_call>"]) == [
        (1.0, ""), (1.0, ""),
        (0.0, "simple_function_checker:missing_required (parameter 'height')"),
        (0.0, "value_error:others (parameter 'base': 12 is not allowed)"),
        (0.0, "type_error:simple (parameter 'base': str, the doc's type is integer)"),
        (0.0, "value_error:string (parameter 'unit': 'meters' is not allowed)"),
        (0.0, "simple_function_checker:unexpected_param (parameter 'color')"),
        (0.0, f"simple_function_checker:wrong_func_name (called triangle_area, not {area})"),
        (0.0, "simple_function_checker:wrong_count (2 calls, the answer has 1)"),
        (0.0, "ast_decoder:decoder_failed (neither JSON nor Python call syntax: The area is 25.)"),
        (0.0, "ast_decoder:decoder_failed (<tool_call> block does not parse: the tool call is not valid JSON: "
              "'not json')")]
    play = "spotify.play"
    swapped = f"[{play}(artist='Maroon 6', duration=15), {play}(artist='Taylor Swift', duration=20)]"
    assert reasons("parallel_0", [swapped]) == [
        (0.0, "parallel_function_checker_no_order:cannot_find_match (no call left matches the answer's "
              "call 2, spotify.play; the last tried: value_error:string (parameter 'artist': 'Maroon 6' "
              "is not allowed))")]
    irrelevance = next(it for it in suite.items() if it.category == "irrelevance")
    name = irrelevance.reference["function"][0]["name"]
    assert reasons(irrelevance.id, [f"[{name}()]", "No function fits."]) == [
        (0.0, f"irrelevance_error:decoder_success (it calls {name})"), (1.0, "")]
    relevance = next(it for it in suite.items() if it.category == "live_relevance")
    assert reasons(relevance.id, ["[]"]) == [(0.0, "relevance_error:decoder_failed (no call)")]


def test_format_ratio_is_toolrls_format_not_correctness(suite):
    """A right call scores format_ratio 1 only as ToolRL's format: <think>, then <tool_call>."""
    item = next(it for it in suite.items() if it.id == "simple_python_0")
    call = '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}'
    texts = [f"<think>Base 10, height 5.</think>\n<tool_call>\n{call}\n</tool_call>",
             f"<tool_call>\n{call}\n</tool_call>",
             "<think>Base 10, height 5.</think>\n[calculate_triangle_area(base=10, height=5)]"]
    scored = suite.score(item, [Completion(t) for t in texts])
    assert [(s["accuracy"], s["format_ratio"]) for s in scored] == [
        (1.0, 1.0), (1.0, 0.0), (1.0, 0.0)]


def hostile_calls(depth=5000):
    """Completions no parser of model output may die or hang on."""
    def nested(n):
        return '<think></think>\n<tool_call>\n{"name": "f", "parameters": {"x": ' + "[" * n + "]" * n + "}}\n</tool_call>"

    big, half = "0x" + "f" * 1_000_000, "0x" + "e" * 500_000  # 4,000,000 and 2,000,000 bits
    return [nested(depth), nested(100_000), nested(900), "[not json", "[" * depth, "[1, 2]",
            '<tool_call>\n{"name": "f", "parameters": {"x": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}}\n</tool_call>",
            "<tool_call>" * 20_000, "<think>" + "</think>\n<tool_call>\n" * 20_000,
            # issue 50: a long division of 4e6 by 2e6 bits (tens of seconds in C), a product (one
            # second), an integer no text can hold in a call taken as its text
            f"[f(x={big} // {half})]", f"[f(x={big} * {big})]", f"[f(x=g({big}))]"]


def test_hostile_calls_score_0_through_the_cli(tmp_path):
    """Issue 29, item 5: a deeply nested call stopped the whole BFCL eval (RecursionError, exit
    1); now every hostile completion is unparsable, 0, its gold sibling 1, the command exits 0,
    and 400 KB of unclosed tags are no quadratic scan."""
    from gdpo_ray.eval.report import read_report
    from gdpo_ray.run.cli import main
    from tests.hang import hang_guard

    item = make_suite("bfcl:simple_python").items()[0]
    texts = [as_completion(gold_calls(item.reference)), *hostile_calls()]
    path, out = tmp_path / "c.jsonl", tmp_path / "r.json"
    path.write_text(json.dumps({"id": item.id, "completions": texts}) + "\n")
    with hang_guard(120, "scoring hostile BFCL calls"):
        assert main(["eval", "--suite", "bfcl:simple_python", "--completions", str(path), "--output", str(out)]) == 0
    samples = read_report(out)["items"][item.id]["samples"]
    assert [s["accuracy"] for s in samples] == [1.0] + [0.0] * (len(texts) - 1)
    assert not any("error" in s for s in samples)  # unparsable, not a scorer failure
    # the report keeps each sample's reason
    failed = ["ast_decoder:decoder_failed"] * (len(texts) - 1)
    assert [error_type(s["reason"]) for s in samples] == [""] + failed
    for text in hostile_calls():
        assert bfcl.decode(text) in (None, [])
