"""``--suite rewards:FILE``: held-out prompts scored with a run's own rewards, exact avg@n,
failure rates and weighted sums; the config read from --rewards or the run directory."""

import json
import math
import time

import pytest

from gdpo_ray.eval.report import read_report
from gdpo_ray.eval.suite import Completion
from gdpo_ray.eval.suites import make_suite
from gdpo_ray.rewards import completion_text
from gdpo_ray.run.eval_runner import score

HERE = "tests.unit.test_eval_rewards_suite"


def says_answer(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def flaky(completions, **kwargs):
    """0.25, but None for "skip..." and raises for "boom..." (the whole call raises)."""
    texts = [completion_text(c) for c in completions]
    if any(t.startswith("boom") for t in texts):
        raise ValueError("boom")
    return [None if t.startswith("skip") else 0.25 for t in texts]


def chat_shape(completions, **kwargs):
    return [float(isinstance(c, list) and c[0]["role"] == "assistant") for c in completions]


def slow(completions, **kwargs):
    time.sleep(2)
    return [1.0 for _ in completions]


def base_exceptions(completions, **kwargs):
    """1.0, but math-verify's timeout (a BaseException) for "slow-parse" and SystemExit for "exit"."""
    from math_verify.errors import TimeoutException

    texts = [completion_text(c) for c in completions]
    if "slow-parse" in texts:
        raise TimeoutException("Timeout during parsing: 2^2^2^2")
    if "exit" in texts:
        raise SystemExit(3)
    return [1.0 for _ in texts]


REWARDS = [{"name": "correct", "fn": f"{HERE}:says_answer"},
           {"name": "brief", "fn": "length", "params": {"limit": 5}, "weight": 0.5,
            "condition": {"on": "correct", "min": 1.0}},
           {"name": "flaky", "fn": f"{HERE}:flaky", "weight": 2.0}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def held_out(tmp_path):
    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]
    return write_jsonl(tmp_path / "held_out.jsonl", rows)


def test_each_reward_its_failure_rate_and_the_weighted_sum_are_exact(held_out):
    suite = make_suite(f"rewards:{held_out}", rewards=REWARDS, max_tokens=8)
    assert suite.name == "rewards:held_out" and suite.length_limit == 8
    assert suite.metrics == ("correct", "correct/failure_rate", "brief", "brief/failure_rate", "flaky",
                             "flaky/failure_rate", "weighted_sum", "exceed_ratio")
    items = suite.items()
    assert [(it.id, it.prompt, it.reference) for it in items] == [("0", "2+2?", {"answer": "4"}),
                                                                  ("1", "3+3?", {"answer": "6"})]
    scored = score(suite, items, {"0": [Completion("4", 1), Completion("boom 4", 9), Completion("skip", 3)],
                                  "1": [Completion("6", 2), Completion("5", 1)]}, progress=False)
    first = scored["0"]
    # correct [1, 0 ("boom 4" is not "4"), 0]; brief (<= 5 tokens, paid when correct): [1, 0, 0];
    # flaky: its call raises, so row by row: 0.25, raised, None
    assert [(s["correct"], s["brief"], s["flaky"]) for s in first][0] == (1.0, 1.0, 0.25)
    assert math.isnan(first[1]["flaky"]) and math.isnan(first[2]["flaky"])
    assert [s["flaky/failure_rate"] for s in first] == [0.0, 1.0, 1.0]
    assert first[1]["reward_errors"] == {"flaky": "error: ValueError: boom"}
    assert first[2]["reward_errors"] == {"flaky": "error: returned None or NaN"}
    assert "reward_errors" not in first[0]
    # weighted sums: 1 + 0.5 * 1 + 2 * 0.25 = 2; none where a reward failed
    assert first[0]["weighted_sum"] == 2.0 and math.isnan(first[1]["weighted_sum"])
    assert [s["exceed_ratio"] for s in first] == [0.0, 1.0, 0.0]  # 9 tokens > 8
    from gdpo_ray.eval.report import build_report

    report = build_report(suite, scored, {"0": "held_out", "1": "held_out"}, "p", {})
    assert report["overall"] == pytest.approx({
        "correct": (1 / 3 + 1 / 2) / 2, "correct/failure_rate": 0.0,
        "brief": (1 / 3 + 1 / 2) / 2, "brief/failure_rate": 0.0,
        "flaky": 0.25, "flaky/failure_rate": (2 / 3 + 0) / 2,
        # item 0: 2 (its one scored sample); item 1: (2 + 0.5) / 2
        "weighted_sum": (2.0 + 1.25) / 2, "exceed_ratio": (1 / 3 + 0) / 2})
    from gdpo_ray.eval.rewards_suite import failure_lines

    assert failure_lines(report) == ["reward 'flaky' failed on 2 of 5 samples, e.g. item 0 sample 1: "
                                     "error: ValueError: boom"]


def test_a_failed_gate_an_unknown_length_a_timeout_and_chat_prompts(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"q": [{"role": "user", "content": "hi"}], "key": "a"}])
    rewards = [{"name": "flaky", "fn": f"{HERE}:flaky"},
               {"name": "gated", "fn": "length", "params": {"limit": 100}, "condition": {"on": "flaky", "min": 0}},
               {"name": "chat", "fn": f"{HERE}:chat_shape"},
               {"name": "slow", "fn": f"{HERE}:slow", "timeout_s": 0.2}]
    suite = make_suite(f"rewards:{data}", rewards=rewards, prompt_column="q", id_column="key")
    [item] = suite.items()
    assert item.id == "a" and item.reference == {"key": "a"}
    samples = suite.score(item, [Completion("boom", 3), Completion("fine", None)])
    assert samples[0]["reward_errors"] == {"flaky": "error: ValueError: boom",
                                           "gated": "condition: on 'flaky', error: ValueError: boom",
                                           "slow": "timeout: no answer after 0.2 s"}
    assert samples[1]["reward_errors"] == {
        "gated": "error: response_length is not known (give the completions file \"tokens\", or --tokenizer MODEL)",
        "slow": "timeout: no answer after 0.2 s"}
    assert samples[1]["flaky"] == 0.25 and [s["chat"] for s in samples] == [1.0, 1.0]  # one assistant message
    assert [s["gated/failure_rate"] for s in samples] == [1.0, 1.0]
    assert math.isnan(samples[1]["exceed_ratio"])  # no length, no finish reason


