"""``gdpo-ray sft``: demonstrations tokenized exactly as the multi-turn loop tokenizes a rollout
(the same prompt, tool turns out of the loss), TRL's layouts read, bad rows named, and a short
fit that lowers the loss and writes a model directory ``llm.model_path`` takes."""

import asyncio
import json
import re

import pytest

from gdpo_ray import sft
from tests.unit.test_tool_loop import SPEC

CALL = {"type": "function", "function": {"name": "add", "arguments": {"value": 3}}}


def conversation_row(prompt="Put 3 in memory."):
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": "", "tool_calls": [CALL]},
                         {"role": "tool", "name": "add", "content": "memory = 3"},
                         {"role": "assistant", "content": "Done."}]}


def test_a_demonstration_is_the_rollout_the_loop_would_record(tiny_model_dir):
    """The tokens of a rollout whose policy wrote the demonstration's turns (a scripted engine,
    the real loop, template, tool turns and tools in the system message) are the SFT example's:
    prompt, response and mask, token for token."""
    from actors.prompts import Prompt
    from actors.rollout import RolloutActor
    from gdpo_ray.environments.spec import load_environment

    actor = RolloutActor(tiny_model_dir, [{"name": "state", "fn": "environment"},
                                          {"name": "memory_used", "fn": "environment", "weight": 0}], group_size=2,
                         engine="tests.unit.scripted_engine:ScriptedEngine",
                         engine_kwargs={"script": [sft.call_block(CALL), "Done."]}, sampling={"max_tokens": 300},
                         environment=SPEC, max_turns=4, tool_timeout=5, max_prompt_tokens=4096,
                         system_prompt="Be brief.")
    try:
        _, batch = asyncio.run(actor.generate([Prompt("0", 0, 0, 0, "Put 3 in memory.", {"target": 3})]))
        tokenizer = sft.Tokenizer(actor.tokenizer, "Be brief.", load_environment(SPEC).schemas, actor.tools.in_system)
    finally:
        asyncio.run(actor.shutdown())
    row = conversation_row("Put 3 in memory.The memory starts at 0.")  # with reset's text, as the rollout's
    prompt, response, mask = tokenizer.example(row)
    assert prompt == batch.column("prompt_token_ids").to_pylist()[0]
    assert response == batch.column("response_token_ids").to_pylist()[0]
    assert mask == batch.column("response_mask").to_pylist()[0]
    assert 0 in mask and mask[0] == 1 and mask[-1] == 1


def test_trl_layouts_and_tool_calls(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = sft.Tokenizer(tok)
    # prompt/completion, strings: one user message, one assistant message
    prompt, response, mask = t.example({"prompt": "2+2?", "completion": "4"})
    assert tok.decode(prompt).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert response == tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] and mask == [1] * len(response)
    # arguments as JSON text, as some datasets write them; content before the calls
    text = sft.assistant_text({"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"value": 3}'}}, CALL]})
    block = '<tool_call>\n{"name": "add", "arguments": {"value": 3}}\n</tool_call>'
    assert text == f"Let me add.\n{block}\n{block}"
    from gdpo_ray.tool_format import ToolCall, parse_tool_calls

    assert parse_tool_calls(text) == [ToolCall("add", {"value": 3})] * 2  # the loop reads what SFT writes
    # a later user turn is context, as the environment's next message is
    row = conversation_row()
    row["messages"] += [{"role": "user", "content": "And 4?"}, {"role": "assistant", "content": "7"}]
    _, response, mask = t.example(row)
    assert tok.decode([x for x, m in zip(response, mask) if not m]).count("<|im_start|>user\nAnd 4?") == 1


@pytest.mark.parametrize("row, message", [
    ({"text": "x"}, "a row needs 'messages' (conversational), or 'prompt' and 'completion'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "has no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "tool", "content": "z"}]}, "must end with an assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                                       "arguments": "{"}}]}]},
     "tool call 'f': its arguments are not JSON"),
    ({"prompt": "x", "completion": [{"role": "user", "content": "y"}]}, "must start with an assistant message"),
])
def test_a_bad_row_is_named(tiny_model_dir, tmp_path, row, message):
    from transformers import AutoTokenizer

    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(conversation_row()) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"demos\.jsonl, line 2: .*" + re.escape(message)):
        sft.read_examples(str(path), sft.Tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir)))


