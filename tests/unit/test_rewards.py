"""Exact values of the built-in rewards, the registry, adapters and conditioned rewards."""

import json
import math
import re

import numpy as np
import pytest

from gdpo_ray import rewards
from gdpo_ray.rewards import RewardSpec, apply_conditions, check_specs, from_verl
from gdpo_ray.rewards.code import _plain, extract_program, has_error
from gdpo_ray.rewards.math_answer import final_answer, last_boxed
from gdpo_ray.rewards.sandbox import RunResult
from gdpo_ray.rewards.toolrl import correctness, format_matches, same_value


def call(name, **params):
    return json.dumps({"name": name, "parameters": params})


def tool_output(*calls, think="ok"):
    return f"<think>{think}</think>\n<tool_call>\n" + "\n".join(calls) + "\n</tool_call>"


# ------------------------------------------------------------------------------------------
# toolrl_format


@pytest.mark.parametrize(
    "completion, gold, default, strict",
    [
        (tool_output(call("f", a=1)), tool_output(call("f", a=1)), True, True),
        ("<think>x</think>\n<response>hi</response>", "<think>g</think>\n<response>yo</response>", True, True),
        (tool_output(call("f")) + "\n<response>done</response>",
         tool_output(call("f")) + "\n<response>r</response>", True, True),
        # gold with neither part: the think block alone
        ("<think>x</think>", "<think>g</think>", True, True),
        # response missing although the gold answer has one
        (tool_output(call("f")), tool_output(call("f")) + "\n<response>r</response>", False, False),
        # something after the last part
        (tool_output(call("f")) + " trailing", tool_output(call("f")), False, False),
        # a trailing newline / a leading space: ToolRL strips the output first
        (tool_output(call("f")) + "\n", tool_output(call("f")), True, False),
        (" " + tool_output(call("f")), tool_output(call("f")), True, False),
        # a literal <think> inside the think text: ToolRL does not count think tags
        (tool_output(call("f"), think="I write <think> here"), tool_output(call("f")), True, False),
        # a second think block: `.*?` spans "a</think><think>b", think tags are not counted
        ("<think>a</think><think>b</think>\n<tool_call>\n{}\n</tool_call>", tool_output(call("f")),
         True, False),
        # a tag of another case is not counted by ToolRL (response-only gold, a <tool_call> inside)
        ("<think>a</think>\n<response>see <tool_call></response>",
         "<think>g</think>\n<response>r</response>", True, False),
        # the required tags twice: counted, fails both ways
        ("<think>a</think>\n<response>x</response><response>y</response>",
         "<think>g</think>\n<response>r</response>", False, False),
        # a response although the gold answer is tool calls only
        (tool_output(call("f")) + "\n<response>x</response>", tool_output(call("f")), False, False),
        # no newline between think and tool_call
        ("<think>a</think><tool_call>\n{}\n</tool_call>", tool_output(call("f")), False, False),
        # parts out of order
        ("<think>a</think>\n<response>r</response>\n<tool_call>\n{}\n</tool_call>",
         tool_output(call("f")) + "\n<response>r</response>", False, False),
    ],
)
def test_toolrl_format(completion, gold, default, strict):
    assert format_matches(completion, gold) is default
    assert format_matches(completion, gold, strict=True) is strict
    for fn, expected in ((rewards.get("toolrl_format"), default),
                         (rewards.get("toolrl_format", strict=True), strict)):
        assert fn(["p"], [completion], ground_truth=[gold]) == [float(expected)]


# ------------------------------------------------------------------------------------------
# toolrl_correctness: R = 6 R_max / S_max - 3, S_max = 1 + |G| + sum |keys(G_j)|


def test_identical_calls_score_3():
    gold = tool_output(call("search", q="ai", n=5), call("weather", city="Paris"))
    assert correctness(gold, gold) == 3.0  # S_max = 1 + 2 + 3 = 6 = R_max


