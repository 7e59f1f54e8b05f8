"""Ray actors of the learning side: the learners (DeepSpeed or FSDP2: ``learners.backend``) and the
weight sync to rollout actors (DESIGN.md §2). Top-level so that ``ray job submit --working-dir .``
puts it on every worker's path without an install step."""
