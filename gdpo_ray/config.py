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
    """One setting: its section, default and one-line doc, its kind (int, number, bool, str,
    list, mapping or any; "?" after it: None allowed; default: the default's kind), the bounds
    a number must keep (``at_least``, ``above``, ``at_most``; ``why`` explains them in the
    error), and whether a resumed run must keep it (``fixed_on_resume``)."""

    section: str
    default: Any
    doc: str
    kind: str = ""
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    why: str = ""
    fixed_on_resume: bool = False


FIELDS: dict[str, Field] = {
    # training: the method
    "estimator": Field("training", "gdpo", "advantage estimator: gdpo, gdpo_no_std, grpo, grpo_no_std"),
    "group_size": Field("training", 8, "G, completions per prompt (>= 2)", at_least=2, why="every prompt needs a group of >= 2 completions to normalize"),
    "prompts_per_step": Field("training", 8, "B, prompt groups per training step (batch sizes count groups)", at_least=1, why="a step trains on >= 1 prompt group"),
    "rewards": Field("training", [], "the K rewards: [{name, fn, params, weight, condition, timeout_s}, ...]"),
    "reward_failure_limit": Field("training", 1.0, "stop the run when a reward fails (NaN) on at least this fraction of a step's rollouts ...", above=0, why="a fraction of a step's rollouts; > 1 turns the stop off"),
    "reward_failure_steps": Field("training", 2, "... for this many steps in a row (the error is shown; limit > 1 turns the stop off)", at_least=1, why="steps in a row at the failure limit before the run stops"),
    "eps": Field("training", 1e-6, "added to every std before dividing (0 reproduces the paper's numbers)", at_least=0),
    "clip_eps_low": Field("training", 0.2, "lower clip range of the importance ratio", at_least=0),
    "clip_eps_high": Field("training", 0.28, "upper clip range (> low: DAPO's clip-higher)", at_least=0),
    "dual_clip": Field("training", None, "dual-clip constant c > 1 for negative advantages (None: off)", "number?", above=1),
    "loss_agg": Field("training", "token_mean", "token_mean, seq_mean_token_mean or seq_mean_token_sum"),
    "ratio_level": Field("training", "token", "token, or sequence (GSPO's sequence-level ratio; with clip_eps ~3e-4/4e-4 and loss_agg seq_mean_token_mean)"),
    "is_cap": Field("training", 2.0, "truncation of the off-policy weight for stale groups (None: off)", "number?", at_least=1),
    "kl_coef": Field("training", 0.0, "coefficient of the KL to the frozen reference policy (0: none)", at_least=0),
    "kl_estimator": Field("training", "k3", "KL estimator: k1, k2 or k3"),
    "max_staleness": Field("training", 0, "a group from policy v is trained at step s only if s - v <= this; 0 = synchronous", at_least=0, why="0 is the synchronous mode"),
    "dynamic_sampling": Field("training", False, "drop groups that would get no advantage (no weighted reward varies) and refill the batch (DAPO)"),
    "max_refills": Field("training", 8, "refill rounds per step under dynamic sampling before training on fewer groups", at_least=0),
    "mini_batches": Field("training", 1, "optimizer steps per epoch over a batch", at_least=1),
    "micro_batch_tokens": Field("training", 8192, "padded tokens per micro-batch (gradient accumulation beyond)", at_least=1),
    "zero_stage": Field("training", 2, "DeepSpeed ZeRO stage 0-3", at_least=0, at_most=3),
    "precision": Field("training", "fp32", "learner precision: fp32 or bf16"),
    "weight_decay": Field("training", 0.0, "AdamW weight decay"),
    "weight_sync": Field("training", "object_store", "weights to the rollout actors: object_store or broadcast"),
    "weight_bucket_mb": Field("training", 256, "bucket size of a weight push (MiB)", at_least=1),
    "eval_every": Field("training", 0, "evaluate the policy every N steps on eval_suite, on the rollout actors (0: off); metrics eval/<suite>/<metric>, the final report in the run's eval/", at_least=0, why="0 turns evaluation off"),
    "eval_suite": Field("training", None, "the suite of `gdpo-ray eval` (task:addition, math:<path>, humaneval, bfcl:<category>)", "str?"),
    "eval_samples": Field("training", 1, "completions per eval item (n of avg@n)", at_least=1),
    "eval_limit": Field("training", None, "evaluate the suite's first N items (None: all)", "int?", at_least=1),
    "eval_temperature": Field("training", 0.6, "eval sampling temperature (the paper's 0.6)", above=0),
    "eval_top_p": Field("training", 0.95, "eval top-p (the paper's 0.95; no logprobs are kept, so any engine takes it)", above=0, at_most=1),
    "eval_max_tokens": Field("training", None, "new tokens per eval completion (None: the suite's)", "int?", at_least=1),
    "checkpoint_every": Field("training", 0, "steps between automatic checkpoints used to recover a dead learner (0: off)", at_least=0, why="0 turns automatic checkpoints off"),
    "checkpoint_dir": Field("training", None, "where automatic checkpoints go (default: a temporary folder)", "str?"),
    "num_threads": Field("training", 1, "torch threads in every actor", at_least=1),
    # llm: the policy
    "model_path": Field("llm", None, "a HF model directory, or demo | tiny | smollm2 (built locally)", "str?"),
    "chat_template": Field("llm", True, "apply the tokenizer's chat template to string prompts"),
    "max_prompt_tokens": Field("llm", 1024, "longer prompts are filtered (not generated), with the reason", at_least=1),
    # generation: the rollout engine
    "engine": Field("generation", "hf", "hf (transformers), vllm, or package.module:Class of an actors.engines.Engine"),
    "mode": Field("generation", None, "streaming (continuous batching, groups out as they finish, weights in flight; vllm) or batched (one batch per call); default: streaming on vllm, batched otherwise", "str?"),
    "engine_kwargs": Field("generation", {}, "keyword arguments of the engine (e.g. vLLM's gpu_memory_utilization)"),
    "temperature": Field("generation", 1.0, "sampling temperature (the learners use the same)", above=0, why="logits / temperature"),
    "top_p": Field("generation", 1.0, "nucleus sampling (hf only; logprobs stay those of the full distribution)", above=0, at_most=1),
    "top_k": Field("generation", 0, "top-k sampling (hf only; 0 = off)", at_least=0),
    "max_tokens": Field("generation", 1024, "most tokens per response", at_least=1),
    "stop": Field("generation", [], "stop strings (kept in the response)"),
    "prompts_per_call": Field("generation", 1, "prompts per generate call of a rollout actor", at_least=1),
    "calls_per_actor": Field("generation", 2, "generate calls queued per rollout actor (batched; a streaming actor takes every prompt admission allows)", at_least=1),
    "reward_workers": Field("generation", 1, "reward scoring processes per rollout actor", at_least=1),
    "colocate": Field("generation", False, "rollout engines share the learners' bundles (GPUs) and sleep during updates"),
    # data: the prompts
    "prompts": Field("data", None, "a parquet/jsonl path, task:<name> (built-in synthetic task) or a list of rows", "any", fixed_on_resume=True),
    "num_prompts": Field("data", None, "rows of a task:<name> dataset (default: the task's own)", "int?", at_least=1, fixed_on_resume=True),
    "prompt_column": Field("data", "prompt", "column with the prompt text or chat messages", fixed_on_resume=True),
    "id_column": Field("data", None, "column of unique prompt ids (default: the row number)", "str?", fixed_on_resume=True),
    "columns": Field("data", {}, "columns taken from nested fields, {name: 'column.field'} (verl's parquet: {ground_truth: reward_model.ground_truth})", fixed_on_resume=True),
}

