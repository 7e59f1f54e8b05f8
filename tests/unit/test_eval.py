"""Eval suites and reports: gold answers score 1.0, perturbed ones 0, avg@n arithmetic exact."""

import json
import math

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
    lines = compare({"gdpo": [back], "grpo": [b]}).splitlines()
    assert lines[0].split() == ["run", "toy/pass@1", "toy/exceed_ratio"]
    assert lines[2].split() == ["gdpo", "1.000", "-"] and lines[3].split() == ["grpo", "0.000", "0.000"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an eval report"):
        read_report(tmp_path / "bad.json")


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
    code = make_suite("task:code")
    it = code.items()[0]
    values = code.score(it, [Completion("```python\nprint(1/0)\n```", 10, "stop")])
    assert values == [{"pass@1": 0.0, "bug_ratio": 1.0, "exceed_ratio": 0.0}]


def test_unknown_suites_name_the_known_ones():
    with pytest.raises(ValueError, match="use task:<name>"):
        make_suite("mmlu")
    with pytest.raises(ValueError, match="known: task:addition, task:arithmetic"):
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
