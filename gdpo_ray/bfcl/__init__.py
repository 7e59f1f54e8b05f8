"""The Berkeley Function Calling Leaderboard (BFCL v4), as the ``bfcl-eval`` package ships it
(``pip install --no-deps bfcl-eval==2026.3.23``), for evaluation and training.

- ``data``: its data files, and the split of the multi-turn scenarios into training and
  held-out ones;
- ``decode`` and ``single_turn``: the single-turn Python categories (``bfcl``,
  ``bfcl:<category>``): a completion's calls in the forms models answer in, BFCL's AST
  checker's rules, the suite;
- ``apis``, ``multi_turn_check``, ``multi_turn_env`` and ``multi_turn_suite``: the multi-turn
  categories (``bfcl:multi_turn_*``): one item's executable state on BFCL's own API classes,
  the multi-turn checker's rules, the items as a tool environment (``task:bfcl_multi_turn``
  trains in it), the suite.

The suites are registered in ``gdpo_ray.eval.suites``; the environment imports nothing of the
suites (training does not need the eval).
"""