def test_greedy_and_optimal_matching_differ():
    # gold: f(a=1), f(a=1, b=2); predicted: f(a=1, b=2), f(a=9). S_max = 1 + 2 + (1 + 2) = 6.
    gold = tool_output(call("f", a=1), call("f", a=1, b=2))
    pred = tool_output(call("f", a=1, b=2), call("f", a=9))
    # greedy: gold 1 takes pred 1 (keys 1/2 + a equal 1 = 1.5 > 1.0 for pred 2); gold 2 gets
    # pred 2 (keys 1/2 + 0 = 0.5). R_max = names 1 + 2.0 = 3 -> 6 * 3 / 6 - 3 = 0
    assert correctness(pred, gold, "greedy") == pytest.approx(0.0, abs=1e-12)
    # optimal: gold 1 - pred 2 (1 + 0) and gold 2 - pred 1 (1 + 2): R_max = 1 + 4 = 5 -> 2
    assert correctness(pred, gold, "optimal") == pytest.approx(2.0, abs=1e-12)


def test_greedy_never_takes_a_score_0_prediction():
    # gold f(a=1), f(b=2); predicted f(b=2). S_max = 1 + 2 + (1 + 1) = 5; names {f, f} vs {f}: 1/2
    gold = tool_output(call("f", a=1), call("f", b=2))
    pred = tool_output(call("f", b=2))
    # greedy: gold 1 vs pred 1 scores 0 (keys 0/2, no value), so it stays unused; gold 2 takes it:
    # 1 (keys 1/1) + 1 (b equal) = 2. R_max = 0.5 + 2 = 2.5 -> 6 * 2.5 / 5 - 3 = 0.0
    # (taking it for gold 1 would give R_max = 0.5 -> 6 * 0.5 / 5 - 3 = -2.4)
    assert correctness(pred, gold, "greedy") == pytest.approx(0.0, abs=1e-12)
    assert correctness(pred, gold, "optimal") == pytest.approx(0.0, abs=1e-12)


def test_greedy_ties_go_to_the_first_prediction():
    # gold f(a=1), f(a=1, b=2); predicted f(a=1, b=2), f(a=1, b=5). S_max = 1 + 2 + (1 + 2) = 6
    gold = tool_output(call("f", a=1), call("f", a=1, b=2))
    pred = tool_output(call("f", a=1, b=2), call("f", a=1, b=5))
    # gold 1 ties: pred 1 = keys 1/2 + a 1 = 1.5, pred 2 = 1/2 + 1 = 1.5 -> takes pred 1 (first);
    # gold 2 gets pred 2: keys 2/2 + a 1 + b 0 = 2. R_max = names 1 + 3.5 = 4.5 -> 6 * 4.5 / 6 - 3 = 1.5
    assert correctness(pred, gold, "greedy") == pytest.approx(1.5)
    # optimal: gold 1 - pred 2 (1.5), gold 2 - pred 1 (1 + 2 = 3): R_max = 1 + 4.5 = 5.5 -> 2.5
    assert correctness(pred, gold, "optimal") == pytest.approx(2.5)


def test_tool_names_compare_as_multisets():
    # gold f(), f(); predicted f(). S_max = 1 + 2 + 0 = 3. Names as multisets: 1/2 (as sets: 1)
    # pair f-f: keys of two empty sets 1 + no values = 1. R_max = 0.5 + 1 = 1.5 -> 6 * 1.5 / 3 - 3 = 0
    gold = tool_output(call("f"), call("f"))
    assert correctness(tool_output(call("f")), gold) == pytest.approx(0.0, abs=1e-12)


def test_greedy_vs_optimal_three_calls():
    # gold: g(x=1, y=2), g(x=1), g(y=2); predicted: g(x=1), g(x=1, y=2), g(y=3)
    gold = tool_output(call("g", x=1, y=2), call("g", x=1), call("g", y=2))
    pred = tool_output(call("g", x=1), call("g", x=1, y=2), call("g", y=3))
    # S_max = 1 + 3 + (2 + 1 + 1) = 8; names: 3 of 3 -> 1
    # greedy: G1 best is P2 (1 + 2 = 3); G2 takes P1 (1 + 1 = 2); G3 gets P3 (1 + 0 = 1): 6
    # optimal: the same 6 (no better assignment exists) -> R = 6 * 7 / 8 - 3 = 2.25
    assert correctness(pred, gold, "greedy") == pytest.approx(2.25)
    assert correctness(pred, gold, "optimal") == pytest.approx(2.25)


