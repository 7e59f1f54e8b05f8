"""YAML presets and overrides onto a ``GDPOConfig``.

A preset (``configs/*.yaml``, shipped as package data ``gdpo_ray.configs``) is data only:
top-level keys are section names (GDPO's ``training``, ``llm``, ``generation``, ``data``,
RLlib's own, and ``run`` for the command line), values are keyword arguments of that section.
``load_preset`` reads one and applies ``key=value`` overrides (OmegaConf dotlist);
``apply_sections`` calls the config's builder sections with them.
"""

from __future__ import annotations

import difflib
import inspect
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from gdpo_ray.config import SECTIONS, section_fields, unknown_key


def _presets():
    """The packaged presets (``gdpo_ray.configs``), or the repository's ``configs/`` when the
    code runs from a checkout that is not installed (``ray job submit --working-dir .``)."""
    try:
        return resources.files("gdpo_ray.configs")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "configs"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in _presets().iterdir() if p.name.endswith(".yaml"))


def load_preset(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """A preset (packaged name or YAML path; None = ``demo``) with ``key=value`` overrides
    (e.g. ``training.lr=1e-5``; a value replaces the preset's, a mapping included:
    ``generation.engine_kwargs={}`` empties it) -> a plain dict of sections."""
    from omegaconf import OmegaConf

    name = name_or_path or "demo"
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ValueError(f"config file {name} does not exist")
        try:
            base = OmegaConf.load(path)
        except Exception as err:  # noqa: BLE001 - yaml's and OmegaConf's error types vary
            raise ValueError(f"config file {name} is not valid YAML: {err}") from None
    else:
        packaged = _presets() / f"{name}.yaml"
        if not packaged.is_file():
            raise ValueError(f"unknown preset {name!r}; presets: {preset_names()} (or a YAML path)")
        base = OmegaConf.create(packaged.read_text())
    for item in overrides:  # each value replaces the preset's (a mapping is not merged into it)
        key = item.split("=", 1)[0]
        section, _, name = key.partition(".")
        if (section, name) in ALIASES:  # data.environment=X replaces the preset's data.tool_environment
            key = f"{section}.{ALIASES[section, name]}"
            item = key + "=" + item.split("=", 1)[1]
        try:
            if "=" not in item or not key:
                raise ValueError("expected section.key=value")
            value = OmegaConf.select(OmegaConf.from_dotlist([item]), key)
            OmegaConf.update(base, key, value, merge=False, force_add=True)
        except Exception as err:  # noqa: BLE001 - OmegaConf's own error types vary
            raise ValueError(f"bad override {item!r}: {err}") from None
    out = OmegaConf.to_container(base, resolve=True)
    if not isinstance(out, dict):
        raise ValueError(f"{name}: a config is a mapping of sections; got {type(out).__name__}")
    return out


def apply_sections(config: Any, sections: Mapping[str, Any], skip: Sequence[str] = ("run",)) -> Any:
    """Calls ``config.<section>(**values)`` for every section of a preset dict; an unknown
    section or setting fails naming the nearest valid ones."""
    for section, values in sections.items():
        if section in skip:
            continue
        method = getattr(config, section, None)
        if not callable(method) or section.startswith("_") or section not in config_sections(config):
            near = difflib.get_close_matches(str(section), config_sections(config) + list(skip), n=2)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise ValueError(f"unknown config section {section!r}{hint} (sections: "
                             f"{', '.join(list(SECTIONS) + list(skip))} and RLlib's: "
                             f"{', '.join(s for s in config_sections(config) if s not in SECTIONS)})")
        if not isinstance(values, Mapping):
            raise ValueError(f"section {section!r} must be a mapping of settings; got {values!r}")
        values = _unaliased(section, values)
        valid = section_settings(config, section)
        for key in values:
            if key not in valid:
                raise ValueError(unknown_key(key, valid, f"section {section!r}"))
        try:
            method(**values)
        except TypeError as err:
            raise ValueError(f"section {section!r}: {err}") from None
    return config


#: (section, name) -> the setting it names: ``data.environment`` (the issue's and TRL's word) is
#: ``data.tool_environment``, whose own name cannot be ``environment`` (RLlib's builder of that name)
ALIASES = {("data", "environment"): "tool_environment"}


def _unaliased(section: str, values: Mapping[str, Any]) -> dict:
    out = {}
    for key, value in values.items():
        name = ALIASES.get((section, key), key)
        if name in out:
            raise ValueError(f"section {section!r} sets {name!r} twice ({key!r} is another name for it): keep one")
        out[name] = value
    return out


#: RLlib's builder sections a preset may use besides GDPO's
RLLIB_SECTIONS = ("env_runners", "learners", "resources", "debugging", "reporting",
                  "checkpointing", "callbacks", "fault_tolerance", "framework", "experimental")


def config_sections(config: Any) -> list[str]:
    return [s for s in (*SECTIONS, *RLLIB_SECTIONS) if callable(getattr(config, s, None))]


def section_settings(config: Any, section: str) -> list[str]:
    """The keyword arguments of ``config.<section>()``: GDPO's fields and RLlib's own."""
    from gdpo_ray.run.rllib_base import AlgorithmConfig

    names = set(section_fields(section))
    base = getattr(AlgorithmConfig, section, None)
    if base is not None:
        names |= {p for p, v in inspect.signature(base).parameters.items()
                  if p != "self" and v.kind is not v.VAR_KEYWORD}
    return sorted(names)


def resolved_sections(config: Any, run: Mapping[str, Any] | None = None) -> dict:
    """A config as a preset: every GDPO field and the RLlib fields GDPO reads, by section (and
    the ``run`` section when given), YAML-able (``gdpo-ray check`` prints it, a run saves it as
    ``config.yaml``, and ``gdpo-ray train`` takes it back)."""
    from gdpo_ray.config import FIELDS, RLLIB_FIELDS

    out: dict = {section: {} for section in SECTIONS}
    for name, f in (*FIELDS.items(), *RLLIB_FIELDS.items()):
        out.setdefault(f.section, {})[name] = getattr(config, name)
    if run is not None:
        out["run"] = dict(run)
    return _plain(out)


def _plain(value: Any) -> Any:
    """YAML-able: tuples as lists, a function as its ``module:name``, other objects by their repr."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}:{value.__qualname__}"
    return repr(value)