def test_bad_input_is_named_with_its_fix(tmp_path, held_out):
    with pytest.raises(ValueError, match=r"rewards:no/such\.jsonl: no such file"):
        make_suite("rewards:no/such.jsonl", rewards=REWARDS)
    with pytest.raises(ValueError, match=r"scores with a run's reward functions: give them with gdpo-ray eval "
                                         r"--rewards"):
        make_suite(f"rewards:{held_out}")
    no_column = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "2+2?", "truth": "4"}])
    with pytest.raises(ValueError, match=r"reward 'correct' needs column 'answer', which .*q\.jsonl does not have "
                                         r"\(its columns: \['prompt', 'truth'\]\)"):
        make_suite(f"rewards:{no_column}", rewards=REWARDS)
    gap = write_jsonl(tmp_path / "gap.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"gap\.jsonl, line 2 has no 'answer' \(null or missing\), which reward "
                                         r"'correct' needs"):
        make_suite(f"rewards:{gap}", rewards=REWARDS)
    with pytest.raises(ValueError, match=r"reward 'weighted_sum': the rewards suite reports a metric of that name"):
        make_suite(f"rewards:{held_out}", rewards=[{"name": "weighted_sum", "fn": f"{HERE}:flaky"}])


def test_columns_only_a_rollout_computes_are_scored_by_it_never_left_out(held_out):
    """Issue 48: an environment's column (and one conditioned on it) is no longer left out: the
    rollout actor scores every column; a completions file cannot, which is said before anything
    runs; a sample the actors did not generate fails those columns with the reason."""
    rewards = [*REWARDS, {"name": "solved", "fn": "environment"},
               {"name": "after", "fn": "length", "condition": {"on": "solved", "min": 1}}]
    suite = make_suite(f"rewards:{held_out}", rewards=rewards, source="cfg.yaml")
    assert [s.name for s in suite.specs] == ["correct", "brief", "flaky", "solved", "after"]
    assert suite.rollout_rewards == rewards and suite.rollout_only == ["solved", "after"]
    assert suite.report_settings() == {"rewards_config": "cfg.yaml", "reward_weights": {
        "correct": 1.0, "brief": 0.5, "flaky": 2.0, "solved": 1.0, "after": 1.0}}
    with pytest.raises(ValueError, match=r"--completions: rewards \['solved', 'after'\] are computed by the rollout actors"):
        suite.check_scorable_here()
    item = suite.items()[0]  # 2+2? -> 4
    given = Completion("4", 1, "stop", rewards={"correct": 1.0, "brief": 1.0, "flaky": 0.25, "solved": 0.0,
                                                "after": 0.0}, reward_errors={})
    failed = Completion("4", 1, "stop", rewards={"correct": 1.0, "brief": 1.0, "flaky": 0.25, "solved": math.nan,
                                                 "after": math.nan},
                        reward_errors={"solved": "error: get_rewards raised KeyError", "after": "condition: ..."})
    too_long = Completion("", 0, "prompt_too_long")
    a, b, c = suite.score(item, [given, failed, too_long])
    # weighted sum 1*1 + 0.5*1 + 2*0.25 + 1*0 + 1*0 = 2.0
    assert a["solved"] == 0.0 and a["after"] == 0.0 and a["weighted_sum"] == 2.0 and "reward_errors" not in a
    assert math.isnan(b["solved"]) and b["solved/failure_rate"] == 1.0 and math.isnan(b["weighted_sum"])
    assert b["reward_errors"] == {"solved": "error: get_rewards raised KeyError",
                                  "after": "condition: on 'solved', error: get_rewards raised KeyError"}
    # not generated: every column fails with the reason (an empty text would score on some)
    assert all(math.isnan(c[name]) and c[name + "/failure_rate"] == 1.0 for name in ("correct", "flaky", "solved"))
    assert c["reward_errors"]["flaky"] == "error: not generated: its prompt is over the actors' max_prompt_tokens"


