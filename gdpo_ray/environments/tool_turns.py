"""The token ids of a tool turn, as the tokenizer's chat template writes it (``ToolTurns``).

A multi-turn trajectory is the tokens the policy sampled, each turn ended by its end-of-turn
token, followed by each tool turn's tokens: the template's text for the tool messages and the
next assistant header, tokenized once, on its own. The rollout loop (``actors.tool_loop``) and
the agent warm start (``gdpo_ray.models.demo_agent``) build trajectories with it, so that a
model is trained on exactly the tokens it later sees.
"""

from __future__ import annotations

from typing import Any, Sequence

#: the assistant's text in the template probe
_PROBE = "\x00gdpo-probe\x00"


class ToolTurns:
    """The token ids of a tool turn as the tokenizer's chat template writes it: the tool
    messages after an assistant turn that ended with its end-of-turn token, up to and including
    the next assistant turn's header. Found by rendering a probe conversation with and without
    the tool messages and taking the difference."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
        before = tokenizer.apply_chat_template(probe, tokenize=False)
        self._probe = probe
        self._cut = before.index(_PROBE) + len(_PROBE)
        eos = tokenizer.eos_token or ""
        if before[self._cut:].startswith(eos):  # the stop token the model sampled
            self._cut += len(eos)
        self._before = before[:self._cut]

    def ids(self, answers: Sequence[tuple[str, str]]) -> list[int]:
        """The tokens of the tool messages (tool name, answer text) and the next assistant header."""
        return self._after([{"role": "tool", "name": name, "content": text} for name, text in answers])

    def user_ids(self, text: str) -> list[int]:
        """The tokens of a user message after an assistant turn (an environment's next message,
        ``next_message``) and the next assistant header."""
        return self._after([{"role": "user", "content": text}])

    def _after(self, messages: list[dict]) -> list[int]:
        after = self.tokenizer.apply_chat_template(self._probe + messages, tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(self._before):
            raise ValueError("the chat template writes the earlier turns differently once more turns "
                             "follow them: multi-turn rollouts need a template that keeps the "
                             "conversation's prefix (give the tokenizer a template that does)")
        return self.tokenizer(after[self._cut:], add_special_tokens=False)["input_ids"]
