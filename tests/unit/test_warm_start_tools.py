"""The warm starts: the tool-calling model's tokenizer, its mediocre teacher (exact scores of each
slip, its rates over many draws), the shared fitting loop, and the cache of ``demo-tools``."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from gdpo_ray.models import demo, demo_tools, warm_start
from gdpo_ray.models.demo_tools import NEXT_TOOL, RECIPE, TAGS, slip, teacher_response, wrong_arguments
from gdpo_ray.rewards import get
from gdpo_ray.sft import response_loss
from gdpo_ray.tasks import tool_calls

fmt, correct = get("toolrl_format"), get("toolrl_correctness")
#: rows of task:tool_calls (seed 0) with every kind of request
ROWS = tool_calls(16, 0)


def scores(responses, golds):
    return (fmt([None] * len(golds), responses, ground_truth=golds),
            correct([None] * len(golds), responses, ground_truth=golds))


def answer(calls):
    return "<think>x</think>\n<tool_call>\n" + "\n".join(
        json.dumps({"name": n, "parameters": p}) for n, p in calls) + "\n</tool_call>"


def gold_of(kind):
    from gdpo_ray.tool_format import calls_in

    for row in ROWS:
        calls = calls_in(row["ground_truth"]) or []
        if kind == "pair" and len(calls) == 2 or calls and len(calls) == 1 and calls[0][0] == kind:
            return row["ground_truth"], calls
    raise AssertionError(kind)


# R = 6 R_max / S_max - 3, S_max = 1 + |G| + sum |keys(G_j)|, R_max = name Jaccard + pair scores
# (a pair's score: key Jaccard + the gold arguments with equal values)
@pytest.mark.parametrize("kind, slipped, expected", [
    # S_max = 1 + 1 + 2 = 4; other unit: R_max = 1 + (1 + 1) = 3 -> 6*3/4 - 3
    ("get_weather", "arguments", 1.5),
    # S_max = 1 + 2 + 4 = 7; both units wrong: R_max = 1 + 2 * (1 + 1) = 5 -> 6*5/7 - 3
    ("pair", "arguments", 6 * 5 / 7 - 3),
    # second call missing: names [w] vs [w, w] = 1/2, one pair 1 + 2 -> 6*3.5/7 - 3
    ("pair", "missing", 0.0),
    # S_max = 1 + 1 + 3 = 5; currencies swapped, amount right: R_max = 1 + (1 + 1) = 3 -> 6*3/5 - 3
    ("convert_currency", "arguments", 0.6),
    # S_max = 1 + 1 + 1 = 3; an extra seconds: keys 1/2, minutes 1 -> R_max = 2.5 -> 6*2.5/3 - 3
    ("set_timer", "arguments", 2.0),
    # S_max = 1 + 1 + 2 = 4; max_results left out: keys 1/2, ingredient 1 -> R_max 2.5 -> 6*2.5/4 - 3
    ("search_recipes", "arguments", 0.75),
    # no name in common: R_max = 0 -> -3
    ("get_weather", "tool", -3.0),
    ("set_timer", "tool", -3.0),
])
def test_each_slip_scores_as_designed(kind, slipped, expected):
    gold, calls = gold_of(kind)
    if slipped == "arguments":
        wrong = [(n, wrong_arguments(n, p)) for n, p in calls]
    elif slipped == "tool":
        wrong = [(NEXT_TOOL[n], p) for n, p in calls]
    else:
        wrong = calls[:1]
    assert scores([answer(calls), answer(wrong)], [gold, gold]) == ([1.0, 1.0], [3.0, pytest.approx(expected)])


def test_slip_draws_only_the_mistakes_that_apply():
    rng = np.random.default_rng(0)
    _, single = gold_of("set_timer")
    _, pair = gold_of("pair")
    singles = {json.dumps(slip(single, rng)) for _ in range(200)}
    pairs = {json.dumps(slip(pair, rng)) for _ in range(200)}
    assert len(singles) == 2 and len(pairs) == 3  # arguments, tool (+ the missing call of a pair)
    assert json.dumps(pair[:1]) in pairs and json.dumps(single) not in singles


def test_the_teachers_rates_are_as_designed():
    rows = tool_calls(2000, 0)
    golds = [r["ground_truth"] for r in rows]
    has_calls = np.array(["<tool_call>" in g for g in golds])

    def teach(p_format, p_correct, seed=0):
        rng = np.random.default_rng(seed)
        return scores([teacher_response(g, rng, p_format, p_correct) for g in golds], golds)

    # the extremes are exact: the layout and the calls are right exactly when drawn so
    f, c = teach(1.0, 1.0)
    assert f == [1.0] * len(rows) and c == [3.0 if h else 0.0 for h in has_calls]
    f, c = teach(0.0, 0.0)
    assert f == [0.0] * len(rows) and max(c) < 3.0
    assert set(np.round(c, 3)) == {-3.0, 0.0, 0.6, 0.75, 1.286, 1.5, 2.0}  # the slips, and no tool: 0
    # the format faults leave the calls as they are: the same draws before the layout (one
    # generator per row), the same correctness
    def calls_only(p_format):
        return [teacher_response(g, np.random.default_rng([5, i]), p_format, 0.5) for i, g in enumerate(golds)]

    assert scores(calls_only(1.0), golds)[1] == scores(calls_only(0.0), golds)[1]
    # the recipe's rates over 2000 draws: within 3 standard deviations of the design
    f, c = teach(RECIPE["p_format"], RECIPE["p_correct"])
    sd = (0.25 / len(rows)) ** 0.5
    assert abs(np.mean(f) - RECIPE["p_format"]) < 3 * sd
    right = np.array(c)[has_calls] == 3.0
    assert abs(right.mean() - RECIPE["p_correct"]) < 3 * (0.25 / has_calls.sum()) ** 0.5
    assert -1.0 < np.mean(c) < 1.0  # well below the maximum of 3, with room for RL


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tools")
    demo_tools.build_untrained(path, RECIPE | {"hidden_size": 32})
    return path, AutoTokenizer.from_pretrained(path)


def test_the_tool_tokenizer_keeps_a_prompt_short(tool_tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    from gdpo_ray.eval.task_suites import EVAL_SEED
    from gdpo_ray.run.presets import load_preset

    _, tok = tool_tokenizer
    preset = load_preset("study_tool_calling")
    rows = tool_calls(preset["data"]["num_prompts"], 0) + tool_calls(64, EVAL_SEED)
    prompts = [warm_start.chat_prompt_ids(tok, r["prompt"]) for r in rows]
    assert max(map(len, prompts)) <= min(preset["llm"]["max_prompt_tokens"], 272)
    assert max(len(tok(r["ground_truth"])["input_ids"]) for r in rows) <= 60
    rng = np.random.default_rng(0)  # the teacher's longest answers (the extra block) fit too
    longest = max(len(warm_start.response_ids(tok, teacher_response(r["ground_truth"], rng, 0.0, 0.0)))
                  for r in rows)
    assert longest <= preset["generation"]["max_tokens"]
    # the default tiny tokenizer would take over 600 tokens for the same prompt
    default = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(warm_start.chat_prompt_ids(default, rows[0]["prompt"])) > 600
    for tag in TAGS:
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    text = rows[1]["ground_truth"]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_the_tokenizer_is_cut_into_pieces_as_it_was_trained(tool_tokenizer):
    """transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer, which imposes its own
    pre-tokenizer: the merges were learnt on the same pieces, so tokenizer.json's tokenizer and
    the loaded one agree on every text."""
    from tokenizers import Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from gdpo_ray.models.tiny import QWEN2_PATTERN

    assert QWEN2_PATTERN == PRETOKENIZE_REGEX
    path, tok = tool_tokenizer
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    for row in tool_calls(64, 7):
        for text in (row["prompt"][0]["content"], row["prompt"][1]["content"],
                     teacher_response(row["ground_truth"], rng, 0.5, 0.5)):
            assert raw.encode(text, add_special_tokens=False).ids == tok(text, add_special_tokens=False)["input_ids"]


def test_the_default_tiny_tokenizer_is_unchanged(tiny_model_dir):
    """The demo's numbers depend on it. The hash of its vocabulary, merges and pre-tokenizer,
    from build_tiny_model's defaults (tokenizers 0.23.3)."""
    t = json.loads((Path(tiny_model_dir) / "tokenizer.json").read_text())
    blob = json.dumps([t["model"]["vocab"], t["model"]["merges"], t["pre_tokenizer"]], sort_keys=True)
    assert hashlib.sha256(blob.encode()).hexdigest() == "8e6a32a404161e64bcf06f82f95ac9d41efe1f4439b949b348ce6662114e2d7c"


