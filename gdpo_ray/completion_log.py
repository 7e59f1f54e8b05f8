"""``training.log_completions: N``: N samples of a training step as the model wrote them, for
people to read: the prompt and the completion (decoded with the policy's tokenizer, special
tokens kept: what the engine saw and wrote), every reward (NaN where it failed, with its error),
the advantage the sample was trained with, the finish reason and the policy version.

The samples spread over the step's groups: sample 0 of the first N groups, then sample 1 of
each, and so on. Only those groups' payloads are read (zero-copy from the object store).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from gdpo_ray.groups import GroupRef, read_groups


def pick(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """(group, sample) of ``n`` samples spread over groups of these sizes, round by round."""
    out: list[tuple[int, int]] = []
    for j in range(max(sizes, default=0)):
        out += [(g, j) for g, size in enumerate(sizes) if j < size][: n - len(out)]
        if len(out) == n:
            break
    return out


def completion_samples(groups: Sequence[GroupRef], advantages: np.ndarray, reward_names: Sequence[str],
                       n: int, decode: Callable[[Sequence[int]], str]) -> list[dict[str, Any]]:
    """``n`` samples of a step (fewer when it has fewer rollouts); ``advantages`` per rollout, in
    the groups' order."""
    if n <= 0 or not groups:
        return []
    sizes = [g.stop - g.start for g in groups]
    chosen = pick(sizes, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    wanted = sorted({g for g, _ in chosen})
    batches = dict(zip(wanted, read_groups([groups[g] for g in wanted])))
    out = []
    for g, j in chosen:
        batch, group = batches[g], groups[g]
        rewards = group.rewards[j]
        errors = "; ".join(f"{name}: {e}" for name, e in zip(reward_names, group.reward_errors[j]) if e)
        out.append({"prompt_id": batch.column("prompt_id")[j].as_py(),
                    "prompt": decode(batch.column("prompt_token_ids")[j].values.to_numpy().tolist()),
                    "completion": decode(batch.column("response_token_ids")[j].values.to_numpy().tolist()),
                    **{f"rewards/{name}": float(r) for name, r in zip(reward_names, rewards)},
                    "advantage": float(advantages[offsets[g] + j]), "finish_reason": group.finish_reason[j],
                    "policy_version": int(batch.column("policy_version")[j].as_py()), "reward_errors": errors})
    return out


class CompletionLog:
    """The driver's side: the policy's tokenizer, loaded on the first step that logs."""

    def __init__(self, model_path: str, reward_names: Sequence[str], n: int) -> None:
        self.model_path, self.reward_names, self.n = model_path, list(reward_names), n
        self._tokenizer = None

    def samples(self, groups: Sequence[GroupRef], advantages: np.ndarray) -> list[dict[str, Any]]:
        if self.n <= 0:
            return []
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        decode = lambda ids: self._tokenizer.decode(ids, skip_special_tokens=False)
        return completion_samples(groups, advantages, self.reward_names, self.n, decode)