def test_type_sensitive_values():
    assert not same_value("5", 5) and not same_value(True, 1) and same_value(1, 1.0)
    assert same_value([1, {"a": 2.0}], [1.0, {"a": 2}]) and not same_value([1], [1, 1])
    gold = tool_output(call("f", n=5, flag=True))
    # keys 2/2 = 1, values: "5" != 5, 1 != true -> R_max = 1 + 1 + 0 = 2; S_max = 1 + 1 + 2 = 4
    assert correctness(tool_output(call("f", n="5", flag=1)), gold) == pytest.approx(0.0)
    # 5.0 == 5 and true == true -> 3
    assert correctness(tool_output(call("f", n=5.0, flag=True)), gold) == 3.0


def test_calls_without_parameters_and_arguments_key():
    gold = tool_output(call("ping"))
    # parameter-name Jaccard of two empty sets is 1: R_max = 1 + 1 = 2 = S_max -> 3
    assert correctness(tool_output(json.dumps({"name": "ping", "arguments": {}})), gold) == 3.0
    assert correctness(tool_output(json.dumps({"name": "ping"})), gold) == 3.0


def test_malformed_json_is_minus_3():
    gold = tool_output(call("f", a=1))
    assert correctness(tool_output('{"name": "f", "parameters": {"a": 1}'), gold) == -3.0
    assert correctness(tool_output('["f"]'), gold) == -3.0


def test_extra_and_missing_calls():
    gold = tool_output(call("f", a=1), call("h"))
    # S_max = 1 + 2 + 1 = 4
    # missing h: names {f} vs {f, h} -> 1/2; pair f: 1 + 1 = 2; R_max = 2.5 -> 6 * 2.5 / 4 - 3 = 0.75
    assert correctness(tool_output(call("f", a=1)), gold) == pytest.approx(0.75)
    # an extra call k: names 2/3; pairs f (2) and h (1): R_max = 3.6667 -> 6 * 3.6667 / 4 - 3 = 2.5
    extra = tool_output(call("f", a=1), call("h"), call("k", z=0))
    assert correctness(extra, gold) == pytest.approx(2.5)
    # a different tool name can never be matched: names 0 -> R_max = 0 -> -3
    assert correctness(tool_output(call("other", a=1)), gold) == -3.0
    # no tool-call block at all: R_max = 0 -> -3
    assert correctness("<think>x</think>\n<response>hi</response>", gold) == -3.0


def test_gold_without_tool_calls_is_not_applicable():
    assert correctness(tool_output(call("f")), "<think>g</think>\n<response>hello</response>") == 0.0


def test_gold_as_json_list():
    gold = json.dumps([{"name": "f", "parameters": {"a": 1}}])
    assert correctness(tool_output(call("f", a=1)), gold) == 3.0
    assert format_matches(tool_output(call("f", a=1)), gold)


def test_correctness_matching_param_is_checked():
    with pytest.raises(ValueError, match="matching must be 'optimal' or 'greedy'"):
        rewards.get("toolrl_correctness", matching="best")


# ------------------------------------------------------------------------------------------
# math_correctness, length


def test_last_boxed_and_answer_tag():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None
    assert final_answer("<answer>42</answer>", answer_tag="answer") == "42"
    assert final_answer(r"<answer>so \boxed{7}</answer>", answer_tag="answer") == "7"


