"""BFCL multi-turn: every ground-truth trajectory of the four categories scores 1; perturbed ones
score 0 with BFCL's reason; model calls are parsed, never run as code; and (marked bfcl, against
bfcl-eval's own runner and multi_turn_checker in .venv-bfcl: scripts/test-bfcl-checker.sh) every
verdict, every call result and every tool doc equals BFCL's own."""

import builtins
import decimal
import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

if __import__("importlib").util.find_spec("bfcl_eval") is None:
    pytest.skip("needs bfcl-eval: pip install --no-deps bfcl-eval==2026.3.23", allow_module_level=True)

from gdpo_ray.bfcl import apis as bfcl_apis, multi_turn_suite as mt  # noqa: E402
from gdpo_ray.bfcl.apis import ApiState, UnsafeCall, parse_call, tool_docs  # noqa: E402
from gdpo_ray.bfcl.data import is_held_out, load_category, scenario_of  # noqa: E402
from gdpo_ray.bfcl.multi_turn_check import check  # noqa: E402
from gdpo_ray.bfcl.multi_turn_env import added_functions_message  # noqa: E402
from gdpo_ray.eval.suite import Completion  # noqa: E402
from gdpo_ray.eval.suites import make_suite  # noqa: E402


@pytest.fixture(scope="module")
def entries():
    """item id -> BFCL prompt entry with its ground_truth, all four categories."""
    return {e["id"]: e for c in mt.CATEGORIES for e in load_category(c)}


def gold(entry):
    """The ground truth as a trajectory: per turn one step with all its calls (none when empty)."""
    return [[list(calls)] if calls else [] for calls in entry["ground_truth"]]


def verdict(entry, result):
    v = check(entry, entry["ground_truth"], result)
    return v.valid, v.reason, v.turn


# --- scoring ------------------------------------------------------------------------------------

def test_every_ground_truth_trajectory_scores_one_in_all_four_categories():
    for category in mt.CATEGORIES:
        suite = make_suite(f"bfcl:{category}:all")
        items = suite.items()
        assert len(items) == 200
        texts = [mt.completion_text(gold(it.reference.entry)) for it in items]
        scores = [suite.score(it, [Completion(t)])[0] for it, t in zip(items, texts)]
        assert [s["accuracy"] for s in scores] == [1.0] * 200, category
        assert {s["reason"] for s in scores} == {""}


def test_perturbed_trajectories_fail_with_bfcls_reason(entries):
    e = entries["multi_turn_base_0"]  # TwitterAPI + GorillaFileSystem, 4 turns
    g = gold(e)
    assert verdict(e, g) == (True, "", None)
    # one step per call, and extra read-only calls: still right (the results are a superset)
    assert verdict(e, [[[c] for c in t[0]] for t in g]) == (True, "", None)
    assert verdict(e, [[["ls(a=True)"], *t] for t in g]) == (True, "", None)
    # grep dropped from turn 1: the state is the same, its result is missing
    dropped = [g[0], [["cd(folder='temp')"]], g[2], g[3]]
    assert verdict(e, dropped) == (False, "multi_turn:execution_response_mismatch", 1)
    # mkdir dropped: mv renames final_report.pdf to 'temp', the file system differs
    assert verdict(e, [[["cd(folder='document')", "mv(source='final_report.pdf', destination='temp')"]],
                       *g[1:]]) == (False, "multi_turn:instance_state_mismatch", 0)
    # turn 2 empty, or with only an empty step, or its call made a turn early
    assert verdict(e, [g[0], g[1], [], g[3]]) == (False, "multi_turn:empty_turn_model_response", 2)
    assert verdict(e, [g[0], g[1], [[""]], g[3]]) == (False, "multi_turn:empty_turn_model_response", 2)
    assert verdict(e, [g[0], [g[1][0] + g[2][0]], [], g[3]]) == (False, "multi_turn:empty_turn_model_response", 2)
    # ... but a result made in an earlier turn counts later: sort in turn 1 and a no-op in turn 2
    early = [g[0], [g[1][0] + g[2][0]], [["pwd()"]], g[3]]
    assert verdict(e, early) == (True, "", None)
    # a turn too few or too many (stopped during inference), not a list
    assert verdict(e, g[:3]) == (False, "multi_turn:force_terminated", None)
    assert verdict(e, g + [[]]) == (False, "multi_turn:force_terminated", None)
    assert verdict(e, "oops") == (False, "multi_turn:inference_error", None)
    suite = make_suite("bfcl:multi_turn_base:all")
    item = next(it for it in suite.items() if it.id == "multi_turn_base_0")
    assert suite.score(item, [Completion("not json"), Completion(json.dumps({"id": item.id, "result": g}))]) == [
        {"accuracy": 0.0, "reason": "multi_turn:inference_error"}, {"accuracy": 1.0, "reason": ""}]


