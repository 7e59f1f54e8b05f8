"""Judges as rewards: a rubric's criteria as reward columns (``rubric``), the judge's prompt and
the reading of its verdict (``verdict``), an OpenAI-compatible endpoint's client (``endpoint``).
The rollout actors' judging and the judge pool are ``actors.judging`` and ``actors.judge_pool``."""
