"""The GDPO settings: one table of fields (section, default, one-line doc), their checks, and
the YAML presets.

``GDPOConfig`` (``gdpo_ray.algorithm``) is an RLlib ``AlgorithmConfig``; the fields below are
its own, set through its builder sections ``.training()``, ``.llm()``, ``.generation()`` and
``.data()``. RLlib's sections keep their meaning: ``.env_runners(num_env_runners=...)`` is the
number of rollout actors and their resources, ``.learners(num_learners=...,
num_gpus_per_learner=...)`` the DeepSpeed learners, ``.training(lr=..., grad_clip=...,
num_epochs=...)`` RLlib's own optimizer fields.

A preset (``configs/*.yaml``, shipped as package data) is data only: top-level keys are section
names (these four, RLlib's sections, and ``run`` for the command line), values are keyword
arguments of that section. ``load_preset`` reads one and applies ``key=value`` overrides
(OmegaConf dotlist).
"""

from __future__ import annotations

import dataclasses
import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Field:
    section: str
    default: Any
    doc: str
    kind: str = ""  # int, number, bool, str, list, mapping or any; "?" after it: None allowed.
    # Default: the default's kind.


FIELDS: dict[str, Field] = {
    # training: the method
    "estimator": Field("training", "gdpo", "advantage estimator: gdpo, gdpo_no_std, grpo, grpo_no_std"),
    "group_size": Field("training", 8, "G, completions per prompt (>= 2)"),
    "prompts_per_step": Field("training", 8, "B, prompt groups per training step (batch sizes count groups)"),
    "rewards": Field("training", [], "the K rewards: [{name, fn, params, weight, condition, timeout_s}, ...]"),
    "reward_failure_limit": Field("training", 1.0, "stop the run when a reward fails (NaN) on at least this fraction of a step's rollouts ..."),
    "reward_failure_steps": Field("training", 2, "... for this many steps in a row (the error is shown; limit > 1 turns the stop off)"),
    "eps": Field("training", 1e-6, "added to every std before dividing (0 reproduces the paper's numbers)"),
    "clip_eps_low": Field("training", 0.2, "lower clip range of the importance ratio"),
    "clip_eps_high": Field("training", 0.28, "upper clip range (> low: DAPO's clip-higher)"),
    "dual_clip": Field("training", None, "dual-clip constant c > 1 for negative advantages (None: off)", "number?"),
    "loss_agg": Field("training", "token_mean", "token_mean, seq_mean_token_mean or seq_mean_token_sum"),
    "ratio_level": Field("training", "token", "token, or sequence (GSPO's sequence-level ratio; with clip_eps ~3e-4/4e-4 and loss_agg seq_mean_token_mean)"),
    "is_cap": Field("training", 2.0, "truncation of the off-policy weight for stale groups (None: off)", "number?"),
    "kl_coef": Field("training", 0.0, "coefficient of the KL to the frozen reference policy (0: none)"),
    "kl_estimator": Field("training", "k3", "KL estimator: k1, k2 or k3"),
    "max_staleness": Field("training", 0, "a group from policy v is trained at step s only if s - v <= this; 0 = synchronous"),
    "dynamic_sampling": Field("training", False, "drop groups that would get no advantage (no weighted reward varies) and refill the batch (DAPO)"),
    "max_refills": Field("training", 8, "refill rounds per step under dynamic sampling before training on fewer groups"),
    "mini_batches": Field("training", 1, "optimizer steps per epoch over a batch"),
    "micro_batch_tokens": Field("training", 8192, "padded tokens per micro-batch (gradient accumulation beyond)"),
    "zero_stage": Field("training", 2, "DeepSpeed ZeRO stage 0-3"),
    "precision": Field("training", "fp32", "learner precision: fp32 or bf16"),
    "weight_decay": Field("training", 0.0, "AdamW weight decay"),
    "weight_sync": Field("training", "object_store", "weights to the rollout actors: object_store or broadcast"),
    "weight_bucket_mb": Field("training", 256, "bucket size of a weight push (MiB)"),
    "checkpoint_every": Field("training", 0, "steps between automatic checkpoints used to recover a dead learner (0: off)"),
    "checkpoint_dir": Field("training", None, "where automatic checkpoints go (default: a temporary folder)", "str?"),
    "num_threads": Field("training", 1, "torch threads in every actor"),
    # llm: the policy
    "model_path": Field("llm", None, "a HF model directory, or demo | tiny | smollm2 (built locally)", "str?"),
    "chat_template": Field("llm", True, "apply the tokenizer's chat template to string prompts"),
    "max_prompt_tokens": Field("llm", 1024, "longer prompts are filtered (not generated), with the reason"),
    # generation: the rollout engine
    "engine": Field("generation", "hf", "hf (transformers), vllm, or package.module:Class of an actors.engines.Engine"),
    "engine_kwargs": Field("generation", {}, "keyword arguments of the engine (e.g. vLLM's gpu_memory_utilization)"),
    "temperature": Field("generation", 1.0, "sampling temperature (the learners use the same)"),
    "top_p": Field("generation", 1.0, "nucleus sampling (hf only; logprobs stay those of the full distribution)"),
    "top_k": Field("generation", 0, "top-k sampling (hf only; 0 = off)"),
    "max_tokens": Field("generation", 1024, "most tokens per response"),
    "stop": Field("generation", [], "stop strings (kept in the response)"),
    "prompts_per_call": Field("generation", 1, "prompts per generate call of a rollout actor"),
    "calls_per_actor": Field("generation", 2, "generate calls queued per rollout actor"),
    "reward_workers": Field("generation", 1, "reward scoring processes per rollout actor"),
    "colocate": Field("generation", False, "rollout engines share the learners' bundles (GPUs) and sleep during updates"),
    # data: the prompts
    "prompts": Field("data", None, "a parquet/jsonl path, task:<name> (built-in synthetic task) or a list of rows", "any"),
    "num_prompts": Field("data", None, "rows of a task:<name> dataset (default: the task's own)", "int?"),
    "prompt_column": Field("data", "prompt", "column with the prompt text or chat messages"),
    "id_column": Field("data", None, "column of unique prompt ids (default: the row number)", "str?"),
    "columns": Field("data", {}, "columns taken from nested fields, {name: 'column.field'} (verl's parquet: {ground_truth: reward_model.ground_truth})"),
}

