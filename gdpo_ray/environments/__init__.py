"""Tool environments for multi-turn rollouts, as TRL defines them (the basement: no Ray).

- ``spec``: an environment class loaded and checked before any actor starts; its tools (public
  methods) and their JSON schemas for the chat template;
- ``tool_calls``: the calls in a model's turn, parsed, never evaluated;
- ``session``: one rollout's instance, its calls under a time limit, its reward columns;
- ``tool_turns``: the token ids of a tool turn (or a user turn), as the chat template writes it;
- ``arithmetic``: the ``agent`` preset's calculator;
- ``bfcl_apis``, ``bfcl_check``, ``bfcl_data``, ``bfcl_multi_turn``: BFCL's multi-turn items (their
  executable APIs, the checker's rules, the data and its split) as an environment.
"""