def test_another_classs_column_does_not_apply_and_is_no_failure(held_out):
    """TRL's dict form: a rollout of class Adder has no Muler column (training's n/a): NaN, no
    failure, out of the weighted sum, and --correct conditions on it hold."""
    rewards = [{"name": "Adder", "fn": "environment"}, {"name": "Muler", "fn": "environment", "weight": 2.0},
               {"name": "after", "fn": "length", "condition": {"on": "Muler", "min": 1}}]
    suite = make_suite(f"rewards:{held_out}", rewards=rewards)
    suite.set_correct(["Adder>=1", "Muler>=1"])
    na = "n/a: a rollout of 'add', which gives no 'Muler'"
    done = Completion("4", 1, "stop", rewards={"Adder": 1.0, "Muler": math.nan, "after": math.nan},
                      reward_errors={"Muler": na, "after": "n/a: on 'Muler', which does not apply"})
    (row,) = suite.judged(suite.score(suite.items()[0], [done]))
    assert math.isnan(row["Muler"]) and row["Muler/failure_rate"] == 0.0 and row["after/failure_rate"] == 0.0
    assert row["weighted_sum"] == 1.0 and "reward_errors" not in row and row["not_applicable"] == ["Muler", "after"]
    assert row["accuracy"] == 1.0 and row["Adder/pass_rate"] == 1.0 and math.isnan(row["Muler/pass_rate"])


def test_a_tool_environment_adds_the_turn_metrics_and_the_settings(held_out):
    env = "tests.unit.trl_style_environments:Counted"
    suite = make_suite(f"rewards:{held_out}", rewards=REWARDS, environment=env, max_turns=3,
                       tool_settings={"tool_timeout": 5.0, "tools_in_system_prompt": "auto"})
    assert suite.metrics[-3:] == ("rollout/turns", "rollout/tool_calls", "rollout/tool_errors")
    assert suite.report_settings()["tool_environment"] == env and suite.report_settings()["max_turns"] == 3
    done = Completion("4", 3, "stop", messages=[{"role": "assistant", "content": "4"}], rewards={
        "correct": 1.0, "brief": 1.0, "flaky": 0.25}, reward_errors={}, turns=2, tool_calls=1, tool_errors=0)
    (row,) = suite.score(suite.items()[0], [done])
    assert (row["rollout/turns"], row["rollout/tool_calls"], row["rollout/tool_errors"]) == (2.0, 1.0, 0.0)