def test_shared_prefix_and_batches():
    examples = [([1, 2, 3, 4], [9]), ([1, 2, 3, 5, 6], [9]), ([1, 2, 3, 4, 7], [9])]
    assert sft.shared_prefix(examples) == 3
    assert sft.shared_prefix([([1, 2], [9]), ([1, 2, 3], [9])]) == 1  # at least one prompt token stays
    got = list(sft.batches(list(range(5)), 2, epochs=2, lr=0.1, seed=0))
    assert [len(b) for _, b in got] == [2, 2, 1, 2, 2, 1] and {lr for lr, _ in got} == {0.1}
    assert sorted(x for _, b in got[:3] for x in b) == [0, 1, 2, 3, 4]  # an epoch sees each once
    assert len(list(sft.batches(list(range(5)), 2, epochs=2, lr=0.1, seed=0, max_steps=4))) == 4


def test_the_command_fits_and_writes_a_model_the_trainer_takes(tiny_model_dir, tmp_path, capsys):
    """A full fit and a LoRA fit (merged) of a few steps: the loss falls, the directory loads with
    transformers, its tokenizer and template are the model's, and a LoRA fit changes the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from gdpo_ray.run.cli import main

    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(conversation_row(f"Put {i} in memory.")) + "\n" for i in range(8)))
    for name, extra in (("full", []), ("lora", ["--lora", "{r: 4, lora_alpha: 8}"])):
        out = tmp_path / name
        assert main(["sft", tiny_model_dir, "--data", str(data), "--output", str(out), "--environment", SPEC,
                     "--epochs", "6", "--batch-size", "4", "--lr", "3e-3", "--num-threads", "1", *extra]) == 0
        said = capsys.readouterr().out
        assert "8 examples" in said and "the tools in the system message" in said and str(out) in said
        summary = json.loads((out / "sft.json").read_text())
        assert summary["steps"] == 12 and summary["last_loss"] < summary["first_loss"]
        assert len((out / "sft_log.jsonl").read_text().splitlines()) == 12
        model = AutoModelForCausalLM.from_pretrained(out)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
        assert changed and not any("lora" in k for k in model.state_dict())
    assert main(["sft", tiny_model_dir, "--data", str(data), "--lora", "{r: 0}"]) == 2
    assert "llm.lora.r must be an integer >= 1" in capsys.readouterr().err
    assert main(["sft", tiny_model_dir, "--data", str(data), "--max-steps", "0"]) == 2
    assert "--max-steps must be >= 1" in capsys.readouterr().err


def test_rows_of_trls_dict_form_see_their_own_classs_tools(tiny_model_dir):
    """A row naming its class (``environment``) is shown that class's tools, as its rollout is."""
    from transformers import AutoTokenizer

    from gdpo_ray.environments.spec import load_environment

    calc, count = (list(load_environment(f"tests.unit.trl_style_environments:{c}").schemas)
                   for c in ("Calculator", "Counter"))
    t = sft.Tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), tools={"calc": calc, "count": count},
                      tools_in_system=True)
    seen = {}
    for name in ("calc", "count"):
        prompt, _, _ = t.example({**conversation_row(), "environment": name})
        seen[name] = t.tokenizer.decode(prompt)
    assert '"name": "divide"' in seen["calc"] and '"name": "bump"' not in seen["calc"]
    assert '"name": "bump"' in seen["count"] and '"name": "divide"' not in seen["count"]
    # a row's own tools column wins
    own, _, _ = t.example({**conversation_row(), "environment": "calc", "tools": json.dumps(count)})
    assert '"name": "bump"' in t.tokenizer.decode(own)