SECTIONS = ("training", "llm", "generation", "data")


#: RLlib's own fields that GDPO reads, with GDPO's defaults (``GDPOConfig`` sets them)
RLLIB_FIELDS: dict[str, Field] = {
    "lr": Field("training", 1e-6, "learning rate (AdamW)", "number", above=0),
    "grad_clip": Field("training", 1.0, "gradient clipping by global norm (None: off)", "number?", above=0),
    "num_epochs": Field("training", 1, "epochs over each batch", "int", at_least=1),
    "seed": Field("debugging", None, "the run's seed (prompt order, sampling, learner; None: 0)", "int?", fixed_on_resume=True),
    "num_env_runners": Field("env_runners", 1, "rollout actors: a number, or a range [min, max] (elastic)", "any"),
    "num_cpus_per_env_runner": Field("env_runners", 1, "CPUs per rollout actor", "number", at_least=0),
    "num_gpus_per_env_runner": Field("env_runners", 0, "GPUs per rollout actor", "number", at_least=0),
    "num_learners": Field("learners", 1, "DeepSpeed learners (0 counts as 1)", "int", at_least=0),
    "num_cpus_per_learner": Field("learners", 1, "CPUs per learner", "number", at_least=0),
    "num_gpus_per_learner": Field("learners", 0, "GPUs per learner", "number", at_least=0),
}


def default(name: str) -> Any:
    """A field's default (GDPO's or RLlib's field): the one place defaults are written, which
    ``LearnerConfig``, ``SamplingParams``, ``PolicyLossConfig`` and the actors' arguments use."""
    f = FIELDS.get(name) or RLLIB_FIELDS[name]
    return f.default.copy() if isinstance(f.default, (list, dict)) else f.default


