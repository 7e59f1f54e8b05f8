"""Eval suites and reports: gold answers score 1.0, perturbed ones 0, avg@n arithmetic exact."""

import json
import math
import os
import time

import pytest

from gdpo_ray.eval.report import build_report, compare, format_report, read_report, write_report
from gdpo_ray.run.eval_runner import read_completions, score
from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds
from gdpo_ray.eval.suites import make_suite


class TwoMetrics(Suite):
    """A suite whose completions are their own scores ("1" passes), for the report arithmetic."""

    name, metrics = "toy", ("pass@1", "exceed_ratio")

    def all_items(self):
        return [EvalItem(i, "p", "x", None) for i in "abc"]

    def score(self, item, completions):
        return [{"pass@1": float(c.text == "1"), "exceed_ratio": exceeds(c, 4)} for c in completions]


def test_avg_at_n_category_and_overall_means_are_exact():
    # item a: 3 samples (pass 1, 0, 1), b: 2 samples (0, 0), c: 1 sample (1) whose length is unknown
    scored = {
        "a": [{"pass@1": 1.0, "exceed_ratio": 0.0}, {"pass@1": 0.0, "exceed_ratio": 1.0},
              {"pass@1": 1.0, "exceed_ratio": 0.0}],
        "b": [{"pass@1": 0.0, "exceed_ratio": 1.0}, {"pass@1": 0.0, "exceed_ratio": 1.0}],
        "c": [{"pass@1": 1.0, "exceed_ratio": math.nan}],
    }
    report = build_report(TwoMetrics(), scored, {"a": "x", "b": "x", "c": "y"}, "p", {"samples": 3})
    assert report["items"]["a"]["pass@1"] == pytest.approx(2 / 3)
    assert report["items"]["a"]["exceed_ratio"] == pytest.approx(1 / 3)
    assert math.isnan(report["items"]["c"]["exceed_ratio"])
    assert report["categories"]["x"] == {"pass@1": pytest.approx(1 / 3), "exceed_ratio": pytest.approx(2 / 3),
                                         "items": 2}
    # overall: the mean over items (not samples): (2/3 + 0 + 1) / 3; exceed over the 2 known items
    assert report["overall"]["pass@1"] == pytest.approx(5 / 9)
    assert report["overall"]["exceed_ratio"] == pytest.approx((1 / 3 + 1) / 2)
    assert report["missing"] == {"pass@1": 0, "exceed_ratio": 1}
    assert report["counts"] == {"items": 3, "samples": 6, "prompt_too_long": 0}
    assert format_report(report).splitlines()[2].split() == ["overall", "0.556", "0.667", "3"]


