"""Where ``gdpo-ray eval --suite rewards:FILE`` gets a run's reward functions from.

``--rewards CONFIG``: a preset name or a YAML path (read as ``gdpo-ray train`` reads it:
``presets.load_preset``, then ``apply_sections`` onto a ``GDPOConfig``: ``eval_command``), or a run directory, whose
resolved config is its ``config.yaml`` (written by every run, in a preset's format). Without
``--rewards``, the run directory evaluated (POLICY: a run directory, or its ``policy/``).
The suite (``gdpo_ray.eval.rewards_suite``) gets the config's rewards and what it reads the held-out
file and generates with: ``data.prompt_column``, ``data.id_column``, ``data.columns``,
``generation.max_tokens``, ``data.tool_environment``, ``generation.max_turns``,
``generation.tool_timeout``, ``data.tools_in_system_prompt``, ``data.system_prompt`` and
``llm.chat_template``: a base model evaluated with ``--rewards RUN`` is generated as the run's
policy is, unless the command line says otherwise.
"""

from __future__ import annotations

from pathlib import Path

#: a run directory's resolved config
RUN_CONFIG = "config.yaml"


def run_config(path: str | Path) -> Path | None:
    """The ``config.yaml`` of a run directory ``path``, or of the run whose ``policy/`` (or
    ``policy-merged/``) ``path`` is; None when ``path`` is neither."""
    path = Path(path).expanduser()
    for run in (path, path.parent) if path.name in ("policy", "policy-merged") else (path,):
        if (run / RUN_CONFIG).is_file():
            return run / RUN_CONFIG
    return None


def config_path(rewards: str | None, policy: str | None) -> str:
    """The preset name or YAML path the rewards come from (see the module docstring)."""
    if rewards is not None:
        path = Path(rewards).expanduser()
        if path.is_dir():
            found = run_config(path)
            if found is None:
                raise ValueError(f"--rewards {rewards}: a directory without {RUN_CONFIG}; give the run "
                                 f"directory (runs write their resolved config there), or the preset or "
                                 f"YAML file the run was started with")
            return str(found)
        return rewards
    found = run_config(policy) if policy is not None else None
    if found is None:
        what = f"POLICY {policy!r} is not a run directory with {RUN_CONFIG}" if policy else "no POLICY is given"
        raise ValueError(f"--suite rewards:FILE needs the reward functions to score with, and {what}: give "
                         f"--rewards CONFIG (the run directory, or the preset or YAML file it was trained with)")
    return str(found)


def config_options(c, source: str) -> dict:
    """The ``rewards:`` suite's options from a ``GDPOConfig`` (``source``: where it came from):
    its rewards (an environment's ``get_reward()`` column added as training adds it), what it
    reads the held-out file with, and how its rollouts are made (tool environment, turns, tool
    settings, system prompt, template)."""
    from gdpo_ray.config import environment_settings, section_fields
    from gdpo_ray.environments.spec import with_environment_columns
    from gdpo_ray.judges.rubric import expand_judges

    tools = environment_settings(c)
    rewards = expand_judges(with_environment_columns(list(c.rewards), c.tool_environment, c.tool_timeout))
    return dict(rewards=rewards, prompt_column=c.prompt_column,
                id_column=c.id_column, columns=dict(c.columns), max_tokens=c.max_tokens,
                environment=c.tool_environment, max_turns=c.max_turns, source=source,
                tool_settings={k: tools[k] for k in ("tool_timeout", "tools_in_system_prompt") if k in tools},
                judges={k: getattr(c, k) for k in section_fields("judges")},
                system_prompt=c.system_prompt, chat_template=c.chat_template)


def training_suite_options(c) -> dict:
    """The options of a run's own ``training.eval_suite``: a ``rewards:FILE`` suite scores with the
    run's ``training.rewards``; other suites take none."""
    return config_options(c, "training.rewards") if (c.eval_suite or "").startswith("rewards:") else {}
