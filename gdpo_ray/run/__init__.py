"""The driver floor: the only code (with ``gdpo_ray/__main__.py``) that imports ``actors/`` or
``learners/``.

- ``algorithm``: ``GDPOConfig`` and ``GDPO``, the RLlib algorithm (the five-phase training step);
- ``validation``: the cross-component checks of a config (engines, rewards, estimators,
  transports, eval suites), before any actor starts;
- ``presets``: YAML presets and ``section.key=value`` overrides onto a ``GDPOConfig``;
- ``transports``: weights out, one class per ``training.weight_sync``, typed against
  ``learners.learner_group.LearnerGroup`` and ``actors.rollout_group.RolloutGroup``;
- ``preflight``: the first-run checks (dataset, rewards on real rows, resources);
- ``checkpoints``: atomic saves, resume, exporting a checkpoint's policy;
- ``train``: a training run (Ray, the run directory, the loop, the final report);
- ``outputs``: the run directory, its metrics read back and the reward plot; ``loggers``: where the
  metrics go (JSONL, TensorBoard, wandb, MLflow); ``quiet``: log lines dropped, each with why;
- ``eval_runner`` / ``eval_command`` / ``eval_rewards``: evaluation on rollout actors, ``gdpo-ray eval``, and where a ``rewards:`` suite finds its run's config;
- ``run_curves`` / ``plot_command``: runs' curves side by side, ``gdpo-ray plot``;
- ``cli``: ``gdpo-ray`` / ``python -m gdpo_ray``.
"""
