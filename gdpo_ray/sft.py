"""Supervised fine-tuning (``gdpo-ray sft``): the first stage TRL users know, on the tokens the
multi-turn loop gives the model.

Rows in TRL's SFT layouts (``read_examples``):

- conversational: ``messages``, a list of ``{role, content}`` with the assistant's tool calls as
  ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``, arguments an
  object or its JSON text) and the tools' answers as ``tool`` messages (``name``, ``content``);
  an optional ``tools`` column (JSON schemas) lists the row's tools;
- prompt/completion: ``prompt`` (a string or messages) and ``completion`` (a string or
  messages).

Each row becomes one ``Example`` (prompt ids, response ids, loss mask), tokenized exactly as a
rollout is: the prompt (the messages before the first assistant turn) rendered as the rollout
actors render it (``gdpo_ray.environments.tool_prompt.render_prompt``: the chat template, the
system prompt, the tools by the template or in the system message); each assistant turn its
text, its tool calls written as the ``<tool_call>`` blocks the loop parses, and the end-of-turn
token, in the loss; each tool turn and later user turn as ``gdpo_ray.environments.tool_turns.
ToolTurns`` writes it, out of the loss (as the learners mask tool turns).

``supervised_fit`` and ``response_loss`` (teacher forcing, the loss on the masked-in response
tokens only, a prefix every prompt shares run once in the KV cache) are the project's one
supervised trainer: ``train`` runs a dataset through them, the demo models' warm starts
(``gdpo_ray.models``: ``demo``, ``demo_tools``, ``demo_agent``, ``demo_count``) are recipes on
them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from gdpo_ray.tool_format import tool_call_block

#: one training example: (prompt token ids, response token ids ending with the EOS token), or
#: with a third list, per response token 1 = in the loss, 0 = context only (a tool turn's tokens)
Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]


def call_block(call: Any) -> str:
    """One tool call (TRL's ``{"type": "function", "function": {"name", "arguments"}}``, or the
    inner ``{"name", "arguments"}``) as the ``<tool_call>`` block the rollout loop parses."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool call must be {{'function': {{'name': ..., 'arguments': {{...}}}}}}; got {call!r}")
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as err:
            raise ValueError(f"tool call {fn['name']!r}: its arguments are not JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {fn['name']!r}: arguments must be an object; got {arguments!r}")
    return tool_call_block([(fn["name"], arguments)])


def assistant_text(message: dict) -> str:
    """An assistant message as the model writes it: its content, then its tool calls' blocks."""
    blocks = [call_block(c) for c in message.get("tool_calls") or []]
    content = message.get("content") or ""
    return "\n".join([content, *blocks]) if content else "\n".join(blocks)


def conversation(row: dict) -> tuple[list[dict], list[dict]]:
    """(prompt messages, the messages after them) of a row in either layout; the prompt ends
    before the first assistant message."""
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("'messages' must be a list of {role, content} messages")
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("'messages' has no assistant message: nothing to learn")
        return list(messages[:first]), list(messages[first:])
    if row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
            raise ValueError("'prompt' and 'completion' must each be a string or a list of messages")
        if completion[0].get("role") != "assistant":
            raise ValueError(f"the completion must start with an assistant message; got {completion[0].get('role')!r}")
        return list(prompt), list(completion)
    raise ValueError(f"a row needs 'messages' (conversational), or 'prompt' and 'completion'; its columns: "
                     f"{sorted(k for k, v in row.items() if v is not None)}")