SECTIONS = ("training", "llm", "generation", "data")


#: RLlib's own fields that GDPO reads, with their section and kind
RLLIB_FIELDS: dict[str, tuple[str, str, Any]] = {
    "lr": ("training", "number", 1e-5), "grad_clip": ("training", "number?", 1.0),
    "num_epochs": ("training", "int", 1), "seed": ("debugging", "int?", 0),
    "num_learners": ("learners", "int", 1), "num_gpus_per_learner": ("learners", "number", 1),
    "num_cpus_per_env_runner": ("env_runners", "number", 1),
    "num_gpus_per_env_runner": ("env_runners", "number", 1),
}


def section_fields(section: str) -> list[str]:
    return [name for name, f in FIELDS.items() if f.section == section]


def unknown_key(key: Any, valid: Sequence[str], where: str) -> str:
    """The message for an unknown setting: the nearest valid names, then all of them."""
    near = difflib.get_close_matches(str(key), list(valid), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return f"unknown setting {key!r} of {where}{hint} (valid: {', '.join(sorted(valid))})"


def _kind(f: Field) -> str:
    if f.kind:
        return f.kind
    d = f.default
    return ("bool" if isinstance(d, bool) else "int" if isinstance(d, int) else "number"
            if isinstance(d, float) else "str" if isinstance(d, str) else "list"
            if isinstance(d, list) else "mapping" if isinstance(d, dict) else "any")


_IS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
       "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
       "list": lambda v: isinstance(v, (list, tuple)), "mapping": lambda v: isinstance(v, Mapping),
       "any": lambda v: True}
_NAMES = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
          "list": "a list", "mapping": "a mapping {key: value}"}


def check_types(config: Any) -> None:
    """Every GDPO field (and the RLlib fields GDPO reads) holds a value of its kind."""
    table = {name: (f.section, _kind(f), f.default) for name, f in FIELDS.items()}
    table |= RLLIB_FIELDS
    for name, (section, kind, default) in table.items():
        value = getattr(config, name, None)
        base, optional = kind.rstrip("?"), kind.endswith("?")
        if (value is None and optional) or _IS[base](value):
            continue
        wanted = _NAMES[base] + (" or null" if optional else "")
        example = f"; e.g. {section}.{name}={default}" if default not in (None, [], {}) else ""
        raise ValueError(f"{section}.{name} must be {wanted}; got {value!r} "
                         f"({type(value).__name__}){example}")