def test_a_turn_with_no_ground_truth_is_not_checked_but_its_calls_run(entries):
    e = entries["multi_turn_miss_func_0"]  # turn 2 asks for sort, which is added in turn 3
    g = gold(e)
    assert g[2] == [] and e["ground_truth"][3] == ["sort('final_report.pdf')"]
    # calling sort before it is offered is not penalized, as long as turn 3 calls something
    assert verdict(e, [g[0], g[1], g[3], [["pwd()"]], g[4]]) == (True, "", None)
    # a call in that turn that changes the state shows at the next checked turn
    assert verdict(e, [g[0], g[1], [["mkdir(dir_name='extra')"]], g[3], g[4]]) == (
        False, "multi_turn:instance_state_mismatch", 3)


# --- calls are parsed, never evaluated ----------------------------------------------------------

def test_unsafe_call_strings_are_refused_without_running_anything(entries, monkeypatch):
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(("system", a)))
    monkeypatch.setattr(builtins, "open", lambda *a, **k: ran.append(("open", a)))
    state = ApiState.of(entries["multi_turn_base_0"])
    before = json.dumps(state.public_state(), default=repr)
    refused = ["__import__('os').system('x')", "cd(folder=open('f').read())", "cd(folder=x)",
               "cd(**{'folder': 'document'})", "cd(*['document'])", "cd(folder=f'{x}')",
               "cd(folder=['document'][0])", "cd(folder=(lambda: 'document')())", "GorillaFileSystem.cd(folder='a')",
               "cd", "'document'"]
    for text in refused:
        result = state.execute(text)
        assert result.startswith("Error during execution: not a plain call with literal arguments"), (text, result)
        with pytest.raises(UnsafeCall):
            parse_call(text)
    assert ran == [] and json.dumps(state.public_state(), default=repr) == before
    # BFCL's own errors, in its words
    assert state.execute("run(x=1)") == "Error during execution: Function call run is not allowed."
    assert state.execute("os.remove('x')") == "Error during execution: Function call remove is not allowed."
    assert state.execute("rmtree(path='/')") == "Error during execution: name 'rmtree' is not defined"
    assert state.execute("cd(fold='x')") == \
        "Error during execution: GorillaFileSystem.cd() got an unexpected keyword argument 'fold'"
    assert state.execute("cd(folder='a'") == "Error during execution: '(' was never closed (<string>, line 1)"
    assert parse_call(" sort('a.txt', )") == ("sort", ("a.txt",), {})
    assert parse_call("f(-1, x={'a': (1, 2.5)}, y=None, z=set())") == (
        "f", (-1,), {"x": {"a": (1, 2.5)}, "y": None, "z": set()})


def test_results_are_recorded_as_bfcl_records_them(entries):
    state = ApiState.of(entries["multi_turn_base_0"])
    # a dict as JSON, None as "None", a str as it is
    assert state.run(["cd(folder='document')", "pwd()", "mkdir(dir_name='temp')"]) == [
        '{"current_working_directory": "document"}', '{"current_working_directory": "/workspace/document"}',
        "None"]
    assert bfcl_apis.as_result({"a": {1, 2}}) == "{'a': {1, 2}}"  # not JSON: str()
    assert bfcl_apis.call_string("cd", {"folder": "a b", "n": 2}) == "cd(folder='a b',n=2)"