def test_reports_round_trip_and_compare(tmp_path):
    a = build_report(TwoMetrics(), {"i": [{"pass@1": 1.0, "exceed_ratio": math.nan}]}, {"i": "c"}, "A", {})
    b = build_report(TwoMetrics(), {"i": [{"pass@1": 0.0, "exceed_ratio": 0.0}]}, {"i": "c"}, "B", {})
    write_report(a, tmp_path / "a" / "eval" / "toy.json")
    back = read_report(tmp_path / "a" / "eval" / "toy.json")
    assert back["overall"] == {"pass@1": 1.0, "exceed_ratio": None}  # NaN is written as null
    lines = compare({"gdpo": [back], "grpo": [b]}).splitlines()  # a table per suite, a row per metric
    assert lines[:4] == ["toy            gdpo   grpo",
                         "------------  -----  -----",
                         "pass@1        1.000  0.000",
                         "exceed_ratio      -  0.000"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an eval report"):
        read_report(tmp_path / "bad.json")


def test_compare_prints_each_reports_settings_and_warns_when_they_differ():
    """Issue 33: an exceed ratio at a 64-token limit no longer sits silently beside one at 4,000."""
    def report(max_tokens, engine):
        settings = {"samples": 4, "temperature": 0.6, "top_p": 0.95, "max_tokens": max_tokens,
                    "length_limit": max_tokens, "items": 1, "engine": engine}
        return build_report(TwoMetrics(), {"i": [{"pass@1": 1.0, "exceed_ratio": 0.0}]}, {"i": "c"}, "p", settings)

    lines = compare({"short": [report(64, "hf")], "long": [report(4000, "vllm")]}).splitlines()
    assert lines[5:10] == ["settings",
                           "run    suite  samples  temperature  top_p  max_tokens  length_limit  items  engine",
                           "-----  -----  -------  -----------  -----  ----------  ------------  -----  ------",
                           "short    toy        4          0.6   0.95          64            64      1      hf",
                           "long     toy        4          0.6   0.95        4000          4000      1    vllm"]
    assert lines[10:] == ["", "warning: toy max_tokens differs: 64 (short), 4000 (long)",
                          "warning: toy length_limit differs: 64 (short), 4000 (long)",
                          "The toy reports do not compare like for like: evaluate again with the same settings "
                          "(gdpo-ray eval RUN --suite toy with --samples, --max-tokens, --rewards RUN, ...)"]
    # the engine does not change the numbers; a setting a report did not record (None) is not compared
    same = compare({"a": [report(64, "hf")], "b": [report(64, "vllm")], "c": [report(None, "hf")]})
    assert "warning" not in same and same.splitlines()[-1].split() == ["c", "toy", "4", "0.6", "0.95", "-", "-", "1", "hf"]


@pytest.mark.parametrize("tokens, reason, limit, expected", [
    (10, "stop", 16, 0.0), (17, "stop", 16, 1.0), (16, "length", 16, 1.0), (15, "length", 16, 0.0),
    (None, "length", 16, 1.0), (None, "stop", 16, math.nan), (None, None, 16, math.nan)])
def test_exceeds(tokens, reason, limit, expected):
    got = exceeds(Completion("x", tokens, reason), limit)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail_or_are_bugs():
    """Every one of the 164 problems: its canonical solution as a fenced whole function and as a
    plain continuation passes; a wrong body fails without a bug; a crash, a syntax error and an
    early exit are told apart."""
    suite = make_suite("humaneval")
    items = suite.items()
    assert len(items) == 164 and items[0].id == "HumanEval/0"
    gold = {}
    for it in items:
        p = suite.problems[it.id]
        fenced = f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```\nDone."
        gold[it.id] = [Completion(fenced, 40, "stop"), Completion(p["canonical_solution"], 40, "stop")]
    scored = score(suite, items, gold, progress=False)
    assert all(s["pass@1"] == 1.0 and s["bug_ratio"] == 0.0 for ss in scored.values() for s in ss)
    p = suite.problems["HumanEval/0"]
    broken = ["```python\ndef has_close_elements(numbers, threshold):\n    return False\n```",  # wrong
              "```python\ndef has_close_elements(numbers, threshold):\n    return 1 / 0\n```",  # runtime
              "```python\ndef has_close_elements(numbers threshold):\n```",  # compile
              "```python\nimport sys\nsys.exit(0)\n```",  # SystemExit: a runtime error
              "```python\nimport os\nos._exit(0)\n```",  # exits 0 before the tests: not a pass
              "```python\nwhile True:\n    pass\n```"]  # timeout: a failure, not a bug
    assert suite.outcomes("HumanEval/0", broken) == ["wrong", "runtime", "compile", "runtime", "failed", "failed"]
    values = suite.score(items[0], [Completion(t, 10, "stop") for t in broken])
    assert [v["pass@1"] for v in values] == [0.0] * 6
    assert [v["bug_ratio"] for v in values] == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert p["entry_point"] == "has_close_elements"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_math_suite_reads_plain_and_verl_layouts(tmp_path):
    plain = write_jsonl(tmp_path / "aime.jsonl", [
        {"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}", "id": "q1"},
        {"problem": "What is 6 x 7?", "answer": "42", "id": "q2"}])
    suite = make_suite(f"math:{plain}")
    items = suite.items()
    assert suite.name == "math:aime" and [it.id for it in items] == ["q1", "q2"]
    assert items[0].prompt.startswith("What is 1/2 + 1/4?") and "\\boxed{}" in items[0].prompt
    done = {"q1": [Completion("so \\boxed{0.75}", 5, "stop"), Completion("\\boxed{3/5}", 5, "stop")],
            "q2": [Completion("\\boxed{42}", 5000, "stop")]}
    report = build_report(suite, score(suite, items, done, progress=False),
                          {it.id: it.category for it in items}, "p", {})
    assert report["items"]["q1"]["pass@1"] == 0.5  # 0.75 == 3/4 (math-verify), 3/5 is wrong
    assert report["items"]["q2"] == {**report["items"]["q2"], "pass@1": 1.0, "exceed_ratio": 1.0}
    assert report["overall"] == {"pass@1": 0.75, "exceed_ratio": 0.5}
    verl = write_jsonl(tmp_path / "verl.jsonl", [
        {"data_source": "amc", "prompt": [{"role": "user", "content": "2+2? Box it."}],
         "reward_model": {"ground_truth": "4"}}])
    (item,) = make_suite(f"math:{verl}").items()
    assert item.prompt == [{"role": "user", "content": "2+2? Box it."}] and item.category == "amc"
    assert item.reference == "4" and item.id == "0"
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"question": "q", "answer": "2"}, {"question": "q", "answer": ""}])
    with pytest.raises(ValueError, match=r"empty.jsonl, line 2 has no answer"):
        make_suite(f"math:{empty}")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=r"no question column .*'answer', 'text'.*question_column="):
        make_suite(f"math:{bad}")


def test_task_suites_score_their_gold_answers_one_and_wrong_ones_zero():
    tools = make_suite("task:tool_calls")
    items = tools.items()
    assert len(items) == 64 and items[0].category == "tool_calls"
    from gdpo_ray.tasks import task_rows

    trained = {json.dumps(r["prompt"]) for r in task_rows("task:tool_calls", 64, seed=0)}
    held_out = [it for it in items if json.dumps(it.prompt) not in trained]
    assert len(held_out) >= 32  # most eval requests were never trained on
    for it in items:
        (gold,) = tools.score(it, [Completion(it.reference)])
        assert gold == {"accuracy": 1.0, "format_ratio": 1.0}
    call = next(it for it in items if "<tool_call>" in it.reference)
    wrong_value = call.reference.replace('": "', '": "x', 1) if '": "' in call.reference else \
        call.reference.replace("}}", ", \"extra\": 1}}", 1)
    (scored,) = tools.score(call, [Completion(wrong_value)])
    assert scored == {"accuracy": 0.0, "format_ratio": 1.0}
    addition = make_suite("task:addition")
    it = addition.items()[0]
    right = f"<think>add</think><answer>{it.reference}</answer>"
    values = addition.score(it, [Completion(right, 9, "stop"), Completion("no idea", 40, "length"),
                                 Completion(f"<answer>{int(it.reference) + 1}</answer>", 20, "stop")])
    assert values == [{"pass@1": 1.0, "format_ratio": 1.0, "exceed_ratio": 0.0},
                      {"pass@1": 0.0, "format_ratio": 0.0, "exceed_ratio": 1.0},
                      {"pass@1": 0.0, "format_ratio": 0.0, "exceed_ratio": 1.0}]
    count = make_suite("task:count")
    it = next(i for i in count.items() if i.prompt == "Count from 23 to 27.")
    values = count.score(it, [Completion("<answer>23 24 25 26 27</answer>", 17, "stop"),
                              Completion("<answer>23 24 25</answer>", 11, "stop")])
    # the right count takes 17 tokens: over the study's limit of 14; the short one is wrong
    assert values == [{"pass@1": 1.0, "exceed_ratio": 1.0}, {"pass@1": 0.0, "exceed_ratio": 0.0}]
    assert len(count.items()) == 300
    code = make_suite("task:code")
    it = code.items()[0]
    values = code.score(it, [Completion("```python\nprint(1/0)\n```", 10, "stop")])
    assert values == [{"pass@1": 0.0, "bug_ratio": 1.0, "exceed_ratio": 0.0}]


def test_unknown_suites_name_the_known_ones():
    with pytest.raises(ValueError, match="use task:<name>"):
        make_suite("mmlu")
    with pytest.raises(ValueError, match="known: task:addition, task:arithmetic, task:count"):
        make_suite("task:chess")


def test_a_completions_file_is_checked_line_by_line(tmp_path):
    items = [EvalItem("a", "p", "c", None), EvalItem("b", "p", "c", None)]
    good = write_jsonl(tmp_path / "ok.jsonl", [{"id": "b", "completions": ["x", "yy"], "tokens": [1, 2]}])
    assert read_completions(good, items) == {"b": [Completion("x", 1, None), Completion("yy", 2, None)]}
    cases = [([{"id": "z", "completions": ["x"]}], "line 1: id 'z' is not an item of this suite"),
             ([{"id": "a", "completions": []}], "line 1: want"),
             ([{"id": "a", "completions": ["x"]}, {"id": "a", "completions": ["y"]}], "line 2: id 'a' appears twice"),
             ([{"id": "a", "completions": ["x"], "tokens": [1, 2]}], "tokens must be a list with one entry")]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            read_completions(write_jsonl(tmp_path / "bad.jsonl", rows), items)
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="junk.jsonl, line 1: not JSON"):
        read_completions(str(tmp_path / "junk.jsonl"), items)


def test_the_eval_command_scores_a_completions_file(tmp_path, capsys):
    from gdpo_ray.run.cli import main

    suite = make_suite("task:addition")
    rows = [{"id": it.id, "completions": [f"<think>x</think><answer>{it.reference}</answer>", "?"],
             "tokens": [6, 50]} for it in suite.items()[:10]]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "r.json"
    assert main(["eval", "--suite", "task:addition", "--completions", path, "--output", str(out)]) == 0
    report = read_report(out)
    assert report["overall"] == {"pass@1": 0.5, "format_ratio": 0.5, "exceed_ratio": 0.5}
    assert report["settings"]["items_missing"] == 90 and report["counts"] == {"items": 10, "samples": 20, "prompt_too_long": 0}
    # the file's samples per item; its sampling is not known (not the defaults of --temperature, ...)
    assert report["settings"] | {"samples": 2, "temperature": None, "top_p": None, "max_tokens": None,
                                 "length_limit": 16} == report["settings"]
    assert "overall" in capsys.readouterr().out
    limited = tmp_path / "l.json"  # a file of 10 items, the first 4 scored
    assert main(["eval", "--suite", "task:addition", "--completions", path, "--limit", "4",
                 "--output", str(limited)]) == 0
    assert read_report(limited)["counts"]["items"] == 4
    assert main(["eval", "--compare", str(out), str(out)]) == 0
    assert main(["eval", "--suite", "task:addition"]) == 2
    assert "give POLICY (to generate) or --completions FILE" in capsys.readouterr().err
    assert main(["eval", "no/such/dir", "--suite", "task:addition"]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_a_suite_holds_out_training_prompts():
    suite = make_suite("task:addition")
    trained = [f"What is 1 + {b}?" for b in range(10)]
    assert suite.hold_out(trained) == 10
    assert len(suite.items()) == 90 and not {it.prompt for it in suite.items()} & set(trained)
    everything = [it.prompt for it in make_suite("task:addition").items()]
    fresh = make_suite("task:addition")
    assert fresh.hold_out(everything) == 0 and len(fresh.items()) == 100  # nothing would be left
    tools = make_suite("task:tool_calls")  # chat prompts compare as messages
    first = tools.items()[0]
    assert tools.hold_out([first.prompt]) == 1 and first.id not in {it.id for it in tools.items()}


def test_a_runs_eval_suite_leaves_out_its_training_prompts(tmp_path):
    from gdpo_ray.eval.suites import held_out_suite
    from gdpo_ray.tasks import task_rows

    trained = task_rows("task:addition", 50, seed=3)
    suite = held_out_suite("task:addition", trained)
    assert len(suite.items()) == 50
    assert not {it.prompt for it in suite.items()} & {r["prompt"] for r in trained}
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "What is 1 + 2?"}])  # a dataset file
    assert len(held_out_suite("task:addition", str(path)).items()) == 99
    # training.eval_length_limit reaches the suite; None leaves the suite's own (16 tokens)
    assert held_out_suite("task:addition", trained, length_limit=12).length_limit == 12
    assert held_out_suite("task:addition", trained, length_limit=None).length_limit == 16


# --- hostile completions (issue 29, items 3 and 5) ------------------------------------------

#: HumanEval forgeries that pass without solving anything where the candidate runs in the
#: harness's process; ENTRY is the problem's entry point
FORGERIES = {
    # read the nonce (the harness's global; else the parent's memory or stdin) and print the
    # pass line on every stdout it can reach, then leave before the tests run
    "nonce": '''
import gc, os, re, sys
found = []
main = sys.modules.get("__main__")
if isinstance(getattr(main, "nonce", None), str):
    found.append(main.nonce)
parent = os.getppid()
try:
    mem = open(f"/proc/{parent}/mem", "rb")
    for line in open(f"/proc/{parent}/maps"):
        span, perms = line.split()[:2]
        if perms.startswith("rw"):
            lo, hi = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(lo)
                found += [m.decode() for m in re.findall(rb"([0-9a-f]{32})\\n", mem.read(min(hi - lo, 1 << 26)))]
            except (OSError, ValueError, OverflowError):
                pass
except OSError:
    pass
outs = [sys.stdout]
try:
    outs.append(open(f"/proc/{parent}/fd/1", "w"))
except OSError:
    pass
for out in outs:
    for nonce in reversed(found):
        out.write("\\n" + nonce + ":pass\\n")
    out.flush()
os._exit(0)
''',
    # make the harness's exec of the tests define a check that checks nothing
    "exec": '''
import builtins
_exec = builtins.exec
def _fake(code, namespace=None, *rest):
    _exec(code, namespace, *rest)
    if isinstance(namespace, dict) and "check" in namespace:
        namespace["check"] = lambda candidate: None
builtins.exec = _fake
''',
    # return an object equal (and close, and ordered) to everything
    "equal": '''
class Everything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __eq__
    def __bool__(self): return True
    def __hash__(self): return 0
    def __abs__(self): return 0
    def __float__(self): return 0.0
    def __int__(self): return 0
    __index__ = __int__
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def _self(self, *args): return self
    __sub__ = __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _self
    __neg__ = __round__ = __getitem__ = __mod__ = __pow__ = _self
def ENTRY(*args, **kwargs):
    return Everything()
''',
    # a builtin type's subclass that is equal to everything
    "equal_list": '''
class Everything(list):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
def ENTRY(*args, **kwargs):
    return Everything()
''',
    # read the tests (the harness's test.py, else the parent's stdin) and answer from them
    "tests": '''
import ast, os
source = ""
for path in ("test.py", f"/proc/{os.getppid()}/fd/0"):
    try:
        source = open(path).read()
        break
    except OSError:
        pass
table = {}
for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        call = node.left
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "candidate":
            try:
                table[repr(ast.literal_eval(ast.Tuple(call.args, ast.Load())))] = ast.literal_eval(node.comparators[0])
            except ValueError:
                pass
def ENTRY(*args):
    return table.get(repr(args))
'''}

#: a spread of HumanEval problems, with the ones whose tests use the prompt's helpers (32, 38,
#: 50) or call the entry point by name (33)
FORGED_PROBLEMS = [f"HumanEval/{i}" for i in sorted({*range(0, 164, 12), 32, 33, 38, 50, 53})]


def test_humaneval_forgeries_score_0_through_the_cli(tmp_path):
    """Each forgery of issue 29 (item 3) scores 0 on every problem: the candidate runs in a
    child process that sees neither the nonce, the tests nor the harness's builtins, and only
    values cross. (Where the candidate ran in the harness's process, the forgeries passed:
    1.000, 1.000, 0.957 and 0.878 over the 164 problems.)"""
    from gdpo_ray.run.cli import main

    suite = make_suite("humaneval")
    rows = []
    for task_id in FORGED_PROBLEMS:
        entry = suite.problems[task_id]["entry_point"]
        rows.append({"id": task_id, "completions": [
            "```python\n" + code.replace("ENTRY", entry) + "```" for code in FORGERIES.values()]})
    path, out = write_jsonl(tmp_path / "forged.jsonl", rows), tmp_path / "r.json"
    assert main(["eval", "--suite", "humaneval", "--completions", path, "--output", str(out)]) == 0
    report = read_report(out)
    passed = {name: [it["samples"][k]["pass@1"] for it in report["items"].values()]
              for k, name in enumerate(FORGERIES)}
    assert passed == {name: [0.0] * len(FORGED_PROBLEMS) for name in FORGERIES}
    assert report["overall"]["pass@1"] == 0.0 and report["counts"]["items"] == len(FORGED_PROBLEMS)


class Hostile(Suite):
    """Scores "1" as a pass; raises on "raise", loops forever on "hang" (a scorer's bug, not the
    completion's merit), computes in C holding the GIL for hours on "spin" (what a thread or a
    signal cannot stop), ends its process on "exit"."""

    name, metrics, length_limit = "hostile", ("pass@1", "exceed_ratio"), 4

    def all_items(self):
        return [EvalItem(i, "p", "x", None) for i in "abc"]

    def score(self, item, completions):
        for c in completions:
            if c.text == "raise":
                raise ZeroDivisionError("division by zero")
            while c.text == "hang":
                pass
            if c.text == "spin":
                sum(range(10 ** 12))
            if c.text == "exit":
                os._exit(3)
        return [{"pass@1": float(c.text == "1"), "exceed_ratio": exceeds(c, self.length_limit)}
                for c in completions]


def test_a_scorer_that_raises_or_hangs_costs_only_that_sample(tmp_path, monkeypatch):
    """Issue 29, item 5: any exception or hang while scoring is that sample's 0 (exceed_ratio
    still from its length) with the reason in the report; its siblings keep their scores."""
    from gdpo_ray.eval.suites import SUITES
    from gdpo_ray.run import eval_runner
    from gdpo_ray.run.cli import main

    monkeypatch.setattr(SUITES, "_entries", dict(SUITES._entries))
    SUITES.register("hostile")(lambda argument, **options: Hostile())
    monkeypatch.setattr(eval_runner, "SAMPLE_TIMEOUT_S", 1.0)
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "completions": ["1", "raise", "0"], "tokens": [1, 9, 1]},
                                              {"id": "b", "completions": ["hang", "1"], "tokens": [1, 1]}])
    out = tmp_path / "r.json"
    assert main(["eval", "--suite", "hostile", "--completions", path, "--output", str(out)]) == 0
    report = read_report(out)
    a, b = report["items"]["a"]["samples"], report["items"]["b"]["samples"]
    assert [s["pass@1"] for s in a] == [1.0, 0.0, 0.0] and [s["exceed_ratio"] for s in a] == [0.0, 1.0, 0.0]
    assert [s["pass@1"] for s in b] == [0.0, 1.0]
    assert a[1]["error"] == "ZeroDivisionError: division by zero" and "error" not in a[0]
    assert b[0]["error"] == "timeout: scoring took over 1 s"
    assert report["errors"] == [{"item": "a", "sample": 1, "error": a[1]["error"]},
                                {"item": "b", "sample": 0, "error": b[0]["error"]}]
    assert report["overall"]["pass@1"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert format_report(report).splitlines()[-1] == (
        "2 sample(s) scored 0 because scoring them failed (the report's errors), e.g. a sample 1: "
        "ZeroDivisionError: division by zero")


def test_a_scorer_stuck_in_c_or_ending_its_process_costs_only_that_sample(monkeypatch):
    """Issue 50: C code holding the GIL (``sum`` over a range of 10**12: hours) defeats a signal;
    the scoring process running it is killed at the sample's limit and replaced, one that ends
    (``os._exit``) is that sample's failure, and every other sample scores."""
    from gdpo_ray.run import eval_runner
    from tests.hang import hang_guard

    monkeypatch.setattr(eval_runner, "SAMPLE_TIMEOUT_S", 1.0)
    suite = Hostile()
    done = {"a": [Completion("spin", 1)], "b": [Completion("1", 1), Completion("spin", 9), Completion("0", 1)],
            "c": [Completion("exit", 1), Completion("1", 1)]}
    start = time.monotonic()
    with hang_guard(120, "scoring samples stuck in C"):
        scored = score(suite, suite.items(), done, score_threads=2, progress=False)
    # a: its one sample killed at 1 s, not scored again; b: killed whole at 3 s, then one by one
    # (its spin killed at 1 s); c: the process ended, then one by one
    assert [(s["pass@1"], s.get("error")) for s in scored["a"]] == [(0.0, "timeout: scoring took over 1 s")]
    assert [(s["pass@1"], s.get("error")) for s in scored["b"]] == [
        (1.0, None), (0.0, "timeout: scoring took over 1 s"), (0.0, None)]
    assert scored["b"][1]["exceed_ratio"] == 1.0  # from its length, though not scored
    assert [(s["pass@1"], s.get("error")) for s in scored["c"]] == [
        (0.0, "the scoring process ended (exit code 3)"), (1.0, None)]
    print(f"scored in {time.monotonic() - start:.1f} s")  # 1 + 3 + 1 s of limits, on 2 workers


def test_a_suite_that_cannot_be_pickled_is_scored_here_with_a_warning(caplog):
    """Issue 50: a suite the scoring processes cannot receive (it holds a lock) is scored in the
    eval's process, as before, and the warning says why."""
    import threading

    suite = TwoMetrics()
    suite.lock = threading.Lock()
    done = {"a": [Completion("1", 1), Completion("0", 9)]}
    with caplog.at_level("WARNING"):
        scored = score(suite, suite.items(), done, progress=False)
    assert [(s["pass@1"], s["exceed_ratio"]) for s in scored["a"]] == [(1.0, 0.0), (0.0, 1.0)]
    assert "suite toy cannot be sent to a scoring process (TypeError: cannot pickle '_thread.lock'" in caplog.text


ORPHAN = """
import operator, sys, threading, time
from gdpo_ray.eval.time_limit import ScoringPool
pool = ScoringPool(operator.call, sum, 1)
pool.submit(0, (range(10 ** 12),), 600)  # sum(range(10**12)): hours in C, holding the GIL
threading.Thread(target=lambda: list(pool.results()), daemon=True).start()
while not pool._busy or not pool._busy[0].ready:
    time.sleep(0.02)
print(pool._busy[0].process.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_stuck_in_c_dies_with_an_eval_that_is_killed():
    """Issue 50: an eval killed (SIGKILL: none of its code runs) while its scoring worker computes
    in C leaves no worker behind: the pool's reaper kills it."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    def state(pid):  # R running, Z dead but not yet reaped by init, None gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None

    owner = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(owner.stdout.readline())
        time.sleep(0.5)
        assert state(worker) == "R"  # computing
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while state(worker) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state(worker) in (None, "Z")
    finally:
        owner.kill()


def test_the_math_eval_scans_210_kb_of_unclosed_boxes_at_once(tmp_path):
    """Issue 29, item 5: 210 KB of unclosed \\boxed{ (and of unclosed <answer>) took a
    quadratic scan (minutes); now linear, scored 0."""
    from gdpo_ray.run.cli import main
    from tests.hang import hang_guard

    data = write_jsonl(tmp_path / "q.jsonl", [{"problem": "6 x 7?", "answer": "42", "id": "q"}])
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "q", "completions": ["\\boxed{" * 30_000, "\\boxed{42}"]}])
    out = tmp_path / "r.json"
    with hang_guard(120, "scoring 210 KB of unclosed boxes"):
        assert main(["eval", "--suite", f"math:{data}", "--completions", path, "--output", str(out)]) == 0
    assert [s["pass@1"] for s in read_report(out)["items"]["q"]["samples"]] == [0.0, 1.0]
    addition = make_suite("task:addition")
    it = addition.items()[0]
    with hang_guard(60, "scoring 208 KB of unclosed answer tags"):
        (hostile, gold) = addition.score(it, [Completion("<answer>" * 26_000),
                                              Completion(f"<answer>{it.reference}</answer>")])
    assert hostile["pass@1"] == 0.0 and gold["pass@1"] == 1.0


def test_completions_files_take_unknown_lengths_and_name_bad_entries(tmp_path, capsys):
    """Issue 29, item 5: ``tokens: null`` (or a null entry) is an unknown length; a bad entry is
    refused with its line and position."""
    from gdpo_ray.run.cli import main

    items = [EvalItem("a", "p", "c", None), EvalItem("b", "p", "c", None)]
    rows = [{"id": "a", "completions": ["x", "y"], "tokens": None, "finish_reasons": None},
            {"id": "b", "completions": ["x", "y"], "tokens": [None, 3], "finish_reasons": ["length", None]}]
    assert read_completions(write_jsonl(tmp_path / "ok.jsonl", rows), items) == {
        "a": [Completion("x"), Completion("y")], "b": [Completion("x", None, "length"), Completion("y", 3)]}
    cases = [({"id": "a", "completions": ["x"], "tokens": ["3"]}, r"line 1: tokens\[0\] must be"),
             ({"id": "a", "completions": ["x"], "tokens": [-1]}, r"line 1: tokens\[0\] must be"),
             ({"id": "a", "completions": ["x"], "tokens": [True]}, r"line 1: tokens\[0\] must be"),
             ({"id": "a", "completions": ["x"], "finish_reasons": [5]}, r"line 1: finish_reasons\[0\] must be")]
    for row, message in cases:
        with pytest.raises(ValueError, match=message):
            read_completions(write_jsonl(tmp_path / "bad.jsonl", [row]), items)
    suite = make_suite("task:addition")
    it = suite.items()[0]
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": it.id, "completions": ["?"], "tokens": [None]}])
    assert main(["eval", "--suite", "task:addition", "--completions", path, "--output", str(tmp_path / "r.json")]) == 0
    assert read_report(tmp_path / "r.json")["items"][it.id]["samples"][0]["tokens"] is None
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": it.id, "completions": ["?"]},
                                               {"id": suite.items()[1].id, "completions": ["?"], "tokens": [{}]}])
    assert main(["eval", "--suite", "task:addition", "--completions", bad]) == 2
    assert "bad.jsonl, line 2: tokens[0] must be" in capsys.readouterr().err


def test_a_lone_surrogate_costs_only_its_own_sample(tmp_path):
    """Issue 29, item 5: a program with a lone surrogate cannot be a UTF-8 source file, so it
    does not compile (a bug); its siblings are scored as usual (they were NaN: the sandbox call
    of the whole item failed)."""
    from gdpo_ray.run.cli import main

    suite = make_suite("humaneval")
    p = suite.problems["HumanEval/0"]
    rows = [{"id": "HumanEval/0", "completions": [p["canonical_solution"], "    return '\ud800'\n"]}]
    out = tmp_path / "r.json"
    assert main(["eval", "--suite", "humaneval", "--completions", write_jsonl(tmp_path / "c.jsonl", rows),
                 "--output", str(out)]) == 0
    samples = read_report(out)["items"]["HumanEval/0"]["samples"]
    assert [(s["pass@1"], s["bug_ratio"]) for s in samples] == [(1.0, 0.0), (0.0, 1.0)]
    code = make_suite("task:code")
    it = code.items()[0]
    values = code.score(it, [Completion("```python\nprint(1/0)\n```"), Completion("```python\nprint('\ud800')\n```")])
    assert [(v["pass@1"], v["bug_ratio"]) for v in values] == [(0.0, 1.0), (0.0, 1.0)]


def _typed(value):
    """A value with the type of every part written out (so equal means equal types too)."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_typed(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return type(value).__name__, sorted(map(repr, value))
    if isinstance(value, dict):
        return "dict", sorted((repr(_typed(k)), _typed(v)) for k, v in value.items())
    return type(value).__name__, repr(value)


def test_humaneval_values_cross_by_value_with_their_types():
    """What the tests pass and the candidates return crosses the process boundary as JSON with
    its builtin types; a subclass crosses as its base type's value; any other object as an
    Opaque stand-in equal only to itself (so an object equal to everything equals nothing)."""
    import collections
    import enum

    from gdpo_ray.eval.humaneval import Opaque, decode, encode

    def cross(value):
        return decode(json.loads(json.dumps(encode(value))))

    values = [None, True, 0, -7, 10 ** 400, 1.5, -0.0, float("inf"), "s\u00e9\ud800", [1, [2.0, "x"]],
              (1, (2,), ()), {1, 2}, frozenset({"a"}), {"a": 1, (1, 2): [3], 4: None, 2.5: (1,)}, b"\x00\xff", 3 + 4j]
    for value in values:
        assert _typed(cross(value)) == _typed(value)
    assert math.isnan(cross(float("nan")))
    Point = collections.namedtuple("Point", "x y")
    Level = enum.IntEnum("Level", "LOW HIGH")

    class Liar(str):
        def __eq__(self, other):
            return True

    assert _typed(cross([collections.Counter("aab"), Point(1, 2), Level.HIGH, Liar("x")])) == \
        _typed([{"a": 2, "b": 1}, (1, 2), 2, "x"])
    assert cross(Liar("x")) != "y"

    class Everything:
        def __eq__(self, other):
            return True

    back = cross([Everything(), iter([])])
    assert all(isinstance(v, Opaque) for v in back) and back[0] != back[1] and back[0] == back[0]
    assert repr(back[0]) == "<Everything object>" and back[0] != 0 and not (back[0] == [])
    deep = []
    for _ in range(5000):
        deep = [deep]
    json.dumps(encode(deep))  # nested past the recursion limit: an opaque part, no error
    for data in ({"tuple": 5}, {"x": 1}, {"tuple": [], "set": []}, {"set": [[1]]}, {"dict": [[[1], 2]]}, {"dict": [1]}):
        with pytest.raises(ValueError):
            decode(data)


def test_humaneval_candidate_process_reaches_nothing_of_the_harness():
    """The candidate's process cannot read the harness's memory, maps, stdin or environment,
    write its stdout, or read the tests (no file holds them), and holds no descriptor but
    /dev/null and its two pipes: each probe returns "denied", which the problem's check wants."""
    suite = make_suite("humaneval")
    reach = {
        "memory": "open(f'/proc/{os.getppid()}/mem', 'rb').read(1)",
        "maps": "open(f'/proc/{os.getppid()}/maps').read(1)",
        "stdin": "open(f'/proc/{os.getppid()}/fd/0').read(1)",
        "stdout": "open(f'/proc/{os.getppid()}/fd/1', 'w').write('x')",
        "descriptors": "os.listdir(f'/proc/{os.getppid()}/fd')",
        "environment": "open(f'/proc/{os.getppid()}/environ').read(1)",
        "tests": "open('test.py').read(1)",
        "own stdin": "assert sys.stdin.read() != ''",
        "own descriptors": "assert sum(link != '/dev/null' for link in links()) > 2",  # more than its pipes
    }
    controls = {  # the same probes where they reach: what /proc shows anyone, more than 2 links
        "parent's status": "open(f'/proc/{os.getppid()}/status').read(1)",
        "own pipes": "assert sum(link != '/dev/null' for link in links()) > 1",
    }
    suite.problems["Probe/0"] = {"prompt": "import os, sys\n", "entry_point": "probe",
                                 "test": "def check(candidate):\n    assert candidate() == 'denied'\n"}
    helper = ("def links():\n    out = []\n    for fd in os.listdir('/proc/self/fd'):\n        try:\n"
              "            out.append(os.readlink('/proc/self/fd/' + fd))\n        except OSError:\n"
              "            pass\n    return out\n")
    programs = [helper + f"def probe():\n    try:\n        {probe}\n    except BaseException:\n        return 'denied'\n"
                "    return 'reached'\n" for probe in [*reach.values(), *controls.values()]]
    outcomes = dict(zip([*reach, *controls], suite.outcomes("Probe/0", programs)))
    assert outcomes == {**{name: "pass" for name in reach}, **{name: "wrong" for name in controls}}


def test_eval_takes_every_model_name_a_run_takes(tmp_path, monkeypatch):
    """``gdpo-ray eval smollm2`` was refused although ``llm.model_path: smollm2`` trains: eval
    now resolves the same built-in names, and a wrong one is told them."""
    from gdpo_ray import model_files
    from gdpo_ray.run import eval_runner

    resolved = []
    monkeypatch.setattr(model_files, "resolve_model_path", lambda spec: resolved.append(spec) or tmp_path)
    eval_runner.resolve_policy.cache_clear()
    try:
        for name in model_files.BUILT_IN_MODELS:
            assert eval_runner.resolve_policy(name) == str(tmp_path)
        assert resolved == ["demo", "demo-tools", "demo-count", "demo-agent", "tiny", "smollm2"]
        with pytest.raises(ValueError, match="demo \\| demo-tools \\| demo-count \\| demo-agent \\| tiny \\| smollm2"):
            eval_runner.resolve_policy(str(tmp_path / "nowhere"))
    finally:
        eval_runner.resolve_policy.cache_clear()
