"""BFCL: gold answers in our tool-call format score 1.0; the matcher gives BFCL's own verdict
on every possible answer and on perturbations of each (the latter against bfcl-eval's
ast_checker in .venv-bfcl: scripts/test-bfcl-checker.sh)."""

import copy
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

bfcl = pytest.importorskip("gdpo_ray.eval.bfcl")
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
            for change in ("drop", "retype", "restring", "reverse", "nest"):
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


@pytest.mark.bfcl
def test_the_matcher_gives_bfcls_own_verdicts(suite):
    python = os.environ.get("GDPO_BFCL_PYTHON")
    if not python:
        pytest.skip("set GDPO_BFCL_PYTHON to .venv-bfcl's python: scripts/test-bfcl-checker.sh")
    rng = random.Random(0)
    cases = []
    for it in suite.items():
        if it.category in bfcl.IRRELEVANCE + bfcl.RELEVANCE:
            continue
        entry = it.reference
        for calls in perturbations(gold_calls(entry), entry, rng):
            cases.append({"functions": entry["function"], "calls": calls, "answer": entry["ground_truth"],
                          "category": it.category, "id": it.id})
    lines = "".join(json.dumps({k: c[k] for k in ("functions", "calls", "answer", "category")}) + "\n"
                    for c in cases)
    checker = Path(__file__).with_name("bfcl_checker.py")
    done = subprocess.run([python, str(checker)], input=lines, capture_output=True, text=True, check=False,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = [json.loads(v) for v in done.stdout.splitlines()]
    assert len(theirs) == len(cases)
    # the checker's input is JSON: tuples arrive as lists, as they do from a completion
    ours = [bfcl.ast_valid(c["functions"], json.loads(json.dumps(c["calls"])), c["answer"], c["category"])
            for c in cases]
    differ = [(c["id"], c["calls"], t) for c, o, t in zip(cases, ours, theirs) if o != t]
    assert not differ, f"{len(differ)} of {len(cases)} verdicts differ, e.g. {differ[:3]}"
    assert 0.2 < sum(theirs) / len(theirs) < 0.8  # the perturbations pass and fail alike
    assert len(cases) > 20_000


def hostile_calls(depth=5000):
    """Completions no parser of model output may die or hang on."""
    def nested(n):
        return '<think></think>\n<tool_call>\n{"name": "f", "parameters": {"x": ' + "[" * n + "]" * n + "}}\n</tool_call>"

    return [nested(depth), nested(100_000), nested(900), "[not json", "[" * depth, "[1, 2]",
            '<tool_call>\n{"name": "f", "parameters": {"x": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}}\n</tool_call>",
            "<tool_call>" * 20_000, "<think>" + "</think>\n<tool_call>\n" * 20_000]


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
    for text in hostile_calls():
        assert bfcl.decode(text) in (None, [])