CONFIG = """\
data:
  prompt_column: question
  columns: {answer: meta.answer}
generation:
  max_tokens: 8
training:
  rewards:
    - {name: correct, fn: "tests.unit.test_eval_rewards_suite:says_answer"}
    - {name: flaky, fn: "tests.unit.test_eval_rewards_suite:flaky", weight: 2.0}
"""


def test_the_eval_command_scores_with_a_run_directorys_config(tmp_path, capsys):
    from gdpo_ray.run.cli import main
    from gdpo_ray.run.eval_rewards import run_config

    run = tmp_path / "runs" / "mine"
    (run / "policy").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG)
    assert run_config(run / "policy") == run / "config.yaml" and run_config(tmp_path) is None
    data = write_jsonl(tmp_path / "held_out.jsonl", [{"question": "2+2?", "meta": {"answer": "4"}},
                                                     {"question": "3+3?", "meta": {"answer": "6"}}])
    completions = write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "completions": ["4", "skip"], "tokens": [1, 9]},
                                                     {"id": "1", "completions": ["6", "7"], "tokens": [1, 1]}])
    out = tmp_path / "r.json"
    assert main(["eval", "--suite", f"rewards:{data}", "--rewards", str(run), "--completions", completions,
                 "--output", str(out)]) == 0
    report = read_report(out)
    # correct: (1/2 + 1/2) / 2; flaky: 0.25 where scored, failed on 1 of item 0's 2 samples;
    # weighted sums: item 0 1.5 (its one scored sample), item 1 (1.5 + 0.5) / 2;
    # exceed: 9 tokens > 8 (the config's max_tokens) on 1 of item 0's 2 samples
    assert report["overall"] == {"correct": 0.5, "correct/failure_rate": 0.0, "flaky": 0.25,
                                 "flaky/failure_rate": 0.25, "weighted_sum": 1.25, "exceed_ratio": 0.25}
    assert report["settings"] | {"rewards_config": str(run / "config.yaml"), "reward_weights": {
        "correct": 1.0, "flaky": 2.0}, "samples": 2, "temperature": None, "max_tokens": None,
        "length_limit": 8} == report["settings"]
    captured = capsys.readouterr()
    assert "weighted_sum" in captured.out
    assert ("note: reward 'flaky' failed on 1 of 4 samples, e.g. item 0 sample 1: error: returned None or NaN"
            in captured.err)


def test_the_eval_command_names_a_missing_rewards_config(tmp_path, capsys, held_out):
    from gdpo_ray.run.cli import main

    assert main(["eval", "demo", "--suite", f"rewards:{held_out}"]) == 2
    assert ("--suite rewards:FILE needs the reward functions to score with, and POLICY 'demo' is not a run "
            "directory with config.yaml: give --rewards CONFIG") in capsys.readouterr().err
    assert main(["eval", "--suite", f"rewards:{held_out}", "--rewards", str(tmp_path), "--completions", "x"]) == 2
    assert f"--rewards {tmp_path}: a directory without config.yaml" in capsys.readouterr().err
    assert main(["eval", "--suite", "task:addition", "--rewards", "demo", "--completions", "x"]) == 2
    assert "--rewards goes with --suite rewards:FILE" in capsys.readouterr().err


def test_a_preset_names_the_rewards(tmp_path):
    from gdpo_ray.run.eval_command import rewards_suite_options

    options = rewards_suite_options("demo", None)
    assert [r["name"] for r in options["rewards"]] == ["format", "correct", "length"]
    assert options["max_tokens"] == 40 and options["source"] == "demo" and options["prompt_column"] == "prompt"
    data = write_jsonl(tmp_path / "sums.jsonl", [{"prompt": "1+1", "ground_truth": "2"}])
    suite = make_suite(f"rewards:{data}", **options)
    [sample] = suite.score(suite.items()[0], [Completion("<think>x</think><answer>2</answer>", 10)])
    assert (sample["format"], sample["correct"], sample["length"], sample["weighted_sum"]) == (1.0, 1.0, 1.0, 3.0)


