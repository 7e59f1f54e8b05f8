"""The multi-turn loop (actors/turn_loop.py, actors/tool_loop.py) on a scripted engine: what a policy that calls
tools produces, token for token. The engine here replays fixed token ids (the sampled tokens a
policy could have produced, including a non-canonical tokenization); everything else is real:
the tiny model's tokenizer and chat template, the environment, the parser, the sessions."""

import asyncio
from pathlib import Path

import pytest

from actors.engines import Sample, SamplingParams
from actors.tool_loop import ToolEnvironment, Trajectory
from actors.turn_loop import run_batched
from gdpo_ray.environments.tool_turns import ToolTurns
from gdpo_ray.environments.session import ToolSession
from gdpo_ray.environments.spec import load_environment
from gdpo_ray.rewards import completion_text

SPEC = "tests.unit.trl_style_environments:Calculator"


class ScriptedEngine:
    """Replays, for the rollout whose context starts with prompt k, its turns in order."""

    def __init__(self, tokenizer, prompts, scripts):
        self.tokenizer, self.prompts, self.scripts = tokenizer, prompts, scripts
        self.calls = []

    def generate(self, contexts, n, sampling, logprobs=True):
        self.calls.append((len(contexts), sampling.max_tokens))
        out = []
        for context in contexts:
            k = next(i for i, p in enumerate(self.prompts) if context[:len(p)] == p)
            ids = self.scripts[k].pop(0)[:sampling.max_tokens]
            eos = ids[-1] == self.tokenizer.eos_token_id
            out.append([Sample(ids, [-0.5] * len(ids), "stop" if eos else "length")])
        return out


def run_tool_rollouts(engine, prompt_ids, ts, sampling, max_turns, tokenizer):
    """The turn loop over trajectories whose sessions are reset already, on a batched round."""
    tools = ToolEnvironment(SPEC, tokenizer, max_turns, 5.0)
    try:
        run_batched(engine, tools, prompt_ids, ts, sampling)
    finally:
        tools.close()


def chars(tokenizer, text):
    """``text`` as one token per character: ids a policy may sample, which its tokenizer would
    never produce from the text (it merges characters)."""
    return [tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(
        tokenizer(c, add_special_tokens=False)["input_ids"])[0]) for c in text]


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def trajectories(n, row=None):
    spec = load_environment(SPEC)
    out = []
    for _ in range(n):
        session = ToolSession(spec.new(), spec.tools)
        session.reset(row or {"target": 3})
        out.append(Trajectory(session))
    return out


def test_a_trajectory_is_the_sampled_tokens_and_the_tool_turns_never_re_tokenized(tokenizer):
    eos = tokenizer.eos_token_id
    call = '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>'
    turn1 = chars(tokenizer, call) + [eos]
    turn2 = tokenizer("The memory is 3.", add_special_tokens=False)["input_ids"] + [eos]
    assert tokenizer(tokenizer.decode(turn1), add_special_tokens=False)["input_ids"] != turn1  # re-encoding differs
    prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Put 3 in memory."}],
                                                     add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tokenizer, [prompt], [[turn1, turn2]])
    (t,) = trajectories(1)
    turns = ToolTurns(tokenizer)
    run_tool_rollouts(engine, [prompt], [t], SamplingParams(max_tokens=200), 4, tokenizer)
    tool_turn = tokenizer("\n<|im_start|>tool\nmemory = 3<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)["input_ids"]
    assert turns.ids([("add", "memory = 3")]) == tool_turn
    assert t.tokens == turn1 + tool_turn + turn2  # exactly the sampled ids, then the tool turn's
    assert t.mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    assert t.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool_turn) + [-0.5] * len(turn2)
    assert (t.turns, t.tool_calls, t.tool_errors, t.finish_reason) == (2, 1, 0, "stop")
    assert t.messages == [{"role": "assistant", "content": call},
                          {"role": "tool", "name": "add", "content": "memory = 3"},
                          {"role": "assistant", "content": "The memory is 3."}]
    assert t.session.rewards(["state"], "get_rewards") == [(1.0, "", "")]
    # the whole conversation as the template writes it is the prompt and the trajectory, token for
    # token, where the model's tokens are the template's own (not where it sampled characters)
    assert engine.calls == [(1, 200), (1, 200 - len(turn1) - len(tool_turn))]


