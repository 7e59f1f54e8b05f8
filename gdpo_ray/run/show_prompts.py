"""``gdpo-ray check CONFIG --show-prompts N``: the first N prompts of a run as its model will see
them: the chat template over the system prompt, the tools (by the template or in the system
message, ``data.tools_in_system_prompt``), the first user turn and, with a tool environment, the
text its ``reset`` appends; rendered by the function the rollout actors render with
(``gdpo_ray.environments.tool_prompt.render_prompt``)."""

from __future__ import annotations

from typing import Any


def shown_prompts(c: Any, n: int) -> list[str]:
    """The texts of the first ``n`` prompts (in the dataset's order) of config ``c``."""
    from transformers import AutoTokenizer

    from actors.prompts import PromptSource
    from actors.tool_loop import ToolEnvironment, with_observation
    from gdpo_ray.data import load_prompts
    from gdpo_ray.environments.tool_prompt import render_prompt
    from gdpo_ray.model_files import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(c.model_path))
    source = PromptSource(load_prompts(c.prompts, c.num_prompts, c.seed or 0), prompt_column=c.prompt_column,
                          id_column=c.id_column, seed=c.seed or 0, columns=dict(c.columns))
    prompts = source.first(min(n, len(source)))
    if c.tool_environment is None:
        return [render_prompt(tokenizer, p.prompt, c.system_prompt) if c.chat_template or isinstance(p.prompt, list)
                else p.prompt for p in prompts]
    tools = ToolEnvironment(c.tool_environment, tokenizer, c.max_turns, c.tool_timeout, c.tools_in_system_prompt)
    try:
        started = tools.start([{"prompt": p.prompt, **p.columns} for p in prompts])
        out = []
        for p, (t, observation) in zip(prompts, started):
            if t.failed is not None:
                out.append(f"(the environment failed to start on this row: {t.failed[1]})")
                continue
            out.append(render_prompt(tokenizer, with_observation(p.prompt, observation), c.system_prompt,
                                     tools.schemas_of(t), tools.in_system))
        tools.release([t for t, _ in started])
        return out
    finally:
        tools.close()