def test_heavy_math_is_refused_and_precision_does_not_leak(entries):
    math_item = next(e for e in entries.values() if "MathAPI" in e["involved_classes"])
    state = ApiState.of(math_item)
    prec = decimal.getcontext().prec
    assert state.execute("square_root(number=2, precision=5)") == "{'result': Decimal('1.4142')}"
    assert decimal.getcontext().prec == prec  # MathAPI set it to 5 inside the call only
    assert "over 10,000" in state.execute("square_root(number=2, precision=1000000000)")
    assert "over 10,000" in state.execute("logarithm(value=2, base=10, precision=100000)")
    assert "over 10,000" in state.execute("logarithm(value=2, base=10, precision=1e9)")
    assert "bits" in state.execute("power(base=10, exponent=1000000000)")
    assert state.execute("power(base=2, exponent=10)") == '{"result": 1024}'


def test_calls_whose_cost_grows_with_an_argument_are_answered_at_once(entries):
    """Issue 50: round_number(number=5, decimal_places=-1000000000) (30 tokens) computed
    10**1000000000 for minutes, holding the GIL; it and every other call that grows so is answered
    an error naming the bound, at once; the same calls within the bounds run as BFCL runs them."""
    from tests.hang import hang_guard

    state = ApiState(["MathAPI", "GorillaFileSystem", "MessageAPI"], {"GorillaFileSystem": {"root": {"w": {
        "type": "directory", "contents": {"d": {"type": "directory", "contents": {"f": {"type": "file", "content": "x"}}}}}}}})
    hex_int = "0x" + "f" * 300_000  # 1,200,000 bits: a literal as long as its text
    with hang_guard(60, "guarded calls"):
        assert state.execute("round_number(number=5, decimal_places=-1000000000)") == (
            "Error during execution: round_number: decimal_places=-1000000000 is below -301,029, the fewest "
            "this evaluation rounds an integer to (10**1000000000 has over 1,000,000 bits)")
        assert state.execute("round_number(number=True, decimal_places=-1000000000)").startswith(
            "Error during execution: round_number: decimal_places=-1000000000 is below")  # a bool is an int
        assert state.execute("round_number(number=15, decimal_places=-1)") == '{"result": 20}'
        assert state.execute("round_number(number=5, decimal_places=-301029)") == '{"result": 0}'  # the bound runs
        assert state.execute("round_number(number=5.5, decimal_places=-1000000000)") == '{"result": 0.0}'  # a float: O(1)
        assert state.execute(f"round_number(number={hex_int}, decimal_places=-3)") == (
            "Error during execution: round_number: number has over 1,000,000 bits, more than this evaluation "
            "rounds to negative decimal places")
        assert state.execute(f"multiply(a={hex_int}, b=3)") == (
            "Error during execution: multiply: <an integer of 1,200,000 bits>*3 has over 1,000,000 bits, more "
            "than this evaluation computes")
        assert state.execute("multiply(a=6, b=7)") == '{"result": 42}'
        # cp of a directory shares its subdirectories: 7 calls double what find and du walk
        double = ["mkdir(dir_name='n')", "cp(source='d', destination='n')", "cd(folder='n')",
                  "cp(source='d', destination='e')", "cd(folder='..')", "rm(file_name='d')",
                  "mv(source='n', destination='d')"]
        state.run(["cd(folder='w')"] + double * 17)  # 2**17 paths to f
        for call in ("find(path='.')", "du()"):
            assert state.execute(call) == (
                f"Error during execution: {call.split('(')[0]}: the tree it would walk has over 100,000 entries "
                "(directories copied into one another), more than this evaluation walks")
        assert state.execute("find(path='" + "/".join(["d"] * 16) + "')").count("/f") == 4  # a small part: it runs
        messages = state.instances["MessageAPI"]
        messages.generated_ids = set(range(10_000, 100_000))
        assert state.execute("send_message(receiver_id='USR002', message='hi')") == (
            "Error during execution: send_message: all 90,000 message ids are taken (MessageAPI would draw "
            "a free one forever)")


class PowerUnguarded(mt.BFCLMultiTurn):
    """BFCL multi-turn with MathAPI.power's guard taken out while it scores: power(base=3,
    exponent=10**12) computes in C holding the GIL for hours, as a path no guard foresaw would."""

    def score(self, item, completions):
        guard = bfcl_apis.GUARDS.pop(("MathAPI", "power"))
        try:
            return super().score(item, completions)
        finally:
            bfcl_apis.GUARDS[("MathAPI", "power")] = guard


