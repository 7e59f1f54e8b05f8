"""Evaluation as the paper judges a trained policy (``gdpo-ray eval``, ``training.eval_every``).

- ``suite``: the ``Suite`` contract (``EvalItem``, ``Completion``, ``exceeds``);
- ``suites``: the registry of suite families (``SUITES``) and ``make_suite(spec)``; one module
  per family: ``task_suites`` (``task:<name>``), ``math_suite`` (``math:<path>``), ``humaneval``,
  ``rewards_suite`` (``rewards:<path>``: a run's own rewards on held-out prompts); BFCL's
  (``bfcl``, ``bfcl:<category>``) are in ``gdpo_ray.bfcl`` (``single_turn``, ``multi_turn_suite``);
- ``report``: avg@n, per-category and overall metrics, the JSON report, tables, ``compare`` (a row
  per metric, every reward column's mean first, a column per run and checkpoint; each report's
  settings, and a warning where they differ);
- ``time_limit``: the bounds on scoring's time: worker processes killed at an item's limit
  (``ScoringPool``) and the nestable in-process ``time_limit``;
- ``pass_at_k``: Chen et al.'s unbiased pass@k estimator, and the checks of its ks.

Generation on rollout actors and the command line are the driver's: ``gdpo_ray.run.eval_runner``
and ``gdpo_ray.run.eval_command``.
"""