def test_time_limits_nest_each_raising_its_own():
    """A reward call's limit inside an item's (``eval_runner.score``): whichever is up first raises, named."""
    from gdpo_ray.eval.time_limit import ScoringTimeout, time_limit

    start = time.monotonic()
    with time_limit(5) as outer:
        with pytest.raises(ScoringTimeout) as inner_up:
            with time_limit(0.1) as inner:
                time.sleep(2)
    assert inner_up.value.limit is inner and str(inner_up.value) == "timed out after 0.1 s"
    with pytest.raises(ScoringTimeout) as outer_up:
        with time_limit(0.2) as outer:
            with time_limit(5):
                time.sleep(2)
    assert outer_up.value.limit is outer and time.monotonic() - start < 1.5


def test_rows_the_environment_cannot_start_on_are_refused_before_any_model(tmp_path):
    """A held-out file without the column the environment's reset reads (the tools would be off
    for every row, every environment column NaN), or in TRL's dict form a row naming no class."""
    env = "tests.unit.trl_style_environments:Calculator"  # reset reads row["target"] with a default
    strict = "tests.unit.test_eval_rewards_suite:NeedsTarget"
    path = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "a", "answer": "1"}])
    make_suite(f"rewards:{path}", rewards=REWARDS, environment=env)  # fine
    with pytest.raises(ValueError, match=r"h\.jsonl, line 1: environment .*NeedsTarget cannot start on this row "
                                         r"\(KeyError: 'target'\); give the held-out rows the columns"):
        make_suite(f"rewards:{path}", rewards=REWARDS, environment=strict)
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "1", "environment": "calc"},
                                               {"prompt": "b", "answer": "2", "environment": "serach"}])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: environment is 'serach', not one of"):
        make_suite(f"rewards:{mixed}", rewards=REWARDS, environment={"calc": env, "strict": strict})


class NeedsTarget:
    def reset(self, **row):
        self.target = row["target"]

    def add(self, value: float) -> str:
        """Adds a number.

        Args:
            value: The number.
        """
        return str(value)


def test_a_scorer_raising_a_base_exception_fails_its_sample_and_the_eval_goes_on(held_out):
    """math-verify's TimeoutException (a BaseException) once stopped a whole eval: anything a
    reward raises but KeyboardInterrupt is its failure on the sample, with the reason."""
    rewards = [{"name": "base", "fn": f"{HERE}:base_exceptions"}, {"name": "correct", "fn": f"{HERE}:says_answer"}]
    suite = make_suite(f"rewards:{held_out}", rewards=rewards)
    completions = {"0": [Completion("4", 1), Completion("slow-parse", 1), Completion("exit", 1)],
                   "1": [Completion("6", 1)]}
    scored = score(suite, suite.items(), completions, progress=False)
    first = scored["0"]
    assert first[0]["base"] == 1.0 and math.isnan(first[1]["base"]) and math.isnan(first[2]["base"])
    assert first[1]["reward_errors"] == {"base": "error: TimeoutException: Timeout during parsing: 2^2^2^2"}
    assert first[2]["reward_errors"] == {"base": "error: SystemExit: 3"}
    assert [s["base/failure_rate"] for s in first] == [0.0, 1.0, 1.0]
    assert [s["correct"] for s in first] == [1.0, 0.0, 0.0]  # the other reward scored every sample
    assert scored["1"][0]["base"] == scored["1"][0]["correct"] == 1.0  # and the eval went on


def test_a_row_nested_too_deep_is_named_by_the_eval_command(tmp_path, capsys):
    """A held-out row nested 5,000 levels deep gave a RecursionError traceback: now the file, its
    line and the column, and the eval command's usage error (exit 2)."""
    from gdpo_ray.run.cli import main

    deep = '{"question": "3+3?", "meta": {"answer": "6", "steps": %s}}' % ("[" * 5000 + "]" * 5000)
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "meta": {"answer": "4"}}) + "\n" + deep + "\n")
    (tmp_path / "config.yaml").write_text(CONFIG)
    completions = write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "completions": ["4"]},
                                                     {"id": "1", "completions": ["6"]}])
    assert main(["eval", "--suite", f"rewards:{data}", "--rewards", str(tmp_path / "config.yaml"),
                 "--completions", completions]) == 2
    err = capsys.readouterr().err
    assert (f"{data}, line 2: column 'meta' nests more than 100 levels (objects and arrays inside one another); "
            f"a row may nest at most 100: flatten it") in err
    assert "Traceback" not in err and "RecursionError" not in err
