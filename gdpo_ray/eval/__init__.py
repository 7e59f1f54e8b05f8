"""Evaluation as the paper judges a trained policy (``gdpo-ray eval``, ``training.eval_every``).

- ``suites``: the ``Suite`` contract and ``make_suite(spec)``; one module per suite family:
  ``task_suites`` (``task:<name>``), ``math_suite`` (``math:<path>``), ``humaneval``, ``bfcl``;
- ``runner``: ``evaluate`` (generation on rollout actors, scoring, the report), ``read_completions``;
- ``report``: avg@n, per-category and overall metrics, the JSON report, tables, ``compare``;
- ``command``: the command line.
"""