def test_math_correctness_equivalent_forms():
    fn = rewards.get("math_correctness")
    completions = [r"... so \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{0.25}", "I give up",
                   r"\boxed{\frac{2}{4}}"]
    assert fn([""] * 5, completions, ground_truth=["0.5"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_math_correctness_parses_each_ground_truth_once(monkeypatch):
    import math_verify

    from gdpo_ray.rewards import math_answer

    truths, parse = [], math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: truths.append(text) or parse(text, **kw))
    fn = rewards.get("math_correctness")
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", r"\boxed{0.5}", r"\boxed{4}", "no answer", r"\boxed{3}"]
    gold = ["0.5", "3", "0.5", "3", "3", 3]  # an int truth is its text
    assert fn([""] * 6, completions, ground_truth=gold) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert fn([""] * 6, completions, ground_truth=gold) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert [t for t in truths if not t.startswith("$\\boxed")] == ["$0.5$", "$3$"]  # once each, both calls
    monkeypatch.setattr(math_answer, "TRUTHS_KEPT", 1)  # past the bound: parsed again, the same scores
    fn = rewards.get("math_correctness")
    assert fn([""] * 6, completions, ground_truth=gold) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_a_ground_truth_math_verify_cannot_parse_in_time_is_the_rows_error(monkeypatch):
    # math-verify's TimeoutException is a BaseException (it once stopped a whole eval): the
    # reward raises a TimeoutError naming the truth, which the pool and the eval record on its row
    import math_verify
    from math_verify.errors import TimeoutException

    parse = math_verify.parse

    def slow_truths(text, **kw):
        if kw.get("raise_on_error"):
            raise TimeoutException("Timeout during parsing: " + text)
        return parse(text, **kw)

    monkeypatch.setattr(math_verify, "parse", slow_truths)
    fn = rewards.get("math_correctness", timeout_s=1)
    with pytest.raises(TimeoutError, match=r"math-verify did not parse the ground truth '2\^\{2\^\{2\}\}' "
                                           r"within 1 s \(timeout_s\)"):
        fn([""], [r"\boxed{16}"], ground_truth=["2^{2^{2}}"])
    assert fn([""], ["no answer"], ground_truth=["2^{2^{2}}"]) == [0.0]  # no answer: the truth is not parsed


def test_a_multi_turn_completion_is_scored_on_the_models_messages():
    from gdpo_ray.rewards import completion_text

    conversation = [{"role": "assistant", "content": "<tool_call>x</tool_call>"},
                    {"role": "tool", "name": "add", "content": "<answer>99</answer>"},
                    {"role": "assistant", "content": "<answer>7</answer>"}]
    assert completion_text(conversation) == "<tool_call>x</tool_call><answer>7</answer>"
    fn = rewards.get("math_correctness", answer_tag="answer")
    assert fn([""] * 2, [conversation, conversation], ground_truth=["7", "99"]) == [1.0, 0.0]  # not the tool's 99


def test_exact_answer_compares_the_words_in_order():
    fn = rewards.get("exact_answer")
    completions = [
        "<think>count</think><answer>23 24 25</answer>",  # right
        "<answer>  23\n24   25 </answer>",  # whitespace runs are one space, ends stripped
        "<answer>23 25 24</answer>",  # the order counts (math-verify would compare sets)
        "<answer>23 24 25 25</answer>",  # so do repeats
        "<answer>23 24</answer>",  # a number short
        "23 24 25",  # no <answer>, no \boxed{}: no answer
        "\\boxed{23 24 25}",  # the boxed fallback, as math_correctness finds the answer
    ]
    assert fn([""] * 7, completions, ground_truth=["23 24 25"] * 7) == [1, 1, 0, 0, 0, 0, 1]
    tagless = rewards.get("exact_answer", answer_tag=None)
    assert tagless([""] * 2, ["<answer>7</answer>", "\\boxed{7}"], ground_truth=["7", "7"]) == [0, 1]


def test_math_correctness_after_tag():
    plain = rewards.get("math_correctness")
    after = rewards.get("math_correctness", after_tag="</think>")
    completions = [
        r"<think>\boxed{5}",  # cut off inside the reasoning: no </think>
        r"<think>\boxed{4}</think> so \boxed{5}",  # the answer after the reasoning
        r"<think>\boxed{5}</think> the answer is five",  # a box only inside the reasoning
        r"<think>x</think>\boxed{5}</think>no box",  # only after the LAST </think>
    ]
    # without after_tag the last \boxed{} anywhere: 5, 5, 5, 5 -> all 1
    assert plain([""] * 4, completions, ground_truth=["5"] * 4) == [1.0, 1.0, 1.0, 1.0]
    # with it: tag missing -> 0; "so \boxed{5}" -> 1; " the answer is five" -> no box, 0; "no box" -> 0
    assert after([""] * 4, completions, ground_truth=["5"] * 4) == [0.0, 1.0, 0.0, 0.0]
    assert final_answer(r"<think>\boxed{4}</think><answer>5</answer>", "answer", "</think>") == "5"
    assert final_answer(r"<answer>5</answer>", "answer", "</think>") is None


def test_math_correctness_bad_ground_truth_raises():
    fn = rewards.get("math_correctness")
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        fn([""], [r"\boxed{1}"], ground_truth=[""])


def test_length():
    fn = rewards.get("length", limit=4000)
    assert fn([""] * 3, ["a"] * 3, response_length=[3999, 4000, 4001]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="length limit must be a positive"):
        rewards.get("length", limit=0)


# ------------------------------------------------------------------------------------------
# code rewards without running anything: program extraction, bug classification, the harness


@pytest.mark.parametrize("completion, program", [
    # a correct solution followed by an untagged example block: the python block wins
    ("```python\nprint(int(input()) * 2)\n```\nExample:\n```\nInput: 3\nOutput: 6\n```\n",
     "print(int(input()) * 2)\n"),
    # the last python-tagged block, any of python/py/python3, any case
    ("```python\na = 1\n```\nmore\n```py\nb = 2\n```\n", "b = 2\n"),
    ("```PY\nb = 2\n```\n```Python3\nc = 3\n```\n```text\nout\n```", "c = 3\n"),
    # no python tag: the last untagged block, never a block of another language
    ("```\nx = 1\n```\n```bash\nrun it\n```\n```json\n{}\n```", "x = 1\n"),
    # only blocks of other languages: the last of them
    ("```text\nout\n```\n```bash\npython main.py\n```", "python main.py\n"),
    # no fenced block: the whole completion
    ("print(1)", "print(1)"),
    ("", ""),
])
def test_extract_program(completion, program):
    assert extract_program(completion) == program


def test_extract_program_after_tag():
    text = "<think>```python\nwrong()\n```</think>\n```python\nright()\n```"
    assert extract_program(text, "</think>") == "right()\n"
    assert extract_program(text) == "right()\n"
    # cut off inside the reasoning: no program at all (without the tag: the block in the think)
    assert extract_program("<think>```python\nwrong()\n```", "</think>") is None
    assert extract_program("<think>```python\nwrong()\n```") == "wrong()\n"


def test_code_rewards_without_after_tag_score_0():
    # nothing runs (no sandbox needed): the program is missing, pass rate 0 and bug 0
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    unfinished = ["<think>```python\nprint(input())\n```"]
    for name in ("code_passrate", "code_bug"):
        fn = rewards.get(name, after_tag="</think>")
        assert fn([""], unfinished, ground_truth=[tests]) == [0.0], name


def run(exit_code=None, signal=None, timed_out=False, output_exceeded=False):
    return RunResult(exit_code, signal, timed_out, output_exceeded, "", "", 0.1)


@pytest.mark.parametrize("result, paper, strict", [
    (run(exit_code=0), False, False),  # ran fine
    (run(exit_code=1), True, True),  # a traceback: SyntaxError, ZeroDivisionError, MemoryError...
    (run(signal=11), True, True),  # SIGSEGV: a crash
    (run(signal=6), True, True),  # SIGABRT: a crash
    (run(timed_out=True), False, True),  # past the wall limit: no exit status
    (run(signal=9), False, True),  # the CPU limit (soft = hard RLIMIT_CPU: SIGKILL)
    (run(signal=24), False, True),  # SIGXCPU
    (run(output_exceeded=True), False, True),  # too much output, still running
    (run(exit_code=0, output_exceeded=True), False, True),  # too much output, then exited 0
])
def test_has_error(result, paper, strict):
    assert has_error(result) is paper
    assert has_error(result, timeouts_are_bugs=True) is strict


def test_harness_serializes_plain_values():
    assert _plain({3, 1, 2}) == [1, 2, 3]  # sortable set -> sorted list
    assert _plain(frozenset({"b", "a"})) == ["a", "b"]
    mixed = {1, "a"}
    assert _plain(mixed) == list(mixed)  # unsortable: iteration order
    assert _plain((1, (2, {3}))) == [1, [2, [3]]]  # nested tuples and sets
    # dict keys json takes (str, int, float, bool, None) stay for json.dumps; others -> repr
    assert json.dumps(_plain({1: (2,), (3, 4): None})) == '{"1": [2], "(3, 4)": null}'
    assert _plain(np.array([[1, 2]])) == [[1, 2]] and _plain(np.int64(7)) == 7
    assert _plain(complex(1, 2)) == "(1+2j)"  # anything else: its repr
    assert _plain(None) is None and _plain(True) is True and _plain(2.5) == 2.5


# ------------------------------------------------------------------------------------------
# registry and adapters


def test_registry_lists_known_names():
    with pytest.raises(ValueError, match="unknown reward 'toolrl'; known: code_bug, code_passrate, "
                                         "exact_answer, length, math_correctness, regex, tool_turn_format, toolrl_correctness, toolrl_format"):
        rewards.get("toolrl")
    with pytest.raises(ValueError, match=r"reward 'length': bad params"):
        rewards.get("length", lim=3)


def user_reward(prompts, completions, *, bonus=0.0, **columns):
    return [len(c) + bonus for c in completions]


def test_import_path_with_params():
    fn = rewards.get("tests.unit.test_rewards:user_reward", bonus=0.5)
    assert fn(["p", "p"], ["ab", "c"]) == [2.5, 1.5]
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        rewards.get("no_such_module:f")
    with pytest.raises(ValueError, match="takes no parameter"):
        rewards.get("tests.unit.test_rewards:verl_score", weight=2)


def verl_score(data_source, solution_str, ground_truth, extra_info):
    if data_source == "dict":
        return {"score": float(solution_str == ground_truth), "acc": 1}
    return float(solution_str == ground_truth) + (extra_info or {}).get("bonus", 0)


def test_verl_adapter():
    fn = from_verl(verl_score)
    out = fn(["p"] * 3, ["a", "b", "a"], ground_truth=["a", "a", "a"],
             data_source=["x", "x", "dict"], extra_info=[{"bonus": 0.5}, None, None])
    assert out == [1.5, 0.0, 1.0]
    by_name = rewards.get("verl:tests.unit.test_rewards:verl_score")
    assert by_name(["p"], ["a"], ground_truth=["a"], data_source=["x"], extra_info=[None]) == [1.0]


# ------------------------------------------------------------------------------------------
# specs and conditioned rewards


def test_conditioned_reward_values():
    specs = [RewardSpec("code_passrate"), RewardSpec("length", condition=rewards.Condition("code_passrate", 1.0))]
    nan = np.nan
    values = np.array([[1.0, 1.0], [0.5, 1.0], [nan, 1.0], [1.0, 0.0], [1.0, nan], [0.0, nan]])
    out = apply_conditions(values, specs)
    # gate >= 1 keeps the value; gate below -> 0 (even if its own value is NaN); gate NaN -> NaN
    np.testing.assert_array_equal(out[:, 1], [1.0, 0.0, nan, 0.0, nan, 0.0])
    np.testing.assert_array_equal(out[:, 0], values[:, 0])


def test_chained_conditions_use_the_conditioned_gate():
    specs = [RewardSpec.from_dict(d) for d in (
        {"name": "c", "fn": "length", "condition": {"on": "b", "min": 0.5}},
        {"name": "a", "fn": "length"},
        {"name": "b", "fn": "length", "condition": {"on": "a", "min": 1}},
    )]
    # a = 0 closes b (-> 0), which closes c (-> 0)
    out = apply_conditions(np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]), specs)
    np.testing.assert_array_equal(out, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "specs, match",
    [
        ([], "at least one reward"),
        ([{"name": "a", "fn": "length"}, {"name": "a", "fn": "length"}], "repeated: \\['a'\\]"),
        ([{"name": "a", "fn": "length", "condition": {"on": "zz", "min": 1}}], "condition.on must name another reward"),
        ([{"name": "a", "fn": "length", "condition": {"on": "b", "min": 1}},
          {"name": "b", "fn": "length", "condition": {"on": "a", "min": 1}}], "cycle: a -> b -> a"),
        ([{"name": "a", "fn": "length", "wieght": 2}], "unknown key\\(s\\) \\['wieght'\\]"),
        ([{"name": "a", "fn": "length", "weight": math.inf}], "weight must be a finite number"),
        ([{"name": "a", "fn": "nope"}], "unknown reward 'nope'"),
        ([{"name": "a", "fn": "code_passrate", "timeout_s": 10}], "timeout_s \\(10\\) must exceed"),
        ([{"name": "a", "fn": "length", "condition": {"on": "b"}}], "condition must be"),
    ],
)
def test_bad_reward_config_names_the_fix(specs, match):
    with pytest.raises(ValueError, match=match):
        check_specs([RewardSpec.from_dict(s) for s in specs])