class Tokenizer:
    """Rows to ``Example``s for one tokenizer, as the rollout actors tokenize (see the module
    docstring). ``tools``: the tools' schemas when a row has no ``tools`` column (an
    environment's), or per class name where rows name their class in an ``environment`` column
    (TRL's dict form of environments); ``tools_in_system``: they go into the system message."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None,
                 tools: Sequence[dict] | Mapping[str, Sequence[dict]] = (), tools_in_system: bool = False) -> None:
        from gdpo_ray.environments.tool_turns import ToolTurns

        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.tools = {k: list(v) for k, v in tools.items()} if isinstance(tools, Mapping) else list(tools)
        self.tools_in_system, self.tool_turns = tools_in_system, ToolTurns(tokenizer)

    def _tools_of(self, row: dict) -> list | None:
        tools = row.get("tools")
        if tools is None:
            tools = self.tools.get(row.get("environment"), []) if isinstance(self.tools, dict) else self.tools
        return json.loads(tools) if isinstance(tools, str) else tools

    def example(self, row: dict) -> Example:
        from gdpo_ray.environments.tool_prompt import render_prompt

        prompt, rest = conversation(row)
        tools = self._tools_of(row)
        text = render_prompt(self.tokenizer, prompt, self.system_prompt, tools or None, self.tools_in_system)
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        response, mask = [], []
        i = 0
        while i < len(rest):
            m = rest[i]
            if m["role"] == "assistant":
                ids = self.tokenizer(assistant_text(m), add_special_tokens=False)["input_ids"]
                ids.append(self.tokenizer.eos_token_id)  # the end-of-turn token the model samples
                response, mask, i = response + ids, mask + [1] * len(ids), i + 1
                continue
            if m["role"] == "tool":
                answers = []
                while i < len(rest) and rest[i]["role"] == "tool":
                    answers.append((rest[i].get("name") or "", str(rest[i].get("content") or "")))
                    i += 1
                ids = self.tool_turns.ids(answers)
            elif m["role"] == "user":
                ids, i = self.tool_turns.user_ids(str(m.get("content") or "")), i + 1
            else:
                raise ValueError(f"a {m['role']!r} message after the first assistant turn: only assistant, "
                                 "tool and user turns follow it")
            response, mask = response + ids, mask + [0] * len(ids)
        if not mask or mask[-1] != 1:
            raise ValueError("the conversation must end with an assistant message (what the model learns to say)")
        return prompt_ids, response, mask


def read_examples(rows: Any, tokenizer: Tokenizer, max_length: int | None = None) -> tuple[list[Example], int]:
    """(every row's ``Example``, how many were longer than ``max_length`` tokens and left out);
    a bad row raises naming its line (``gdpo_ray.data.read_dataset``'s rows)."""
    from gdpo_ray.data import read_dataset

    data = read_dataset(rows)
    examples, too_long = [], 0
    for i, row in enumerate(data.rows):
        try:
            example = tokenizer.example(row)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{data.where(i)}: {err}") from None
        if max_length is not None and len(example[0]) + len(example[1]) > max_length:
            too_long += 1
            continue
        examples.append(example)
    if not examples:
        raise ValueError(f"{data.source}: no example to train on"
                         + (f" ({too_long} longer than --max-length {max_length})" if too_long else ""))
    return examples, too_long


def shared_prefix(examples: Sequence[Example]) -> int:
    """The number of leading prompt tokens every example shares (a system message, the tools'
    listing), leaving at least one token of each prompt."""
    prompts = [e[0] for e in examples]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


def batches(examples: Sequence[Example], batch_size: int, epochs: int, lr: float, seed: int,
            max_steps: int | None = None) -> Iterator[tuple[float, list[Example]]]:
    """``epochs`` passes over ``examples`` in a seeded order, ``batch_size`` at a time (the last
    batch of an epoch may be smaller), at a constant ``lr``; at most ``max_steps`` batches."""
    rng = np.random.default_rng(seed)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(examples))
        for start in range(0, len(order), batch_size):
            if max_steps is not None and step >= max_steps:
                return
            yield lr, [examples[j] for j in order[start:start + batch_size]]
            step += 1


def supervised_fit(model: Any, batches: Iterable[tuple[float, list[Example]]], lr: float,
                   pad_id: int, prefix: list[int] | None = None,
                   on_step: Callable[[int, float], Any] | None = None) -> None:
    """AdamW (no weight decay) on each ``(lr, examples)`` of ``batches`` in turn: one step of
    ``response_loss``; ``on_step(step, loss)`` after each."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    for step, (step_lr, examples) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        loss = response_loss(model, examples, pad_id, prefix)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))


def response_loss(model: Any, examples: list[Example], pad_id: int, prefix: list[int] | None = None) -> Any:
    """The mean cross-entropy of the response tokens given the prompt (right-padded; prompt,
    padding and the response tokens an example's mask leaves out are out of the loss).

    ``prefix``: tokens every prompt starts with, left out of the examples' prompts (which must
    not be empty): run once and repeated across the batch in the model's KV cache, so a long
    shared system message costs one sequence, not one per example; the loss and its gradient
    are those of the whole prompts (up to float rounding)."""
    import torch

    from gdpo_ray.causal_lm import new_cache

    ids = [prompt + target for prompt, target, *_ in examples]
    labels = [[-100] * len(e[0]) + [t if m else -100 for t, m in zip(e[1], e[2] if len(e) > 2 else [1] * len(e[1]))]
              for e in examples]
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids])
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
    if not prefix:
        return model(input_ids=input_ids, attention_mask=mask, labels=label_ids).loss
    cache = {_cache_argument(model): new_cache(model)}
    model(input_ids=torch.tensor([prefix]), use_cache=True, **cache)  # fills the cache
    next(iter(cache.values())).batch_repeat_interleave(len(ids))  # autograd sums the copies' gradients
    mask = torch.cat([torch.ones(len(ids), len(prefix), dtype=mask.dtype), mask], dim=1)
    return model(input_ids=input_ids, attention_mask=mask, labels=label_ids, **cache).loss


def _cache_argument(model: Any) -> str:
    """The name of the forward's KV cache argument (``past_key_values`` before transformers 5.25),
    read off the model inside a PEFT wrapper (whose forward takes ``**kwargs``)."""
    import inspect

    from gdpo_ray.causal_lm import unwrapped

    return "cache" if "cache" in inspect.signature(unwrapped(model).forward).parameters else "past_key_values"


def train(model_dir: str | Path, examples: Sequence[Example], output: str | Path, lora: dict | None = None,
          epochs: int = 1, lr: float = 1e-5, batch_size: int = 8, max_steps: int | None = None, seed: int = 0,
          progress: bool = True, log: Callable[[dict], Any] | None = None) -> Path:
    """Fits the model of ``model_dir`` to ``examples`` (``batches``: AdamW at a constant ``lr``;
    ``lora``: normalized ``llm.lora`` settings, the adapter trained and merged into the model
    after) and writes it with its tokenizer to ``output``, in the model's dtype: a directory
    ``llm.model_path`` takes. ``log({"step", "loss", "lr", "examples", "seconds"})`` per step."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dtype = model.dtype
    model = model.float()
    if lora:
        from peft import get_peft_model

        from gdpo_ray.lora import peft_config

        model = get_peft_model(model, peft_config(lora))
    torch.manual_seed(seed)
    prefix_len = shared_prefix(examples)
    trimmed = [(e[0][prefix_len:], *e[1:]) for e in examples]
    steps = sum(1 for _ in batches(trimmed, batch_size, epochs, lr, seed, max_steps))
    bar = tqdm(total=steps, desc="sft", unit="step", disable=not progress)
    start = time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}")
        if log is not None:
            log({"step": step + 1, "loss": loss if math.isfinite(loss) else None, "lr": lr,
                 "seconds": round(time.perf_counter() - start, 3)})

    try:
        supervised_fit(model, batches(trimmed, batch_size, epochs, lr, seed, max_steps), lr,
                       tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                       prefix=examples[0][0][:prefix_len] or None, on_step=on_step)
    finally:
        bar.close()
    if lora:
        model = model.merge_and_unload()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output