#: what a resumed run must share with its checkpoint: the prompt state counts rows of this data
RESUME_FIXED = tuple(name for name, f in (FIELDS | RLLIB_FIELDS).items() if f.fixed_on_resume)


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


def check_value(name: str, value: Any, where: str = "") -> None:
    """``value`` is of field ``name``'s kind and within its bounds; else a ValueError naming
    the field (``where``: its section by default), the value, the rule and an example."""
    f = FIELDS.get(name) or RLLIB_FIELDS[name]
    where = where or f"{f.section}.{name}"
    kind = _kind(f)
    base, optional = kind.rstrip("?"), kind.endswith("?")
    if value is None and optional:
        return
    example = f"; e.g. {f.section}.{name}={f.default}" if f.default not in (None, [], {}) else ""
    if not _IS[base](value):
        wanted = _NAMES[base] + (" or null" if optional else "")
        raise ValueError(f"{where} must be {wanted}; got {value!r} ({type(value).__name__}){example}")
    bounds = [(f.at_least, ">=", value >= f.at_least if f.at_least is not None else True),
              (f.above, ">", value > f.above if f.above is not None else True),
              (f.at_most, "<=", value <= f.at_most if f.at_most is not None else True)]
    broken = [f"{op} {limit:g}" for limit, op, ok in bounds if limit is not None and not ok]
    if broken:
        rule = " and ".join(f"{op} {limit:g}" for limit, op, _ in bounds if limit is not None)
        why = f" ({f.why})" if f.why else ""
        raise ValueError(f"{where} must be {_NAMES[base]} {rule}; got {value!r}{why}{example}")


def check_fields(config: Any) -> None:
    """Every GDPO field (and the RLlib fields GDPO reads) by its kind and bounds."""
    for name in (*FIELDS, *RLLIB_FIELDS):
        if name != "num_env_runners":  # a number or a range: env_runner_range
            check_value(name, getattr(config, name, None))


def check(config: Any) -> None:
    """Every rule on the fields of a ``GDPOConfig``; raises ValueError naming field, value and fix."""
    from actors.engines import SamplingParams, engine_class
    from gdpo_ray.advantages import ESTIMATORS
    from gdpo_ray.rewards import RewardSpec, check_specs
    from gdpo_ray.weights.transports import TRANSPORTS

    c = config
    check_fields(c)
    if c.estimator not in ESTIMATORS:
        raise ValueError(f"estimator {c.estimator!r} is not one of {ESTIMATORS.names()}; "
                         "use .training(estimator='gdpo')")
    if c.mini_batches > c.prompts_per_step:
        raise ValueError(f"mini_batches ({c.mini_batches}) must be <= prompts_per_step "
                         f"({c.prompts_per_step}): a mini-batch holds whole groups")
    if not c.rewards:
        raise ValueError("no rewards: use .training(rewards=[{'name': 'correct', 'fn': "
                         "'math_correctness'}, ...]) (see gdpo_ray.rewards for the built-ins)")
    specs = [RewardSpec.from_dict(r) for r in c.rewards]
    check_specs(specs)
    for spec in specs:
        spec.resolve()  # unknown functions or params fail here, before any actor starts
    if c.weight_sync not in TRANSPORTS:
        raise ValueError(f"training.weight_sync must be one of {sorted(TRANSPORTS)}; got {c.weight_sync!r}")
    if c.precision not in ("fp32", "bf16"):
        raise ValueError(f"training.precision must be 'fp32' or 'bf16'; got {c.precision!r}")
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
    _check_mode(c)
    _check_eval(c)
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


def generation_mode(c: Any) -> str:
    """``generation.mode``, its default filled in: streaming on vllm, batched otherwise."""
    return c.mode or ("streaming" if c.engine == "vllm" else "batched")


def _check_eval(c: Any) -> None:
    """An eval schedule needs a suite, and the suite must load (its data, its packages)."""
    if c.eval_every and not c.eval_suite:
        raise ValueError(f"training.eval_every={c.eval_every} needs a suite: set training.eval_suite "
                         f"(e.g. task:addition, math:data/aime.jsonl, humaneval, bfcl:simple_python)")
    if c.eval_suite:
        from gdpo_ray.eval.suites import make_suite

        make_suite(c.eval_suite).close()


def _check_mode(c: Any) -> None:
    from actors.streaming import check_streaming_engine

    mode = generation_mode(c)
    if mode not in ("streaming", "batched"):
        raise ValueError(f"generation.mode must be 'streaming' or 'batched'; got {c.mode!r}")
    if mode == "streaming":
        check_streaming_engine(c.engine)
    if mode == "streaming" and c.colocate:
        raise ValueError("generation.mode='streaming' keeps requests in flight through every update, "
                         "and colocated engines sleep during updates: use generation.mode='batched' "
                         "with colocate=True")


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
