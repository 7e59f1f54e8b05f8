"""The step's groups: B complete groups from the buffer, and with dynamic sampling (DAPO) only
informative ones: a group in which no weighted reward varies gets no advantage and is dropped
(marked filtered, its buffer slot released) and replaced, up to ``max_refills`` rounds."""

from __future__ import annotations

from typing import Any

import numpy as np

from gdpo_ray.advantages import informative_groups
from gdpo_ray.groups import rewards_matrix


def take_groups(config: Any, rollouts: Any, buffer: Any, prompts: Any,
                weights: np.ndarray) -> tuple[list, list]:
    """``(groups, dropped)``: ``config.prompts_per_step`` groups (fewer only when dynamic
    sampling ran out of refills), as references with their metadata, and the groups dynamic
    sampling dropped (their metadata: what the policy sampled is kept and dropped together).
    Raises RuntimeError when every round was filtered whole."""
    c = config
    kept, dropped = [], []
    for _ in range(c.max_refills + 1):
        need = c.prompts_per_step - len(kept)
        rollouts.wait_for(need)
        taken = buffer.take(need)
        if c.dynamic_sampling:
            informative = informative_groups(*rewards_matrix(taken), estimator=c.estimator,
                                             weights=weights, eps=c.eps)
            for g, ok in zip(taken, informative):
                if not ok:
                    prompts.mark_filtered(g.group_id, "no training signal in the group "
                                          "(no weighted reward varies)")
            buffer.release(int((~informative).sum()))
            dropped += [g for g, ok in zip(taken, informative) if not ok]
            taken = [g for g, ok in zip(taken, informative) if ok]
        kept += taken
        if len(kept) == c.prompts_per_step or not c.dynamic_sampling:
            break
    buffer.short_step(c.prompts_per_step - len(kept))  # admission keeps B per step
    if not kept:
        raise RuntimeError(f"dynamic sampling filtered every group for {c.max_refills + 1} "
                           "rounds: no weighted reward varies within any group; raise max_refills, "
                           "group_size or temperature, or turn dynamic_sampling off")
    return kept, dropped