def check(config: Any) -> None:
    """Every rule on the fields of a ``GDPOConfig``; raises ValueError naming field, value and fix."""
    from actors.engines import SamplingParams, engine_class
    from gdpo_ray.advantages import ESTIMATORS
    from gdpo_ray.rewards import RewardSpec, check_specs

    c = config
    check_types(c)
    if not (isinstance(c.lr, (int, float)) and c.lr > 0):
        raise ValueError(f"training.lr must be > 0; got {c.lr!r}")
    if c.reward_failure_limit <= 0:
        raise ValueError(f"reward_failure_limit must be > 0 (a fraction of a step's rollouts; > 1 "
                         f"turns the stop off); got {c.reward_failure_limit!r}")
    _int_at_least(c, "reward_failure_steps", 1, "steps in a row at the failure limit before the run stops")
    if c.estimator not in ESTIMATORS:
        raise ValueError(f"estimator {c.estimator!r} is not one of {ESTIMATORS.names()}; "
                         "use .training(estimator='gdpo')")
    _int_at_least(c, "group_size", 2, "every prompt needs a group of >= 2 completions to normalize")
    _int_at_least(c, "prompts_per_step", 1, "a step trains on >= 1 prompt group")
    _int_at_least(c, "max_staleness", 0, "0 is the synchronous mode")
    _int_at_least(c, "mini_batches", 1, "")
    _int_at_least(c, "micro_batch_tokens", 1, "")
    _int_at_least(c, "checkpoint_every", 0, "0 turns automatic checkpoints off")
    _int_at_least(c, "max_refills", 0, "")
    if c.mini_batches > c.prompts_per_step:
        raise ValueError(f"mini_batches ({c.mini_batches}) must be <= prompts_per_step "
                         f"({c.prompts_per_step}): a mini-batch holds whole groups")
    if not (isinstance(c.eps, (int, float)) and c.eps >= 0):
        raise ValueError(f"eps must be a number >= 0; got {c.eps!r}")
    if not c.rewards:
        raise ValueError("no rewards: use .training(rewards=[{'name': 'correct', 'fn': "
                         "'math_correctness'}, ...]) (see gdpo_ray.rewards for the built-ins)")
    specs = [RewardSpec.from_dict(r) for r in c.rewards]
    check_specs(specs)
    for spec in specs:
        spec.resolve()  # unknown functions or params fail here, before any actor starts
    if c.weight_sync not in ("object_store", "broadcast"):
        raise ValueError(f"weight_sync must be 'object_store' or 'broadcast'; got {c.weight_sync!r}")
    if c.model_path is None:
        raise ValueError("no policy model: use .llm(model_path='path/to/hf_model') (or 'demo', "
                         "'tiny', 'smollm2')")
    if c.prompts is None:
        raise ValueError("no prompts: use .data(prompts='train.parquet') (or 'task:addition')")
    if not isinstance(c.columns, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in c.columns.items()):
        raise ValueError(f"columns must map column names to nested fields, e.g. .data(columns="
                         f"{{'ground_truth': 'reward_model.ground_truth'}}); got {c.columns!r}")
    engine_class(c.engine).check_sampling(SamplingParams(**sampling_params(c)))
    policy_loss_config(c)
    if c.ratio_level == "sequence":
        _check_gspo(c)
    low, high = env_runner_range(c)
    if low != high and not c.custom_resources_per_env_runner:
        raise ValueError(f"num_env_runners {list(c.num_env_runners)} is elastic: rollout actors "
                         "are counted by a custom Ray resource of the rollout nodes; use "
                         ".env_runners(custom_resources_per_env_runner={'rollout': 1})")
    if c.colocate:
        if c.max_staleness != 0:
            raise ValueError(f"colocate=True shares devices between generation and learning, which "
                             f"cannot overlap: use max_staleness=0 (got {c.max_staleness})")
        if low != high or low != max(1, c.num_learners):
            raise ValueError(f"colocate=True puts one rollout actor beside each learner: use "
                             f"num_env_runners == num_learners (got {c.num_env_runners} and "
                             f"{c.num_learners})")