def test_code_reward_default_timeout_exceeds_sandbox_bound():
    spec = RewardSpec.from_dict({"name": "pass", "fn": "code_passrate", "params": {"wall_s": 2, "max_tests": 4}})
    (fn,) = check_specs([spec])
    # sandbox worst case: 4 runs x (2 + 0.5) s + 5 s = 15 s; default timeout 30 s
    assert fn.min_timeout_s == 15.0 and spec.call_timeout_s(fn) == 30.0


def test_regex_format_reward():
    from gdpo_ray.tasks import ADDITION_FORMAT

    fn = rewards.get("regex", pattern=ADDITION_FORMAT)
    assert fn(None, ["<think>add</think><answer>7</answer>", " <think></think>\n<answer>7</answer>\n",
                     "<think>add</think>\\boxed{7}", "<answer>7</answer>",
                     "<think>a</think><answer>7</answer> more"]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="bad pattern"):
        rewards.get("regex", pattern="(")


# ------------------------------------------------------------------------------------------
# hostile model output (issue 29, item 6; the scans of item 5)


def _nested(depth, inner="1"):
    return tool_output('{"name": "f", "parameters": {"a": ' + "[" * depth + inner + "]" * depth + "}}")


@pytest.mark.parametrize("completion", [
    "[not json", "[" * 5000, "[1, 2]", '[{"name": 5}]', "[" + "{" * 3000, _nested(5000), _nested(100_000),
    _nested(900), _nested(101), tool_output('{"name": "f", "parameters": ' + '{"a": ' * 900 + "1" + "}" * 901),
    tool_output("[" * 100_000), tool_output('"just a string"'), tool_output('{"name": "f", "parameters": [1]}'),
], ids=lambda c: repr(c[:24]) + f"..{len(c)}")
@pytest.mark.parametrize("matching", ["optimal", "greedy"])
def test_toolrl_correctness_is_minus_3_for_any_unparsable_call(completion, matching):
    """Not JSON after "[", nesting past the parser's recursion limit, or past MAX_DEPTH (100)
    levels, where the matching would recurse: all -3, as documented (they raised: NaN)."""
    fn = rewards.get("toolrl_correctness", matching=matching)
    assert fn([""], [completion], ground_truth=[tool_output(call("f", a=1))]) == [-3.0]


