"""Ray actors of the rollout side: rollout engines, the reward scoring pool, the Arrow buffer and
the prompt source (DESIGN.md §2). Top-level so that ``ray job submit --working-dir .`` puts it on
every worker's path without an install step."""