def test_a_call_stuck_in_c_costs_its_sample_its_limit_and_the_eval_goes_on(tmp_path, monkeypatch):
    """Issue 50: ``gdpo-ray eval --suite bfcl:multi_turn_base --completions`` sat at "score 0%"
    until killed at 420 s. Now a guarded call (round_number) is answered at once and its
    trajectory scores as BFCL's rules say (valid: the extra call's error changes no state), and a
    call that computes in C is killed with its scoring process at the sample's limit: that sample
    scores 0 with the timeout, the others score, and the eval ends."""
    from gdpo_ray.eval.report import read_report
    from gdpo_ray.eval.suites import SUITES
    from gdpo_ray.run import eval_runner
    from gdpo_ray.run.cli import main
    from tests.hang import hang_guard

    monkeypatch.setattr(SUITES, "_entries", dict(SUITES._entries, bfcl=lambda spec, **o: PowerUnguarded(spec, **o)))
    monkeypatch.setattr(eval_runner, "SAMPLE_TIMEOUT_S", 2.0)
    suite = make_suite("bfcl:multi_turn_base")
    ids = ["multi_turn_base_36", "multi_turn_base_57", "multi_turn_base_59", "multi_turn_base_134"]  # with MathAPI
    golds = {i: gold(next(it for it in suite.items() if it.id == i).reference.entry) for i in ids}
    rounding, stuck = golds["multi_turn_base_36"], golds["multi_turn_base_57"]
    rounding[0] = [["round_number(number=5, decimal_places=-1000000000)"], *rounding[0]]
    stuck[0] = [["power(base=3, exponent=1000000000000)"], *stuck[0]]
    path, out = tmp_path / "c.jsonl", tmp_path / "r.json"
    path.write_text("".join(json.dumps({"id": i, "completions": [mt.completion_text(golds[i])]}) + "\n" for i in ids))
    start = time.monotonic()
    with hang_guard(120, "scoring a call stuck in C"):
        assert main(["eval", "--suite", "bfcl:multi_turn_base", "--completions", str(path), "--output", str(out)]) == 0
    took = time.monotonic() - start
    report = read_report(out)
    samples = {i: report["items"][i]["samples"][0] for i in ids}
    assert {i: (s["accuracy"], s.get("error")) for i, s in samples.items()} == {
        "multi_turn_base_36": (1.0, None), "multi_turn_base_57": (0.0, "timeout: scoring took over 2 s"),
        "multi_turn_base_59": (1.0, None), "multi_turn_base_134": (1.0, None)}
    assert report["errors"] == [{"item": "multi_turn_base_57", "sample": 0, "error": "timeout: scoring took over 2 s"}]
    print(f"the eval took {took:.1f} s with a 2 s limit")


def test_tool_docs_hold_out_the_missed_functions_until_their_turn():
    tools, added = tool_docs(["TwitterAPI", "GorillaFileSystem"], {"3": ["sort"]})
    assert list(added) == [3] and [d["name"] for d in added[3]] == ["sort"]
    assert "sort" not in [d["name"] for d in tools] and len(tools) == 14 + 18 - 1  # 14 + 18 docs, one held out
    assert all(d["description"].endswith(bfcl_apis.PYTHON_HINT) for d in tools)
    assert not added[3][0]["description"].endswith(bfcl_apis.PYTHON_HINT)  # BFCL adds none to it
    everything, none = tool_docs(["GorillaFileSystem"])  # excluded_function is ignored, as BFCL does
    assert none == {} and "cp" in [d["name"] for d in everything]


def test_the_miss_func_prompt_pieces(entries):
    item = next(it for it in make_suite("bfcl:multi_turn_miss_func").items() if it.id == "multi_turn_miss_func_0")
    ref = item.reference
    assert ref.turns[3] == [{"role": "user", "content": added_functions_message()}]
    assert ref.turns[0] == entries["multi_turn_miss_func_0"]["question"][0]
    # the prompt is the first turn; its tools go to the chat template (the environment's
    # tool_schemas), the missed one held back until its turn
    assert item.prompt == ref.turns[0]
    names = [d["name"] for d in ref.tools]
    assert "cd" in names and "sort" not in names and [d["name"] for d in ref.added_tools[3]] == ["sort"]
    assert make_suite("bfcl:multi_turn_miss_func").environment_row(item) == {"bfcl_entry": json.dumps(ref.entry)}