def test_toolrl_calls_nested_to_max_depth_still_parse():
    # the call object is level 1, its parameters 2, "a"'s outer list 3: 97 + 1 lists reach
    # level 100. S_max = 1 + 1 + 1 = 3; names 1, keys 1, value unequal 0: R_max = 2 -> 6 * 2 / 3 - 3
    assert correctness(_nested(97, inner="[]"), tool_output(call("f", a=1))) == pytest.approx(1.0)
    assert correctness(_nested(98, inner="[]"), tool_output(call("f", a=1))) == -3.0


def test_scans_of_model_output_are_linear():
    """400 KB of unclosed tags and boxes: each scan finishes (they were quadratic: minutes)."""
    from gdpo_ray.tool_format import calls_in
    from tests.hang import hang_guard

    gold = tool_output(call("f", a=1))
    for scan in (lambda: last_boxed("\\boxed{" * 60_000), lambda: final_answer("<answer>" * 50_000, "answer"),
                 lambda: calls_in("<tool_call>" * 40_000), lambda: calls_in("<tool_call></tool_call>" * 20_000),
                 lambda: format_matches("<think>" + "</think>\n<tool_call>\n" * 20_000, gold),
                 lambda: format_matches("<think>" + "</think>\n<tool_call>\n" * 20_000 + "</tool_call>", gold, True)):
        with hang_guard(60, "a scan of 400 KB"):
            scan()


