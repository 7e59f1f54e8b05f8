"""Tool environments for multi-turn rollouts, as TRL defines them (the basement: no Ray).

- ``spec``: an environment class loaded and checked before any actor starts; its tools (public
  methods) and their JSON schemas for the chat template;
- ``session``: one rollout's instance: its calls answered whatever they do, its reward columns;
- ``process``: the instance in a process of its own, each call bounded by killing it;
- ``columns``: the reward columns an environment gives (NeMo-Gym's ``reward_components`` too),
  one schema in every rollout, checked at start-up and at every rollout;
- ``verifiers_env``: a verifiers taskset (the ``verifiers`` extra) as an environment, each of its
  rewards a column of its own;
- ``tool_turns``: the token ids of a tool turn (or a user turn), as the chat template writes it;
- ``arithmetic``: the ``agent`` preset's calculator.

The calls in a model's turn are read by ``gdpo_ray.tool_format`` (parsed, never evaluated);
BFCL's multi-turn items as an environment are ``gdpo_ray.bfcl.multi_turn_env``.
"""