def test_the_demos_cache_key_is_unchanged(tmp_path):
    built = []
    path = warm_start.cached_model("demo-addition", demo.RECIPE, lambda p, r: built.append(p), tmp_path)
    assert path == tmp_path / "demo-addition-bea00c087ac9" and len(built) == 1  # the docs' numbers come from it


def test_a_shared_prefix_gives_the_loss_and_gradients_of_whole_prompts(tool_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    path, tok = tool_tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = np.random.default_rng(0)
    examples = [(warm_start.chat_prompt_ids(tok, r["prompt"]),
                 warm_start.response_ids(tok, teacher_response(r["ground_truth"], rng, 0.5, 0.5)))
                for r in ROWS[:5]]
    shared = next(i for i, ids in enumerate(zip(*(p for p, _ in examples))) if len(set(ids)) > 1)
    assert shared > 200  # the system message

    def loss_and_grads(*args):
        model.zero_grad()
        loss = response_loss(model, *args)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    whole = loss_and_grads(examples, tok.pad_token_id)
    split = loss_and_grads([(p[shared:], t) for p, t in examples], tok.pad_token_id, examples[0][0][:shared])
    assert split[0] == pytest.approx(whole[0], rel=1e-5)
    for a, b in zip(whole[1], split[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


SMALL = dict(hidden_size=32, rows=16, clean_steps=2, steps=1, batch_size=2)


def test_demo_tools_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from gdpo_ray.model_files import resolve_model_path
    from gdpo_ray.run.preflight import check_model, context_length
    from gdpo_ray.models.tiny import MAX_POSITIONS

    monkeypatch.setenv("GDPO_RAY_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_tools, "RECIPE", RECIPE | SMALL)
    path = resolve_model_path("demo-tools")
    assert path.parent == tmp_path and path.name.startswith("demo-tools-")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # renamed into place, nothing left
    assert all(len(AutoTokenizer.from_pretrained(path)(t, add_special_tokens=False)["input_ids"]) == 1
               for t in TAGS)
    monkeypatch.setattr(demo_tools, "_warm_start", lambda *a: pytest.fail("built twice"))
    assert resolve_model_path("demo-tools") == path  # cached
    monkeypatch.setattr(demo_tools, "RECIPE", RECIPE | SMALL | {"p_format": 0.25})
    with pytest.raises(pytest.fail.Exception, match="built twice"):  # another recipe, another model
        resolve_model_path("demo-tools")
    check_model("demo-tools")  # a built-in name for the start-up checks
    assert context_length("demo-tools") == MAX_POSITIONS