def _old_last_boxed(text):
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and text[start + len("\\boxed"):i].strip() == "":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)
    return None


def _old_format_matches(completion, gold, strict):
    from gdpo_ray.rewards.toolrl import _TAGS, _format_parts

    pattern, tags = _format_parts(gold)
    text = completion if strict else completion.strip()
    if re.fullmatch(pattern, text, re.DOTALL) is None:
        return False
    if strict:
        tags |= {"<think>", "</think>"}
        return all(text.count(tag) == (1 if tag in tags else 0) for tag in _TAGS)
    return all(text.count(tag) == 1 for tag in tags)


def test_linear_scans_equal_the_plain_ones_on_random_text():
    """The linear scans give what the plain (quadratic) ones gave, on 20,000 random strings of
    their tokens."""
    import random

    from gdpo_ray.tool_format import tool_call_blocks

    rng = random.Random(0)
    box = ["\\boxed", "{", "}", " ", "x", "\\boxedx", "\n"]
    tags = ["<answer>", "</answer>", "a", "<", "/answer>", "<answer", "\n"]
    tool = ["<think>", "</think>", "\n", "<tool_call>", "</tool_call>", "<response>", "</response>", "x", " "]
    golds = [tool_output(call("f")), "<think>g</think>\n<response>r</response>", "<think>g</think>",
             tool_output(call("f")) + "\n<response>r</response>"]
    seen = {"boxed": 0, "tagged": 0, "blocks": 0, "format": 0}
    for _ in range(20_000):
        text = "".join(rng.choice(box) for _ in range(rng.randint(0, 14)))
        assert last_boxed(text) == _old_last_boxed(text), text
        seen["boxed"] += last_boxed(text) is not None
        text = "".join(rng.choice(tags) for _ in range(rng.randint(0, 10)))
        found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
        assert final_answer(text, "answer") == (last_boxed(found[-1]) or found[-1].strip() if found else last_boxed(text))
        seen["tagged"] += bool(found)
        text = "".join(rng.choice(tool) for _ in range(rng.randint(0, 12)))
        assert tool_call_blocks(text) == re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL), text
        seen["blocks"] += bool(tool_call_blocks(text))
        gold, strict = rng.choice(golds), rng.random() < 0.5
        if rng.random() < 0.5:  # a gold answer with a few tokens inserted: the shape nearly right
            text = rng.choice(golds)
            for _ in range(rng.randint(0, 2)):
                at = rng.randint(0, len(text))
                text = text[:at] + rng.choice(tool) + text[at:]
        assert format_matches(text, gold, strict) == _old_format_matches(text, gold, strict), (text, gold)
        seen["format"] += format_matches(text, gold, strict)
    assert min(seen.values()) > 500, seen  # each scan found something often (seed 0: 998 or more)