# --- the split ----------------------------------------------------------------------------------

def test_the_held_out_split_is_by_scenario_and_eval_leaves_training_items_out():
    held = [n for n in range(200) if is_held_out(f"multi_turn_base_{n}")]
    assert len(held) == 41 and held[:8] == [4, 8, 13, 18, 24, 36, 51, 56]
    assert all(is_held_out(f"{c}_{n}") for c in mt.CATEGORIES for n in held)
    base = make_suite("bfcl:multi_turn_base")
    assert base.name == "bfcl:multi_turn_base" and [scenario_of(it.id) for it in base.items()] == held
    assert len(make_suite("bfcl:multi_turn_base:train").items()) == 159
    assert len(make_suite("bfcl:multi_turn_long_context").items()) == 200
    assert make_suite("bfcl:multi_turn_long_context:held_out").name == "bfcl:multi_turn_long_context:held_out"
    with pytest.raises(ValueError, match="the split must be one of held_out, train, all"):
        make_suite("bfcl:multi_turn_base:test")
    with pytest.raises(ValueError, match="only the multi-turn categories take a split"):
        make_suite("bfcl:simple_python:all")


def test_completions_through_the_cli(tmp_path):
    from gdpo_ray.eval.report import read_report
    from gdpo_ray.run.cli import main

    item = make_suite("bfcl:multi_turn_base").items()[0]
    g = gold(item.reference.entry)
    texts = [mt.completion_text(g), mt.completion_text(g[:-1]), "[[[" * 100_000]
    path, out = tmp_path / "c.jsonl", tmp_path / "r.json"
    path.write_text(json.dumps({"id": item.id, "completions": texts}) + "\n")
    assert main(["eval", "--suite", "bfcl:multi_turn_base", "--completions", str(path), "--output", str(out)]) == 0
    samples = read_report(out)["items"][item.id]["samples"]
    assert [(s["accuracy"], s["reason"]) for s in samples] == [
        (1.0, ""), (0.0, "multi_turn:force_terminated"), (0.0, "multi_turn:inference_error")]


# --- against BFCL's own checker -----------------------------------------------------------------

def _render(name, args, kwargs):
    return f"{name}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value[:-1]
    return None


def call_variants(call):
    """A call with its first argument's value changed, and with its first two argument values
    swapped (where it has two)."""
    name, args, kwargs = parse_call(call)
    out = []
    if kwargs:
        key = next(iter(kwargs))
        out.append(_render(name, args, {**kwargs, key: _changed(kwargs[key])}))
        if len(kwargs) > 1:
            keys = list(kwargs)
            swapped = dict(kwargs, **{keys[0]: kwargs[keys[1]], keys[1]: kwargs[keys[0]]})
            out.append(_render(name, args, swapped))
    elif args:
        out.append(_render(name, (_changed(args[0]), *args[1:]), {}))
    return out