#: widest clip range that still acts on GSPO's sequence ratio (a mean of per-token log-ratios,
#: which stays within ~1e-3 of 1); GSPO's paper uses 3e-4 / 4e-4
GSPO_MAX_CLIP = 0.01


def _check_gspo(c: Any) -> None:
    if max(c.clip_eps_low, c.clip_eps_high) > GSPO_MAX_CLIP:
        raise ValueError(
            f"ratio_level='sequence' (GSPO) clips the sequence-level ratio, which stays within "
            f"~1e-3 of 1: clip_eps_low={c.clip_eps_low} / clip_eps_high={c.clip_eps_high} leave "
            f"its clipping almost inactive (the limit here is {GSPO_MAX_CLIP}); use "
            f".training(clip_eps_low=3e-4, clip_eps_high=4e-4) (GSPO's values)")
    if c.loss_agg != "seq_mean_token_mean":
        raise ValueError(
            f"ratio_level='sequence' (GSPO) averages the policy loss over rollouts (each term is "
            f"already a per-token mean), so loss_agg={c.loss_agg!r} would be ignored there; use "
            f".training(loss_agg='seq_mean_token_mean'), which the KL term then follows too")


def merge_resources(*bundles: Mapping[str, float]) -> dict:
    """Ray resource bundles added up, keys of amount 0 dropped (a bundle shared by a learner
    and the rollout actor beside it)."""
    out: dict = {}
    for bundle in bundles:
        for key, value in bundle.items():
            out[key] = out.get(key, 0) + value
    return {k: v for k, v in out.items() if v}


def env_runner_range(c: Any) -> tuple[int, int]:
    """(min, max) rollout actors: ``num_env_runners`` is a number or a range [min, max]."""
    value = c.num_env_runners
    if isinstance(value, (list, tuple)) and len(value) == 2:
        low, high = value
    else:
        low = high = value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not 1 <= low <= high:
        raise ValueError(f"num_env_runners must be an integer >= 1 or a range [min, max] with "
                         f"1 <= min <= max; got {value!r}; use .env_runners(num_env_runners=1)")
    return low, high


def _int_at_least(config: Any, name: str, low: int, why: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}" + (f" ({why})" if why else ""))


def sampling_params(c: Any) -> dict:
    return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens,
                stop=tuple(c.stop))


def policy_loss_config(c: Any):
    from gdpo_ray.losses import PolicyLossConfig

    return PolicyLossConfig(clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high,
                            dual_clip=c.dual_clip, loss_agg=c.loss_agg, ratio_level=c.ratio_level,
                            is_cap=c.is_cap, kl_coef=c.kl_coef, kl_estimator=c.kl_estimator)


# --------------------------------------------------------------------------------------------
# YAML presets


def _presets():
    """The packaged presets (``gdpo_ray.configs``), or the repository's ``configs/`` when the
    code runs from a checkout that is not installed (``ray job submit --working-dir .``)."""
    try:
        return resources.files("gdpo_ray.configs")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "configs"


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
        valid = section_settings(config, section)
        for key in values:
            if key not in valid:
                raise ValueError(unknown_key(key, valid, f"section {section!r}"))
        try:
            method(**values)
        except TypeError as err:
            raise ValueError(f"section {section!r}: {err}") from None
    return config


#: RLlib's builder sections a preset may use besides GDPO's
RLLIB_SECTIONS = ("env_runners", "learners", "resources", "debugging", "reporting",
                  "checkpointing", "callbacks", "fault_tolerance", "framework", "experimental")


def config_sections(config: Any) -> list[str]:
    return [s for s in (*SECTIONS, *RLLIB_SECTIONS) if callable(getattr(config, s, None))]


def section_settings(config: Any, section: str) -> list[str]:
    """The keyword arguments of ``config.<section>()``: GDPO's fields and RLlib's own."""
    import inspect

    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    names = set(section_fields(section))
    base = getattr(AlgorithmConfig, section, None)
    if base is not None:
        names |= {p for p, v in inspect.signature(base).parameters.items()
                  if p != "self" and v.kind is not v.VAR_KEYWORD}
    return sorted(names)
