"""``demo-tools``: the tiny model warm-started on ``task:tool_calls`` in ToolRL's format, cached.

The tool-calling study in miniature needs a policy whose two rewards, ``toolrl_format`` ({0, 1})
and ``toolrl_correctness`` ([-3, 3]), both start well below their maximum. As for the demo
(``gdpo_ray.models.demo``), the tiny model is fitted to a deliberately mediocre teacher, whose
mistakes are slips the model can represent per prompt:

- format: the gold answer's layout (``<think>…</think>``, a newline, then the ``<tool_call>``
  block, or the ``<response>`` when no tool fits) only ``p_format`` of the time; else, half and
  half, no ``<think>`` block, or the wrong block (a ``<response>`` after the calls; the reply in
  a ``<tool_call>`` block where no tool fits). Both faults leave the calls as they are.
- calls: right only ``p_correct`` of the time (every row in the first ``clean_steps``, where the
  model learns to copy the request into the calls); else one slip, drawn uniformly among: a wrong
  argument (the other unit, the currencies swapped, an extra seconds argument, no max_results), the
  wrong tool (the next one in the system message, same arguments), and, for a parallel pair, the
  second call missing. Correctness of a slip (``toolrl_correctness``): 1.5, 1.29, 0.6, 2, 0.75
  for the wrong arguments, -3 for the wrong tool, 0 for the missing call; 3 when right; 0 where
  no tool fits.

The tokenizer is trained on the task's texts (system message, requests, gold answers) with the
six tags as whole tokens, so that a prompt takes about 265 tokens and a gold answer at most
about 60 (the default tiny tokenizer needs over 600 for the prompt). Its pieces are
``QWEN2_PATTERN``'s, the ones the model's tokenizer class applies when loaded, so no piece is
cut differently at run time than in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gdpo_ray.models.warm_start import cached_model, chat_prompt_ids, fit_on_prompts, response_ids
from gdpo_ray.sft import Example
from gdpo_ray.tool_format import calls_in, in_block, tool_call_block

#: the recipe (the cache key); ``rows``: the task's rows the teacher answers (seed ``seed``)
RECIPE = dict(hidden_size=128, layers=2, vocab_size=1024, rows=1024, clean_steps=480, steps=120,
              batch_size=32, lr=3e-3, mix_lr=1e-3, p_format=0.5, p_correct=0.4, seed=0, version=1)

#: ToolRL's tags: one token each
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>"]
#: the reply of the extra <response> block after the calls (a format fault)
EXTRA_REPLY = "Done."
#: the wrong tool is the next one in the system message (a slip the model can represent)
NEXT_TOOL = {"get_weather": "convert_currency", "convert_currency": "set_timer",
             "set_timer": "search_recipes", "search_recipes": "get_weather"}


def wrong_arguments(name: str, params: dict) -> dict:
    """``params`` with one argument wrong: the other unit, the currencies swapped, an extra
    argument (seconds: 0) or max_results left out. Each is decided at one place in the call, so
    the model can learn it (the minutes as a string, "5" != 5, was not: the tiny model's closing
    quote did not follow its opening one, and most such calls did not parse)."""
    p = dict(params)
    if name == "get_weather":
        p["unit"] = "fahrenheit" if p["unit"] == "celsius" else "celsius"
    elif name == "convert_currency":
        p["from_currency"], p["to_currency"] = p["to_currency"], p["from_currency"]
    elif name == "set_timer":
        p["seconds"] = 0
    else:
        p.pop("max_results", None)
    return p


def slip(calls: list[tuple[str, dict]], rng: np.random.Generator) -> list[tuple[str, dict]]:
    """The calls with one mistake, drawn uniformly among those that apply: wrong arguments (of
    every call), the wrong tool (every call), the second call of a pair missing."""
    kinds = ["arguments", "tool"] + (["missing"] if len(calls) > 1 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "missing":
        return calls[:-1]
    if kind == "tool":
        return [(NEXT_TOOL[name], params) for name, params in calls]
    return [(name, wrong_arguments(name, params)) for name, params in calls]


def teacher_response(gold: str, rng: np.random.Generator, p_format: float, p_correct: float) -> str:
    """One response of the mediocre teacher to the request whose gold answer is ``gold`` (a
    ``task:tool_calls`` ground truth): see the module docstring."""
    calls = calls_in(gold)
    if calls:
        if rng.random() >= p_correct:
            calls = slip(calls, rng)
        thought = f"The user's request needs {', '.join(dict.fromkeys(name for name, _ in calls))}."
        block = tool_call_block(calls, key="parameters")
        wrong_block = f"{block}\n<response>{EXTRA_REPLY}</response>"
    else:
        thought, reply = "No tool is needed.", "You're welcome!"
        block, wrong_block = f"<response>{reply}</response>", in_block(reply)
    if rng.random() < p_format:
        return f"<think>{thought}</think>\n{block}"
    return block if rng.random() < 0.5 else f"<think>{thought}</think>\n{wrong_block}"


def tokenizer_corpus(rows: list[dict[str, Any]]) -> list[str]:
    """The texts the tool tokenizer is trained on: every message and gold answer of ``rows``,
    the chat roles and the teacher's own words."""
    texts = ["system user assistant", EXTRA_REPLY, '{"seconds": 0}']
    for row in rows:
        texts += [m["content"] for m in row["prompt"]] + [row["ground_truth"]]
    return texts


def tools_model_dir(cache: str | Path | None = None, **overrides) -> Path:
    """The warm-started tool-calling model directory (built on first use, then reused)."""
    return cached_model("demo-tools", RECIPE | overrides, _warm_start, cache)


def _tool_batches(tokenizer: Any, rows: list[dict], prompts: list[list[int]], recipe: dict,
                  rng: np.random.Generator) -> Iterator[tuple[float, list[Example]]]:
    """``clean_steps`` of right calls at ``lr``, then ``steps`` of the mediocre teacher at
    ``mix_lr``; the format is mediocre throughout. ``prompts``: the rows' prompt ids."""
    for step in range(recipe["clean_steps"] + recipe["steps"]):
        clean = step < recipe["clean_steps"]
        examples = []
        for i in rng.integers(len(rows), size=recipe["batch_size"]):
            response = teacher_response(rows[i]["ground_truth"], rng, recipe["p_format"],
                                        1.0 if clean else recipe["p_correct"])
            examples.append((prompts[i], response_ids(tokenizer, response)))
        yield (recipe["lr"] if clean else recipe["mix_lr"]), examples


def build_untrained(path: Path, recipe: dict) -> list[dict[str, Any]]:
    """The tool tokenizer and a random model of ``recipe`` in ``path``; returns the task's rows
    the teacher answers (the tokenizer is trained on their texts)."""
    from gdpo_ray.tasks import tool_calls
    from gdpo_ray.models.tiny import QWEN2_PATTERN, build_tiny_model

    rows = tool_calls(recipe["rows"], recipe["seed"])
    build_tiny_model(path, hidden_size=recipe["hidden_size"], layers=recipe["layers"],
                     vocab_size=recipe["vocab_size"], seed=recipe["seed"],
                     corpus=tokenizer_corpus(rows), pattern=QWEN2_PATTERN, added_tokens=TAGS)
    return rows


def _warm_start(path: Path, recipe: dict) -> None:
    rows = build_untrained(path, recipe)  # the system message is the prompts' shared prefix
    fit_on_prompts(path, recipe, lambda tokenizer: [chat_prompt_ids(tokenizer, row["prompt"]) for row in rows],
                   lambda tokenizer, prompts, rng: _tool_batches(tokenizer, rows, prompts, recipe, rng))