def perturbations(entry):
    """Trajectories around the ground truth: itself (one step per turn, one step per call); a call
    dropped, changed, its values swapped, duplicated, renamed; a turn's calls reversed, emptied
    ([], [[]], [[""]]), moved to the next turn or merged into the one before; calls made in a turn
    with no ground truth; an unknown call added; a turn too few or too many; malformed layouts."""
    truth = entry["ground_truth"]
    g = gold(entry)
    out = [g, [[[c] for c in calls] for calls in truth]]

    def with_turn(t, steps):
        return [steps if i == t else s for i, s in enumerate(g)]

    for t, calls in enumerate(truth):
        for i, call in enumerate(calls):
            out.append(with_turn(t, [calls[:i] + calls[i + 1:]]))
            out += [with_turn(t, [calls[:i] + [v] + calls[i + 1:]]) for v in call_variants(call)]
            out.append(with_turn(t, [calls[:i + 1] + [call] + calls[i + 1:]]))
            out.append(with_turn(t, [calls[:i] + ["x" + call] + calls[i + 1:]]))
        if len(calls) > 1:
            out.append(with_turn(t, [calls[::-1]]))
        out.append(with_turn(t, [[], [[]], [[""]]][t % 3]))
        out.append(with_turn(t, [["ls(a=True)", "pwd()"], *g[t]]))
        if t + 1 < len(truth):
            moved = [list(s) for s in g]
            moved[t], moved[t + 1] = [[c] for c in calls[1:]], [[calls[0]] if calls else [], *g[t + 1]]
            out.append(moved)
            if not calls:  # a turn with no ground truth: the next turn's calls made there too
                out.append(with_turn(t, g[t + 1]))
        if t > 0:
            merged = [list(s) for s in g]
            merged[t - 1], merged[t] = [list(truth[t - 1]) + list(calls)], []
            out.append(merged)
    out += [g[:-1], g + [[["pwd()"]]], "not a list", [str(s) for s in g], [[json.dumps(s)] for s in g],
            [[[1, 2]] + s for s in g]]
    return out


def execution_calls(entry, rng):
    """Every ground-truth call, then calls whose results are errors, in BFCL's words."""
    calls = [c for turn in entry["ground_truth"] for c in turn]
    some = rng.choice(calls)
    name = some.split("(")[0]
    return calls + [name + "_v2()", name + "(unexpected=1)", name + "(", "quit()", f" {some}", some + " ",
                    f"{name}(1, 2, 3, 4, 5, 6)", some.replace("(", "(  ", 1), "pwd()", "ls()"]


def bfcl_answers(python, cases):
    lines = "".join(json.dumps(c) + "\n" for c in cases)
    done = subprocess.run([python, str(Path(__file__).with_name("bfcl_multi_turn_checker.py"))], input=lines,
                          capture_output=True, text=True, check=False, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(v) for v in done.stdout.splitlines()]
    assert len(answers) == len(cases)
    return answers


@pytest.mark.bfcl
def test_verdicts_results_and_docs_equal_bfcls_own(entries):
    python = os.environ.get("GDPO_BFCL_PYTHON")
    if not python:
        pytest.skip("set GDPO_BFCL_PYTHON to .venv-bfcl's python: scripts/test-bfcl-checker.sh")
    rng = random.Random(0)
    checks = [{"kind": "check", "id": i, "result": r} for i, e in entries.items() for r in perturbations(e)]
    runs = [{"kind": "execute", "id": i, "calls": execution_calls(e, rng)} for i, e in entries.items()]
    docs = [{"kind": "docs", "id": i} for i in entries]
    theirs = bfcl_answers(python, checks + runs + docs)

    ours = [verdict(entries[c["id"]], c["result"])[:2] for c in checks]
    bfcls = [(a["valid"], a["error_type"]) for a in theirs[:len(checks)]]
    differ = [(c["id"], c["result"], o, t) for c, o, t in zip(checks, ours, bfcls) if o != t]
    assert not differ, f"{len(differ)} of {len(checks)} verdicts differ, e.g. {differ[:3]}"
    reasons = {t[1] for t in bfcls}
    assert reasons == {"", "multi_turn:inference_error", "multi_turn:force_terminated",
                       "multi_turn:empty_turn_model_response", "multi_turn:instance_state_mismatch",
                       "multi_turn:execution_response_mismatch"}
    assert 0.2 < sum(v for v, _ in bfcls) / len(bfcls) < 0.8 and len(checks) > 20_000

    results = theirs[len(checks):len(checks) + len(runs)]
    differ = [(r["id"], c, o, t) for r, res in zip(runs, results)
              for c, o, t in zip(r["calls"], ApiState.of(entries[r["id"]]).run(r["calls"]), res) if o != t]
    assert not differ, f"{len(differ)} call results differ, e.g. {differ[:3]}"

    for d, answer in zip(docs, theirs[len(checks) + len(runs):]):
        e = entries[d["id"]]
        tools, added = tool_docs(e["involved_classes"], e.get("missed_function"))
        assert tools == answer["function"], d["id"]
        assert {str(k): v for k, v in added.items()} == answer["missed_function"], d["id"]