def test_rollouts_end_on_an_answer_max_turns_or_the_budget_and_errors_are_counted(tokenizer):
    eos = tokenizer.eos_token_id
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    good = enc('<tool_call>{"name": "add", "arguments": {"value": 1}}</tool_call>') + [eos]
    bad = enc('<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
              '<tool_call>not json</tool_call>') + [eos]
    answer = enc("Done.") + [eos]
    prompts = [enc(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n") for i in range(4)]
    scripts = [
        [good, answer],  # one call, then the answer
        [bad, bad, bad, answer],  # errors every turn: stopped at max_turns = 3
        [answer],  # no call at all: a single-turn rollout
        [good, good, good, good],  # calls until the budget cannot hold another tool turn
    ]
    engine = ScriptedEngine(tokenizer, prompts, scripts)
    ts = trajectories(4)
    run_tool_rollouts(engine, prompts[:3], ts[:3], SamplingParams(max_tokens=2000), 3, tokenizer)
    tool_turn = len(ToolTurns(tokenizer).ids([("add", "memory = 1")]))
    budget = 3 * len(good) + 2 * tool_turn + 5  # room for 3 turns and 2 tool turns, not a third
    run_tool_rollouts(engine, prompts[3:], ts[3:], SamplingParams(max_tokens=budget), 9, tokenizer)
    assert [(t.turns, t.tool_calls, t.tool_errors, t.finish_reason) for t in ts] == [
        (2, 1, 0, "stop"), (3, 4, 4, "stop"), (1, 0, 0, "stop"), (3, 3, 0, "length")]  # max_turns: the 3rd turn's calls do not run
    assert ts[1].messages[1]["content"].startswith("Error: there is no tool 'launch'")
    assert ts[1].messages[2]["content"].startswith("Error: the tool call is not valid JSON: 'not json'")
    assert ts[2].mask == [1] * len(answer) and ts[2].messages == [{"role": "assistant", "content": "Done."}]
    assert len(ts[3].tokens) == 3 * len(good) + 2 * tool_turn <= budget
    assert ts[3].mask[-1] == 1  # ended on the model's turn: the tool turn that did not fit is rolled back
    assert ts[3].messages[-1]["role"] == "assistant" and len(ts[3].messages) == 5
    assert [c[0] for c in engine.calls] == [3, 2, 1, 1, 1, 1]  # each round generates the rollouts still going


def completion_roles(prompts, completions, **_):
    """A TRL-style reward on the whole conversation: 1 per tool message in the completion."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


def memory_left(environments, **kwargs):
    """TRL's way to score with environment state: read the instances (None: failed to start)."""
    return [None if env is None else env.memory for env in environments]


def broken_reader(environments, completions, **kwargs):
    raise RuntimeError(f"cannot read {len(environments)} environments")


CALL = '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>'
#: a column of each kind: a function of the conversation, the environment's own, one conditioned
#: on it, a function reading the instances, and one that raises
READER_REWARDS = [{"name": "tools_used", "fn": "tests.unit.test_tool_loop:completion_roles"},
                  {"name": "state", "fn": "environment"},
                  {"name": "memory_used", "fn": "environment", "condition": {"on": "state", "min": 1}},
                  {"name": "memory", "fn": "tests.unit.test_tool_loop:memory_left"},
                  {"name": "broken", "fn": "tests.unit.test_tool_loop:broken_reader"}]


def scripted_actor(model_dir):
    """A rollout actor whose policy calls ``add(3)``, then says "Done.", with ``READER_REWARDS``."""
    from actors.rollout import RolloutActor

    return RolloutActor(model_dir, READER_REWARDS, group_size=2, engine="tests.unit.scripted_engine:ScriptedEngine",
                        engine_kwargs={"script": [CALL, "Done."]}, sampling={"max_tokens": 200},
                        environment=SPEC, max_turns=4, tool_timeout=5, max_prompt_tokens=4096)


def test_a_rollout_actor_records_multi_turn_groups_with_environment_rewards(tiny_model_dir):
    import numpy as np

    from actors.prompts import Prompt

    call, actor = CALL, scripted_actor(tiny_model_dir)
    try:
        prompts = [Prompt("0", 0, 0, 0, [{"role": "user", "content": "Put 3 in memory."}], {"target": 3}),
                   Prompt("1", 1, 0, 0, "Put 5 in memory.", {"target": 5})]
        meta, batch = asyncio.run(actor.generate(prompts))
    finally:
        asyncio.run(actor.shutdown())
    tok = actor.tokenizer
    assert batch.column("num_turns").to_pylist() == [2] * 4
    assert batch.column("num_tool_calls").to_pylist() == [1] * 4
    assert batch.column("tool_errors").to_pylist() == [0] * 4
    masks = batch.column("response_mask").to_pylist()
    tokens = batch.column("response_token_ids").to_pylist()
    first = len(tok(call, add_special_tokens=False)["input_ids"]) + 1
    assert all(m[:first] == [1] * first and 0 in m and m[-1] == 1 for m in masks)
    assert [lp for lp, m in zip(batch.column("response_logprobs").to_pylist()[0], masks[0]) if not m] == [0.0] * masks[0].count(0)
    assert tok.decode([t for t, m in zip(tokens[0], masks[0]) if not m]) == \
        "\n<|im_start|>tool\nmemory = 3<|im_end|>\n<|im_start|>assistant\n"
    # the reset text is appended to the prompt's last message (TRL's rule), each rollout's own
    prompt = tok.decode(batch.column("prompt_token_ids").to_pylist()[0])
    assert "Put 3 in memory.The memory starts at 0.<|im_end|>" in prompt
    values = batch.column("rewards").flatten().to_numpy().reshape(4, 5)
    # tools_used: one tool message each; state: memory 3 == target 3 in prompt 0, 3 != 5 in prompt 1;
    # memory_used is paid only where state >= 1; memory: read off each rollout's own instance
    np.testing.assert_array_equal(values[:, :4], [[1, 1, 1, 3], [1, 1, 1, 3], [1, 0, 0, 3], [1, 0, 0, 3]])
    assert np.isnan(values[:, 4]).all()  # a reward reading the environments that raises: NaN, with why
    assert batch.column("reward_errors").to_pylist()[0][4] == "error: RuntimeError: cannot read 1 environments"
    assert [g.turns.tolist() for g in meta.groups] == [[[2, 1, 0, 0]] * 2] * 2


def test_evaluation_completes_and_scores_rollouts_as_training_does(tiny_model_dir):
    """Issue 48: ``complete(score=True)`` runs each held-out row through the multi-turn loop and
    scores every column as ``generate`` does: the environment's own, the conditioned one and the
    rewards that read the instances; its turns, calls and conversation come back with it."""
    import math

    actor = scripted_actor(tiny_model_dir)
    try:
        prompts = ["Put 3 in memory.", "Put 5 in memory.", "x" * 5000]  # the third: over max_prompt_tokens
        done = asyncio.run(actor.complete(prompts, 2, {"max_tokens": 200}, rows=[{"target": 3}, {"target": 5}, {"target": 1}],
                              score=True))
        unscored = asyncio.run(actor.complete(prompts[:1], 1, {"max_tokens": 200}, rows=[{"target": 3}]))
    finally:
        asyncio.run(actor.shutdown())
    assert [len(d) for d in done] == [2, 2, 2]
    first, other, skipped = done[0][0], done[1][1], done[2][0]
    assert (first.turns, first.tool_calls, first.tool_errors) == (2, 1, 0)
    assert [m["role"] for m in first.messages] == ["assistant", "tool", "assistant"]
    assert first.messages[1]["content"] == "memory = 3" and first.text == completion_text(first.messages)
    # state: memory 3 == target 3 for the first row, 3 != 5 for the second; memory_used gated on it
    assert {k: v for k, v in first.rewards.items() if k != "broken"} == {
        "tools_used": 1.0, "state": 1.0, "memory_used": 1.0, "memory": 3.0}
    assert (other.rewards["state"], other.rewards["memory_used"]) == (0.0, 0.0)
    assert math.isnan(first.rewards["broken"])
    assert first.reward_errors == {"broken": "error: RuntimeError: cannot read 1 environments"}  # 2 rows x 2
    assert skipped.finish_reason == "prompt_too_long" and skipped.rewards is None
    assert unscored[0][0].rewards is None and unscored[0][0].turns == 2


def test_a_template_without_tools_shows_them_in_the_system_message(tiny_model_dir):
    """Issue 48: the tiny model's ChatML template ignores tools=; the prompt the actor renders
    holds every tool's name and schema and the call format, in the system message."""
    import json

    from actors.rollout import RolloutActor
    from gdpo_ray.environments.tool_prompt import CALL_FORMAT, template_lists_tools

    actor = RolloutActor(tiny_model_dir, None, group_size=2, engine="tests.unit.scripted_engine:ScriptedEngine",
                         engine_kwargs={"script": ["Done."]}, environment=SPEC, max_prompt_tokens=4096,
                         system_prompt="Be brief.")
    never = RolloutActor(tiny_model_dir, None, group_size=2, engine="tests.unit.scripted_engine:ScriptedEngine",
                         engine_kwargs={"script": ["Done."]}, environment=SPEC, tools_in_system_prompt="never")
    try:
        assert not template_lists_tools(actor.tokenizer)
        text = actor.tokenizer.decode(actor.tokenize("Put 3 in memory."))
        plain = never.tokenizer.decode(never.tokenize("Put 3 in memory."))
    finally:
        asyncio.run(actor.shutdown())
        asyncio.run(never.shutdown())
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call the tools below.")
    for schema in load_environment(SPEC).schemas:  # every name and its whole schema
        assert json.dumps(schema) in system and schema["function"]["name"] in system
    assert CALL_FORMAT in system and '<tool_call>\n{"name": "add", "arguments": {"value": 1.5}}\n</tool_call>' in system
    assert text.endswith("<|im_start|>user\nPut 3 in memory.<|im_end|>\n<|im_start|>assistant\n")
    assert "add" not in plain and plain.startswith("<|im_start|>user\n")  # never: the template's way only


def test_an_environment_that_fails_to_start_costs_only_its_rollouts_environment_rewards(tiny_model_dir):
    import math

    from actors.prompts import Prompt
    from actors.rollout import RolloutActor

    call = '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>'
    rewards = [{"name": "tools_used", "fn": "tests.unit.test_tool_loop:completion_roles"},
               {"name": "state", "fn": "environment"}, {"name": "memory_used", "fn": "environment", "weight": 0}]
    actor = RolloutActor(tiny_model_dir, rewards, group_size=2, engine="tests.unit.scripted_engine:ScriptedEngine",
                         engine_kwargs={"script": [call, "Done."]}, sampling={"max_tokens": 200},
                         environment="tests.unit.trl_style_environments:Fragile", max_turns=4, tool_timeout=5,
                         max_prompt_tokens=4096)
    try:
        meta, batch = asyncio.run(actor.generate([Prompt("0", 0, 0, 0, "Put 3 in memory.", {"target": 3, "broken": False}),
                                      Prompt("1", 1, 0, 0, "Put 3 in memory.", {"target": 3, "broken": True})]))
    finally:
        asyncio.run(actor.shutdown())
    values = batch.column("rewards").flatten().to_numpy().reshape(4, 3)
    errors = batch.column("reward_errors").to_pylist()
    assert values[:2].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    # the broken rows: no tools (their calls are text), one turn, the environment's column NaN with the reason
    assert values[2:, 0].tolist() == [0.0, 0.0] and all(math.isnan(v) for v in values[2:, 1:].flat)
    assert errors[2][1] == "error: the environment failed to start: reset raised ConnectionError: backend unreachable"
    assert batch.column("num_turns").to_pylist() == [2, 2, 1, 1]
    assert meta.groups[1].rewards.shape == (2, 3)


def multi_turn_logprobs_match_a_forward_pass(engine, model_dir, atol):
    """A rollout calls a tool, then the engine writes its second turn after the tool turn: its
    logprobs are those of a forward pass over the whole context (what the learner computes)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests.unit.scripted_engine import FirstTurnScripted

    scripted = FirstTurnScripted(engine, '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>')
    tok = engine.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "Put 3 in memory."}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    ts = trajectories(2)
    run_tool_rollouts(scripted, [prompt, prompt], ts, SamplingParams(temperature=0.8, max_tokens=160), 2, tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for t in ts:
        assert t.turns == 2 and t.tool_calls == 1 and t.mask.count(0) > 0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + t.tokens])).logits[0, len(prompt) - 1:-1].float() / 0.8
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.tokens)[:, None])[:, 0].numpy()
        second = [i for i, m in enumerate(t.mask) if m][len(scripted.ids):]  # the engine's own turn
        assert second and t.mask[second[0] - 1] == 0
        np.testing.assert_allclose(np.array(t.logprobs)[second], expected[second], atol=atol)


def test_hf_multi_turn_logprobs_match_a_forward_pass_over_the_whole_context(tiny_model_dir):
    from actors.hf_engine import HFEngine

    multi_turn_logprobs_match_a_forward_pass(HFEngine(tiny_model_dir), tiny_model_dir, atol=1e-4)


def test_a_template_without_a_tool_turn_or_that_rewrites_earlier_turns_is_refused(tiny_model_dir, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from gdpo_ray.run.preflight import check_tool_template

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # a template that marks the last assistant turn: once tool turns follow, that turn is written otherwise
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %}*{% endif %}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="writes the earlier turns differently once more turns follow them"):
        ToolTurns(tok).ids([("add", "3")])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    tok.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    config = SimpleNamespace(tool_environment=SPEC, model_path=str(tmp_path), tools_in_system_prompt="auto")
    with pytest.raises(ValueError, match="cannot write a tool turn .*no tool role"):
        check_tool_template(config)
    check_tool_template(SimpleNamespace(tool_environment=SPEC, model_path=tiny_model_dir, system_prompt=None,
                                        tools_in_system_prompt="auto", max_prompt_tokens=4096))  # ChatML: fine


def test_a_template_that_does_not_list_the_tools_gets_them_in_the_system_message(tiny_model_dir, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from gdpo_ray.run.preflight import check_tool_template
    from gdpo_ray.models.demo_agent import CHAT_TEMPLATE

    def config(path, mode="auto", max_prompt_tokens=4096):
        return SimpleNamespace(tool_environment=SPEC, model_path=path, tools_in_system_prompt=mode,
                               max_prompt_tokens=max_prompt_tokens, system_prompt=None)

    said = check_tool_template(config(tiny_model_dir))  # ChatML alone: the system message, said once
    assert said["warnings"] == [] and len(said["notes"]) == 1
    assert "does not list the tools it is given (tools=)" in said["notes"][0] and tiny_model_dir in said["notes"][0]
    assert "written into the system message" in said["notes"][0]
    # the tools' text (about 1,000 tokens of the tiny tokenizer) leaves no room for any prompt: refused
    with pytest.raises(ValueError, match=r"written into the system message .* take \d+ tokens, and "
                                         r"llm.max_prompt_tokens is 512: every prompt would be filtered"):
        check_tool_template(config(tiny_model_dir, max_prompt_tokens=512))
    (warning,) = check_tool_template(config(tiny_model_dir, "never", 512))["warnings"]
    assert "the model sees no tool names or schemas" in warning
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = CHAT_TEMPLATE  # lists the tools in a system turn
    tok.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    assert check_tool_template(config(str(tmp_path))) == {"notes": [], "warnings": []}
    (note,) = check_tool_template(config(str(tmp_path), "always"))["notes"]
    assert "data.tools_in_system_prompt: always" in note
    tok.chat_template = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHAT_TEMPLATE
    tok.save_pretrained(tmp_path)
    assert len(check_tool_template(config(str(tmp_path)))["notes"]) == 1  # auto: the system message instead
    with pytest.raises(ValueError, match=r"cannot render a prompt with tools \(TemplateError: no tools here\)"):
        check_tool_template(config(str(tmp_path), "never"))


def test_instances_are_made_once_and_reset_for_later_rollouts(tiny_model_dir):
    import numpy as np

    from actors.prompts import Prompt
    from actors.rollout import RolloutActor

    call = '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>'
    actor = RolloutActor(tiny_model_dir, [{"name": "state", "fn": "environment"},
                                          {"name": "memory_used", "fn": "environment", "weight": 0}], group_size=2,
                         engine="tests.unit.scripted_engine:ScriptedEngine", engine_kwargs={"script": [call, "Done."]},
                         sampling={"max_tokens": 200}, environment="tests.unit.trl_style_environments:Counted",
                         max_turns=4, tool_timeout=5, max_prompt_tokens=4096)
    try:
        batches = [asyncio.run(actor.generate([Prompt("0", 0, e, 0, "Put 3 in memory.", {"target": 3}),
                                   Prompt("1", 1, e, 0, "Put 3 in memory.", {"target": 5})]))[1] for e in range(3)]
        made = len(actor.tools._processes)  # a process makes one instance
    finally:
        asyncio.run(actor.shutdown())
    assert made == 4  # 4 rollouts at a time, 12 rollouts in all
    for b in batches:  # every reuse starts from reset's state: the same rewards each time
        np.testing.assert_array_equal(b.column("rewards").flatten().to_numpy().reshape(4, 2), [[1, 1], [1, 1], [0, 1], [0, 1]])


def test_an_instance_that_hung_is_not_reused(tokenizer):
    from actors.tool_loop import ToolEnvironment
    from gdpo_ray.tool_format import ToolCall

    env = ToolEnvironment("tests.unit.trl_style_environments:Hostile", tokenizer, max_turns=2, timeout_s=0.5)
    try:
        (hung, _), (fine, _) = env.start([{}, {}])
        assert hung.session.call(ToolCall("spin", {"n": 10**13})).kind == "timeout"
        process = fine.session.process
        env.release([hung, fine])
        assert env._idle == {None: [process]} and env._processes == {process}
    finally:
        env.close()
