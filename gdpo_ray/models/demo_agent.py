"""``demo-agent``: the tiny model warm-started to call a calculator's tools, turn by turn, cached.

The ``agent`` preset trains a policy in a multi-turn tool environment
(``gdpo_ray.environments.arithmetic``: ``add`` and ``multiply``) on ``task:tool_arithmetic``
("What is 37 times 12 plus 5?"). A random tiny model never calls a tool, so, as for the demo
(``gdpo_ray.models.demo``), it is first fitted to a deliberately mediocre teacher whose mistakes
are slips the model can represent per prompt:

- no call (``1 - p_call`` of the time): the teacher answers at once with the question's first
  number;
- the wrong tool (each call, ``1 - p_tool``): ``add`` for ``multiply`` or the reverse, with the
  right arguments; its result is carried on (to the second call, to the answer);
- the answer without its tags (``1 - p_format``): "The answer is 449.".

Otherwise it calls the gold tools one per turn (a second call takes the first one's result from
the tool's answer) and answers with the last result in ``<answer>…</answer>``. The first
``clean_steps`` call every tool right (the model learns to copy numbers into calls and out of
answers); the format is mediocre throughout. The three rewards of the preset (format, tool
success, answer) thus start well below their maximum.

Training sees exactly the tokens of a rollout: the prompt as the rollout actor renders it (the
environment's tools in the chat template), each model turn ended by its end-of-turn token, each
tool turn as ``gdpo_ray.environments.tool_turns.ToolTurns`` writes it; the loss is on the
model's turns only. The chat template lists the tools it is given (``tools=``) in a system turn,
by name and arguments, so the prompt stays short.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gdpo_ray.models.tiny import CHATML
from gdpo_ray.models.warm_start import cached_model, fit_on_prompts, response_ids
from gdpo_ray.sft import Example
from gdpo_ray.tool_format import tool_call_block

#: the recipe (the cache key); ``rows``: the task's rows the teacher answers (seed ``seed``)
RECIPE = dict(hidden_size=128, layers=2, vocab_size=512, rows=2048, clean_steps=1200, steps=150,
              batch_size=32, lr=3e-3, mix_lr=1e-3, p_call=0.6, p_tool=0.75, p_format=0.6, seed=0,
              version=1)
#: the environment whose tools the prompts list
ENVIRONMENT = "gdpo_ray.environments.arithmetic:Arithmetic"
#: one token each
TAGS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>"]
#: every number the task's calls and answers hold, one token each: copying a number from the
#: question into a call, or from a tool's answer into the next, is then one attention look-up (a
#: tiny model copying digit by digit did not learn it in a few thousand steps)
NUMBERS = [str(i) for i in range(1000)]
#: the tool turn's instructions (the chat template's system turn when tools are given)
INSTRUCTIONS = ('Call one tool per turn as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; '
                "give the final answer as <answer>...</answer>.")
#: ChatML, with the tools it is given listed first: "You can call: add(a, b), multiply(a, b). ..."
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call:{% for t in tools %} {{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | join(', ') }}){% if not loop.last %},{% endif %}"
    "{% endfor %}. " + INSTRUCTIONS + "<|im_end|>\n{% endif %}" + CHATML)
OTHER_TOOL = {"add": "multiply", "multiply": "add"}


def call_text(tool: str, a: int, b: int) -> str:
    return tool_call_block([(tool, {"a": a, "b": b})])


def teacher_turns(steps: list[list], rng: np.random.Generator, p_call: float, p_tool: float,
                  p_format: float) -> list[tuple[str, tuple[str, str] | None]]:
    """The teacher's turns for a question whose gold calls are ``steps`` (``task:tool_arithmetic``):
    (turn text, (the tool it called, the tool's answer), or None for the final turn)."""
    if rng.random() >= p_call:
        value, turns = steps[0][1], []
    else:
        value, turns = None, []
        for tool, a, b in steps:
            a = value if a is None else a
            tool = tool if rng.random() < p_tool else OTHER_TOOL[tool]
            value = a * b if tool == "multiply" else a + b
            turns.append((call_text(tool, a, b), (tool, str(value))))
    answer = f"<answer>{value}</answer>" if rng.random() < p_format else f"The answer is {value}."
    return turns + [(answer, None)]


def trajectory_example(prompt: list[int], turns: list[tuple[str, tuple[str, str] | None]],
                        tokenizer: Any, tool_turns: Any) -> Example:
    """The trajectory of ``turns`` (``teacher_turns``) as one example: each model turn's tokens
    and its end-of-turn token in the loss, each tool turn's tokens context only."""
    target, mask = [], []
    for text, answered in turns:
        turn = response_ids(tokenizer, text)
        tool = tool_turns.ids([answered]) if answered is not None else []
        target += turn + tool
        mask += [1] * len(turn) + [0] * len(tool)
    return list(prompt), target, mask


def agent_model_dir(cache: str | Path | None = None, **overrides) -> Path:
    """The warm-started agent model directory (built on first use, then reused)."""
    return cached_model("demo-agent", RECIPE | overrides, _warm_start, cache)


def _corpus(rows: list[dict], schemas: list[dict]) -> list[str]:
    texts = ["system user assistant tool", INSTRUCTIONS, "You can call: add(a, b), multiply(a, b).",
             json.dumps(schemas), "The answer is 0123456789."]
    for row in rows:
        steps = json.loads(row["steps"])
        texts += [row["prompt"][-1]["content"], call_text(steps[0][0], steps[0][1], steps[0][2])]
    return texts


def _batches(tokenizer: Any, rows: list[dict], prompts: list[list[int]], recipe: dict,
             rng: np.random.Generator) -> Iterator[tuple[float, list[Example]]]:
    """``clean_steps`` of right calls at ``lr``, then ``steps`` of the mediocre teacher at
    ``mix_lr``; ``prompts``: the rows' prompt ids without the shared prefix."""
    from gdpo_ray.environments.tool_turns import ToolTurns

    tool_turns = ToolTurns(tokenizer)
    for step in range(recipe["clean_steps"] + recipe["steps"]):
        clean = step < recipe["clean_steps"]
        examples = []
        for i in rng.integers(len(rows), size=recipe["batch_size"]):
            turns = teacher_turns(json.loads(rows[i]["steps"]), rng, 1.0 if clean else recipe["p_call"],
                                  1.0 if clean else recipe["p_tool"], recipe["p_format"])
            examples.append(trajectory_example(prompts[i], turns, tokenizer, tool_turns))
        yield (recipe["lr"] if clean else recipe["mix_lr"]), examples


def build_untrained(path: Path, recipe: dict) -> tuple[list[dict], list[dict]]:
    """The agent tokenizer (its chat template lists tools) and a random model of ``recipe`` in
    ``path``; returns the task's rows the teacher answers and the environment's tool schemas."""
    from transformers import AutoTokenizer

    from gdpo_ray.environments.spec import load_environment
    from gdpo_ray.tasks import tool_arithmetic
    from gdpo_ray.models.tiny import QWEN2_PATTERN, build_tiny_model

    rows = tool_arithmetic(recipe["rows"], recipe["seed"])
    schemas = list(load_environment(ENVIRONMENT).schemas)
    build_tiny_model(path, hidden_size=recipe["hidden_size"], layers=recipe["layers"],
                     vocab_size=recipe["vocab_size"], seed=recipe["seed"], corpus=_corpus(rows, schemas),
                     pattern=QWEN2_PATTERN, added_tokens=TAGS + NUMBERS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return rows, schemas


def _warm_start(path: Path, recipe: dict) -> None:
    rows, schemas = build_untrained(path, recipe)
    fit_on_prompts(path, recipe, lambda tokenizer: [prompt_ids(tokenizer, row["prompt"], schemas) for row in rows],
                   lambda tokenizer, prompts, rng: _batches(tokenizer, rows, prompts, recipe, rng))


def prompt_ids(tokenizer: Any, messages: list[dict], schemas: list[dict]) -> list[int]:
    """As the rollout actor renders a prompt of a tool environment (its tools in the template)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=schemas)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
