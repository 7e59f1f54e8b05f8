"""How a model is shown its tools: through its chat template (``tools=``), or, where the template
ignores them (SmolLM2's, many base models'), written into the system message.

``data.tools_in_system_prompt`` chooses (``MODES``):

- ``auto`` (default): the template's way where it lists the tools it is given, else the system
  message (``template_lists_tools`` probes the template once);
- ``always``: the system message for every model (the template gets no ``tools=``);
- ``never``: only ``tools=`` (a template that ignores it shows the model no tool).

The system message's text (``tools_text``) is this format, with the call format the rollout
loop parses (``gdpo_ray.tool_format``: Hermes-style blocks)::

    You can call the tools below. Each line between <tools> and </tools> describes one, as a JSON schema.
    <tools>
    {"type": "function", "function": {"name": "add", ...}}
    </tools>
    To call a tool, write its name and arguments as one JSON object inside <tool_call></tool_call>, one block per call, for example:
    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>
    Each call's result comes back to you in the next message. When you have what you need, answer without a call.

It goes after the prompt's own system message (``data.system_prompt``, or the prompt's), a blank
line between, or is the system message when there is none. ``chat_messages`` is the one place
that builds a prompt's messages, for the rollout loop, evaluation and the supervised warm start.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from gdpo_ray.tool_format import tool_call_block

MODES = ("auto", "always", "never")

#: a tool name no template writes by itself: the probe of ``template_lists_tools``
PROBE = "gdpo_probe_tool_7f3a"

INTRO = ("You can call the tools below. Each line between <tools> and </tools> describes one, "
         "as a JSON schema.")
CALL_FORMAT = ("To call a tool, write its name and arguments as one JSON object inside "
               "<tool_call></tool_call>, one block per call, for example:")
AFTER = ("Each call's result comes back to you in the next message. When you have what you need, "
         "answer without a call.")


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"data.tools_in_system_prompt must be one of {', '.join(MODES)}; got {mode!r} "
                         "(auto: in the system message only where the chat template ignores tools=)")
    return mode


def tools_text(schemas: Sequence[dict]) -> str:
    """The system message's description of ``schemas`` (JSON schemas as ``get_json_schema``
    writes them) and of the call format (see the module docstring)."""
    lines = [json.dumps(s, ensure_ascii=False) for s in schemas]
    first = _function(schemas[0]) if schemas else {}
    example = (first.get("name", "tool_name"),
               {k: _example(v) for k, v in list(((first.get("parameters") or {}).get("properties") or {}).items())[:2]})
    return "\n".join([INTRO, "<tools>", *lines, "</tools>", CALL_FORMAT, tool_call_block([example]), AFTER])


def _function(schema: dict) -> dict:
    return schema.get("function", schema) if isinstance(schema, dict) else {}


def _example(prop: Any) -> Any:
    kind = prop.get("type") if isinstance(prop, dict) else None
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(kind, "...")


def render_probe(tokenizer: Any) -> str:
    """A user turn rendered by the tokenizer's chat template with a probe tool (``tools=``);
    raises the template's own error where it cannot take tools."""
    probe = {"type": "function", "function": {"name": PROBE, "description": "a probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                         add_generation_prompt=True, tokenize=False)


def template_lists_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given (``tools=``) into
    the prompt; False also where it cannot render them at all."""
    try:
        return PROBE in render_probe(tokenizer)
    except Exception:  # noqa: BLE001 - a template that cannot take tools= does not list them
        return False


def in_system(mode: str, tokenizer: Any) -> bool:
    """Whether the tools go into the system message under ``mode`` for this tokenizer."""
    check_mode(mode)
    return mode == "always" or (mode == "auto" and not template_lists_tools(tokenizer))


def chat_messages(prompt: str | list, system_prompt: str | None = None, tools: Sequence[dict] | None = None,
                  tools_in_system: bool = False) -> list[dict]:
    """A prompt (a string: one user message; or chat messages) as the messages the template
    renders: ``system_prompt`` first where the prompt has no system message of its own, and,
    with ``tools_in_system``, ``tools_text(tools)`` appended to the system message (or as it)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    has_system = bool(messages) and messages[0].get("role") == "system"
    if system_prompt and not has_system:
        messages, has_system = [{"role": "system", "content": system_prompt}, *messages], True
    if tools_in_system and tools:
        text = tools_text(tools)
        if has_system:
            first = messages[0]
            messages[0] = {**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip("\n")}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages


def render_prompt(tokenizer: Any, prompt: str | list, system_prompt: str | None = None,
                  tools: Sequence[dict] | None = None, tools_in_system: bool = False) -> str:
    """The prompt's text as the model sees it: the chat template over ``chat_messages``, the
    assistant's header after it; ``tools`` go to the template (``tools=``) unless they are in the
    system message."""
    messages = chat_messages(prompt, system_prompt, tools, tools_in_system)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         tools=None if tools_in_system else (list(tools) if tools else None))
