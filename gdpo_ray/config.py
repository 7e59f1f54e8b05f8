"""The GDPO settings: one table of fields (section, default, one-line doc) and the checks of
each value by itself. This module is a leaf: it imports nothing of the project (the checks
across components live in ``gdpo_ray.run.validation``, the presets in ``gdpo_ray.run.presets``).

``GDPOConfig`` (``gdpo_ray.run.algorithm``) is an RLlib ``AlgorithmConfig``; the fields below are
its own, set through its builder sections ``.training()``, ``.llm()``, ``.generation()`` and
``.data()``, and ``backend`` of RLlib's ``.learners()``. RLlib's sections keep their meaning:
``.env_runners(num_env_runners=...)`` is the number of rollout actors and their resources,
``.learners(num_learners=..., num_gpus_per_learner=..., backend=...)`` the learners (DeepSpeed or
FSDP2), ``.training(lr=..., grad_clip=..., num_epochs=...)`` RLlib's own optimizer fields.

A preset (``configs/*.yaml``, shipped as package data) is data only: top-level keys are section
names (these four, RLlib's sections, and ``run`` for the command line), values are keyword
arguments of that section (``gdpo_ray.run.presets.load_preset``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
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
    "rewards": Field("training", [], "the K rewards: [{name, fn, params, weight, condition, timeout_s, floor}, ...]; a judge's entry {name, fn: judge, judge, criteria, prompt} gives a column per criterion (docs/judges.md)"),
    "reward_failure_limit": Field("training", 1.0, "stop the run when a reward fails (NaN) on at least this fraction of a step's rollouts ...", above=0, why="a fraction of a step's rollouts; > 1 turns the stop off"),
    "reward_failure_steps": Field("training", 2, "... for this many steps in a row (the error is shown; limit > 1 turns the stop off)", at_least=1, why="steps in a row at the failure limit before the run stops"),
    "eps": Field("training", 1e-6, "added to every std before dividing (0 reproduces the paper's numbers)", at_least=0),
    "clip_eps_low": Field("training", 0.2, "lower clip range of the importance ratio", at_least=0),
    "clip_eps_high": Field("training", 0.28, "upper clip range (> low: DAPO's clip-higher)", at_least=0),
    "dual_clip": Field("training", None, "dual-clip constant c > 1 for negative advantages (None: off)", "number?", above=1),
    "loss_agg": Field("training", "token_mean", "token_mean, seq_mean_token_mean or seq_mean_token_sum"),
    "ratio_level": Field("training", "token", "token, or sequence (GSPO's sequence-level ratio; with clip_eps ~3e-4/4e-4 and loss_agg seq_mean_token_mean)"),
    "off_policy": Field("training", {"level": "token", "mode": "truncate", "cap": 2.0}, "off-policy correction of stale tokens: {level: token | sequence | product, mode: truncate (cap) | mask (low, high) | none, outlier_low, outlier_high}, or none (docs/training.md)", "any"),
    "kl_coef": Field("training", 0.0, "coefficient of the KL to the frozen reference policy (0: none)", at_least=0),
    "kl_estimator": Field("training", "k3", "KL estimator: k1, k2 or k3"),
    "max_staleness": Field("training", 0, "a group from policy v is trained at step s only if s - v <= this; 0 = synchronous", at_least=0, why="0 is the synchronous mode"),
    "dynamic_sampling": Field("training", False, "drop groups that would get no advantage (no weighted reward varies) and refill the batch (DAPO)"),
    "max_refills": Field("training", 8, "refill rounds per step under dynamic sampling before training on fewer groups", at_least=0),
    "mini_batches": Field("training", 1, "optimizer steps per epoch over a batch", at_least=1),
    "micro_batch_tokens": Field("training", 8192, "tokens per micro-batch (gradient accumulation beyond): real tokens when the forward is packed, padded ones otherwise", at_least=1),
    "packing": Field("training", True, "the update's forward packs a micro-batch's rows end to end, each prompt once per line, attention confined to each row (no padding; models with sdpa or eager attention: docs/learners.md); false: a padded row per rollout, prompts shared through a cache"),
    "gradient_checkpointing": Field("training", False, "recompute each layer's activations in backward instead of keeping them (less learner memory, about a third more update time)"),
    "zero_stage": Field("training", 2, "DeepSpeed ZeRO stage 0-3 (learners.backend=deepspeed; fsdp2 always shards parameters, gradients and optimizer state: ZeRO-3's layout)", at_least=0, at_most=3),
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
    "eval_length_limit": Field("training", None, "exceed_ratio's limit in tokens (None: the suite's own; gdpo-ray eval --length-limit)", "int?", at_least=1),
    "eval_max_tokens": Field("training", None, "new tokens per eval completion (None: the suite's)", "int?", at_least=1),
    "eval_correct": Field("training", None, "a correct eval sample: conditions on the suite's metrics, e.g. ['answer>=1', 'tool_success>=1'] (all must hold; as gdpo-ray eval --correct): metrics eval/<suite>/accuracy and <name>/pass_rate, and eval_pass_k counts them; None: the suite's own", "list?"),
    "eval_pass_k": Field("training", None, "also pass@k of the eval for these k, e.g. [1, 4, 16] (Chen et al.'s unbiased estimator; each k <= eval_samples): metrics eval/<suite>/pass@<k>; None: none", "list?"),
    "checkpoint_every": Field("training", 0, "steps between automatic checkpoints used to recover a dead learner (0: off)", at_least=0, why="0 turns automatic checkpoints off"),
    "checkpoint_dir": Field("training", None, "where automatic checkpoints go (default: a temporary folder)", "str?"),
    "keep_checkpoints": Field("training", None, "keep the newest N automatic step checkpoints, deleting older ones (None: all; the final checkpoint is always kept)", "int?", at_least=1),
    "resume_without_manifest": Field("training", False, "resume (--resume, restore_from_path, Tune) a checkpoint that has no gdpo_manifest.json (written by an older gdpo-ray, or its manifest removed): its files are then checked for presence only, not against what was saved; false: such a checkpoint is refused"),
    "log_completions": Field("training", 0, "samples per step written to completions.jsonl in the run directory (prompt, completion, every reward, the advantage, the finish reason), and as a table to TensorBoard, wandb and MLflow where run.loggers has them (0: none)", at_least=0),
    "num_threads": Field("training", 1, "torch threads in every actor", at_least=1),
    "threads_alone": Field("training", None, "torch threads a learner takes while no rollout is in flight beside its update (the synchronous mode, or the staleness bound reached): the rollout actors' cores are idle then; for learners and rollout actors that share one machine's CPUs, e.g. 2 on 2 cores (None: training.num_threads, nothing lent)", "int?", at_least=1),
    # llm: the policy
    "model_path": Field("llm", None, "a HF model directory, or demo | demo-tools | demo-count | demo-agent | tiny | smollm2 (built locally)", "str?"),
    "chat_template": Field("llm", True, "apply the tokenizer's chat template to string prompts"),
    "max_prompt_tokens": Field("llm", 1024, "longer prompts are filtered (not generated), with the reason", at_least=1),
    "lora": Field("llm", None, "LoRA adapters instead of full fine-tuning, in PEFT's names: {r (rank, required), lora_alpha (8), lora_dropout (0.0), target_modules (a list of module names, or all-linear: every linear layer but the output head; the default)}; null or {}: full fine-tuning (gdpo_ray.lora)", "mapping?", fixed_on_resume=True),
    # generation: the rollout engine
    "engine": Field("generation", "hf", "hf (transformers), vllm, simulated (no model: tokens at the rates of simulation.timing; docs/scale.md), or package.module:Class of an actors.engines.BatchEngine (StreamingEngine with mode streaming)"),
    "mode": Field("generation", None, "streaming (continuous batching, groups out as they finish, weights in flight; vllm) or batched (one batch per call); default: streaming on vllm, batched otherwise", "str?"),
    "engine_kwargs": Field("generation", {}, "keyword arguments of the engine (e.g. vLLM's gpu_memory_utilization)"),
    "temperature": Field("generation", 1.0, "sampling temperature (the learners use the same)", above=0, why="logits / temperature"),
    "top_p": Field("generation", 1.0, "nucleus sampling (1 = off)", above=0, at_most=1),
    "top_k": Field("generation", 0, "top-k sampling (0 = off)", at_least=0),
    "min_p": Field("generation", 0.0, "min-p sampling: tokens less likely than min_p times the most likely are cut (0 = off)", at_least=0, at_most=1),
    "truncated_logprobs": Field("generation", True, "under min_p/top_k/top_p the rollouts' and the learners' logprobs are the token's under the truncated, renormalized distribution it was drawn from (exact importance ratios); false: the full distribution's, TRL's behaviour (docs/training.md)"),
    "max_tokens": Field("generation", 1024, "most tokens per response", at_least=1),
    "stop": Field("generation", [], "stop strings (kept in the response)"),
    "max_turns": Field("generation", 10, "most model turns of a multi-turn rollout (data.tool_environment); max_tokens bounds the whole trajectory, tool turns included", at_least=1),
    "tool_timeout": Field("generation", 30.0, "seconds any call of an environment's code (__init__, reset, a tool, next_message, get_rewards) may take; past it the process running it is killed and the call counted (docs/faults.md)", above=0, at_most=3600, why="a hung tool must not stall its rollout for longer than an hour"),
    "prompts_per_call": Field("generation", 1, "prompts per generate call of a rollout actor", at_least=1),
    "calls_per_actor": Field("generation", 2, "generate calls queued per rollout actor (batched; a streaming actor takes every prompt admission allows)", at_least=1),
    "reward_workers": Field("generation", None, "reward scoring processes per rollout actor (None: training.num_threads, the cores the actor's threads take: scoring runs between its generation and the update)", "int?", at_least=1),
    "colocate": Field("generation", False, "rollout engines share the learners' bundles (GPUs) and sleep during updates"),
    "engine_in_learner": Field("generation", False, "the hf engine runs in learner rank 0's process and shares its module: nothing is pushed, one process fewer (synchronous runs: max_staleness 0, one learner, one rollout actor; docs/rollouts.md)"),
    # data: the prompts
    "prompts": Field("data", None, "a parquet/jsonl path, task:<name> (built-in synthetic task) or a list of rows", "any", fixed_on_resume=True),
    "num_prompts": Field("data", None, "rows of a task:<name> dataset (default: the task's own)", "int?", at_least=1, at_most=1_000_000, why="the rows of a built-in task are made in memory; a larger dataset belongs in a file", fixed_on_resume=True),
    "prompt_column": Field("data", "prompt", "column with the prompt text or chat messages", fixed_on_resume=True),
    "id_column": Field("data", None, "column of unique prompt ids (default: the row number)", "str?", fixed_on_resume=True),
    "tool_environment": Field("data", None, "tool environment of multi-turn rollouts: 'module:Class' (TRL's environment class: its public methods are the tools, reset(**row) starts a rollout), or TRL's dict form {name: 'module:Class'} with the row's `environment` column naming its class; also `data.environment` in a preset or override", "any", fixed_on_resume=True),
    "tools_in_system_prompt": Field("data", "auto", "where the model is shown the environment's tools: auto (in the system message where the chat template ignores tools=, else the template's way), always, never; the format: docs/environments.md"),
    "system_prompt": Field("data", None, "a system message put before every prompt (a chat-message prompt with its own system message keeps its own; needs llm.chat_template)", "str?"),
    "columns": Field("data", {}, "columns taken from nested fields, {name: 'column.field'} (verl's parquet: {ground_truth: reward_model.ground_truth})", fixed_on_resume=True),
    # judges: the judge pool gdpo-ray serves, for fn: judge rewards that name no url
    "num_judges": Field("judges", 1, "judge actors of the pool gdpo-ray serves (started only when a judge reward's judge names no url; each holds the judge model)", at_least=1),
    "num_cpus_per_judge": Field("judges", 1, "CPUs per judge actor (apart from the rollout actors and learners)", "number", at_least=0),
    "num_gpus_per_judge": Field("judges", 0, "GPUs per judge actor", "number", at_least=0),
    "judge_engine": Field("judges", "hf", "the judge actors' engine: hf (CPU), vllm, or package.module:Class of an actors.engines.BatchEngine"),
    "judge_engine_kwargs": Field("judges", {}, "keyword arguments of the judges' engine (e.g. vLLM's gpu_memory_utilization)"),
    "judge_batch_size": Field("judges", 8, "judge messages per engine call of a judge actor (a rollout actor's messages asked together are split into such batches)", at_least=1),
    "judge_decoding": Field("judges", "generate", "how a pool judge gives its verdict: generate (writes it) or scores (the hf engine: each criterion's score the expected value of the scale's integers under the next-token probabilities after {\"<name>\":, as G-Eval; for small judges that cannot write the format)"),
    "judge_max_prompt_tokens": Field("judges", 4096, "a longer judge message is not judged: its criteria are NaN with the reason", at_least=1),
    # simulation: the timing model of generation.engine / learners.backend simulated (docs/scale.md)
    "timing": Field("simulation", "llama3-8b-h100", "the simulated engines' and learners' speed: a profile (llama3-8b-h100, llama3-70b-h100x4, qwen3-0.6b-h100: published figures) or {profile, step_s, step_s_per_seq, prefill_tokens_per_s, max_num_seqs, train_tokens_per_s, weight_bytes, load_bytes_per_s} (gdpo_ray.simulation.TimingModel)", "any"),
    "response_lengths": Field("simulation", {"dist": "lognormal", "tokens": 800, "sigma": 0.8}, "new tokens per simulated response (at most generation.max_tokens): {dist: fixed | uniform | lognormal, tokens (fixed; lognormal's median), sigma, low, high (uniform)}"),
    "time_scale": Field("simulation", 1.0, "every modelled second (generation, prefill, loads, updates) times this", above=0),
    "weight_bytes": Field("simulation", 64 << 20, "bytes a simulated learner pushes each step (the model's own, timing.weight_bytes, rarely fits one machine's object store 64 times over)", at_least=1),
    "weight_tensors": Field("simulation", 128, "tensors the simulated push is cut into (an 8B Llama has 291)", at_least=1),
    "lora_fraction": Field("simulation", 0.005, "under llm.lora the simulated push is this fraction of weight_bytes (a rank-16 adapter on every linear layer of an 8B Llama: 0.5%)", above=0, at_most=1),
    # learners (RLlib's section, beside its learner fields below): the training engine
    "backend": Field("learners", "deepspeed", "the learners' training engine: deepspeed (ZeRO stage training.zero_stage) or fsdp2 (torch's fully_shard), simulated (no model: the update time of simulation.timing; docs/scale.md), or package.module:Class of a learners.learner.Learner (learners.backend)", fixed_on_resume=True),
}

SECTIONS = ("training", "llm", "generation", "data", "judges", "simulation")  # GDPO's own builder sections (a field may be of RLlib's)


#: RLlib's own fields that GDPO reads, with GDPO's defaults (``GDPOConfig`` sets them)
RLLIB_FIELDS: dict[str, Field] = {
    "lr": Field("training", 1e-6, "learning rate (AdamW)", "number", above=0),
    "grad_clip": Field("training", 1.0, "gradient clipping by global norm (None: off)", "number?", above=0),
    "num_epochs": Field("training", 1, "epochs over each batch", "int", at_least=1),
    "seed": Field("debugging", None, "the run's seed (prompt order, sampling, learner; None: 0)", "int?", fixed_on_resume=True),
    "num_env_runners": Field("env_runners", 1, "rollout actors: a number, or a range [min, max] (elastic)", "any"),
    "num_cpus_per_env_runner": Field("env_runners", 1, "CPUs per rollout actor", "number", at_least=0),
    "num_gpus_per_env_runner": Field("env_runners", 0, "GPUs per rollout actor", "number", at_least=0),
    "num_learners": Field("learners", 1, "learners, ranks of one data-parallel group (0 counts as 1)", "int", at_least=0),
    "num_cpus_per_learner": Field("learners", 1, "CPUs per learner", "number", at_least=0),
    "num_gpus_per_learner": Field("learners", 0, "GPUs per learner", "number", at_least=0),
}


def default(name: str) -> Any:
    """A field's default (GDPO's or RLlib's field): the one place defaults are written, which
    ``LearnerConfig``, ``SamplingParams``, ``PolicyLossConfig`` and the actors' arguments use."""
    f = FIELDS.get(name) or RLLIB_FIELDS[name]
    return f.default.copy() if isinstance(f.default, (list, dict)) else f.default


#: what a resumed run must share with its checkpoint: the prompt state counts rows of this data,
#: and the saved weights are those of this adapter (``llm.lora``; compared normalized)
RESUME_FIXED = tuple(name for name, f in (FIELDS | RLLIB_FIELDS).items() if f.fixed_on_resume)


def section_fields(section: str) -> list[str]:
    return [name for name, f in FIELDS.items() if f.section == section]


#: TRL GRPOConfig's names of settings that do the same job here: name -> (where it is here, what
#: differs); the migration page (docs/training.md, "From TRL's GRPOConfig") is this table
TRL_NAMES = {
    "learning_rate": ("training.lr", ""),
    "num_generations": ("training.group_size", ""),
    "max_completion_length": ("generation.max_tokens", "with a tool environment it bounds the whole trajectory"),
    "max_prompt_length": ("llm.max_prompt_tokens", "a longer prompt is filtered, not truncated"),
    "per_device_train_batch_size": ("training.prompts_per_step", "prompts, each giving training.group_size "
                                    "completions (TRL counts completions per device)"),
    "generation_batch_size": ("training.prompts_per_step", "prompts, each giving training.group_size completions"),
    "beta": ("training.kl_coef", ""),
    "epsilon": ("training.clip_eps_low", "TRL's epsilon_high is training.clip_eps_high"),
    "epsilon_high": ("training.clip_eps_high", ""),
    "max_grad_norm": ("training.grad_clip", ""),
    "num_iterations": ("training.num_epochs", ""),
    "loss_type": ("training.loss_agg", "token_mean is TRL's dapo/bnpo aggregation"),
    "multi_objective_aggregation": ("training.estimator", "TRL's normalize_then_sum is estimator: gdpo"),
    "scale_rewards": ("training.estimator", "scale_rewards=False is estimator: grpo_no_std (or gdpo_no_std)"),
    "reward_weights": ("training.rewards", "each reward's own weight: {name, fn, weight}"),
    "reward_funcs": ("training.rewards", "each reward a {name, fn: 'module:function'}"),
    "max_steps": ("run.steps", ""),
    "output_dir": ("run.output_dir", ""),
    "use_vllm": ("generation.engine", "engine: vllm"),
    "vllm_gpu_memory_utilization": ("generation.engine_kwargs", "{gpu_memory_utilization: 0.9}"),
    "bf16": ("training.precision", "precision: bf16"),
    "environment_factory": ("data.environment", "'module:Class', or TRL's dict form {name: 'module:Class'}"),
    "peft_config": ("llm.lora", "PEFT's LoraConfig settings as a mapping"),
    "report_to": ("run.loggers", "a list of tensorboard, jsonl, wandb, mlflow"),
    "log_completions": ("training.log_completions", "the number of samples per step (0: none), not a flag"),
    "num_completions_to_print": ("training.log_completions", "written to completions.jsonl and the loggers' tables"),
    "save_steps": ("training.checkpoint_every", ""),
    "save_total_limit": ("training.keep_checkpoints", "the final checkpoint is always kept"),
}
#: settings of earlier gdpo-ray versions: name -> (where it went, how to write it now)
RENAMED = {
    "is_cap": ("training.off_policy", "is_cap: X is off_policy: {level: token, mode: truncate, cap: X}; "
               "is_cap: null is off_policy: none"),
}
#: settings outside the GDPO and RLlib field tables: the ``run`` section's (``gdpo_ray.run.train``)
RUN_SETTINGS = ("steps", "output_dir", "num_cpus", "address", "name", "checkpoint_at_end", "export_policy",
                "loggers")


def check_run_name(name: Any, output_dir: str = "runs") -> None:
    """``run.name`` (None: a fresh ``<preset>-<time>``) is one plain folder name: the run
    directory is ``<run.output_dir>/<run.name>``, so a path (``/tmp/x``, ``a/b``, ``..``) would put
    the run outside ``run.output_dir`` or over another's; ValueError naming the rule and the fix."""
    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"run.name must be a non-empty folder name (or null for <preset>-<time>); got {name!r}")
    if "/" in name or "\\" in name:
        head, _, tail = name.replace("\\", "/").rstrip("/").rpartition("/")
        where = (head if name.startswith("/") else f"{output_dir.rstrip('/')}/{head}").rstrip("/") or "/"
        raise ValueError(f"run.name must be a plain folder name, without / or \\: it is a folder of "
                         f"run.output_dir ({output_dir}), not a path; got {name!r}. Say where the folder goes "
                         f"with run.output_dir: run.output_dir={where} run.name={tail or '<name>'}")
    if name in (".", ".."):
        raise ValueError(f"run.name {name!r} is run.output_dir itself or its parent, not a folder of its own; "
                         f"give the run a name (e.g. run.name=first-try)")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise ValueError(f"run.name must not hold control characters (NUL, newline, tab, ...); got {name!r}")
    if len(name.encode()) > 255:
        raise ValueError(f"run.name is {len(name.encode())} bytes long; a folder name holds at most 255")


def field_lines(section: str | None = None) -> list[str]:
    """``section.name  default  doc`` of every field (of ``section``, or all), GDPO's then the
    RLlib ones GDPO reads: ``gdpo-ray list fields [SECTION]`` (the same table as
    docs/configuration.md)."""
    table = [(f"{f.section}.{name}", f.default, f.doc) for name, f in (*FIELDS.items(), *RLLIB_FIELDS.items())
             if section in (None, f.section)]
    width = max((len(n) for n, _, _ in table), default=0)
    return [f"{name:<{width}}  {json.dumps(default):<10}  {doc}" for name, default, doc in table]


def setting_home(name: str) -> str | None:
    """Where a setting named ``name`` lives ("section.name"), or None."""
    f = FIELDS.get(name) or RLLIB_FIELDS.get(name)
    if f is not None:
        return f"{f.section}.{name}"
    return f"run.{name}" if name in RUN_SETTINGS else None


def unknown_key(key: Any, valid: Sequence[str], where: str) -> str:
    """The message for an unknown setting: where a setting of that name lives (another section,
    or TRL's name for one of ours), else the nearest valid names; the whole list only when
    nothing is near."""
    head = f"{key!r} is not a setting of {where}"
    home = setting_home(str(key))
    if home is not None and home.split(".")[0] not in where:
        return f"{head}; it is `{home}`"
    if str(key) in RENAMED:
        ours, note = RENAMED[str(key)]
        return f"{head}; it is now `{ours}` ({note})"
    if str(key) in TRL_NAMES:
        ours, note = TRL_NAMES[str(key)]
        return f"{head}; TRL's {key} is `{ours}` here" + (f" ({note})" if note else "")
    near = difflib.get_close_matches(str(key), list(valid), n=3, cutoff=0.6)
    if near:
        return f"{head}; did you mean {' or '.join(repr(n) for n in near)}?"
    return f"{head} (its settings: {', '.join(sorted(valid))}; `gdpo-ray list fields` shows each with its doc)"


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
    if base == "number" and not math.isfinite(value):  # inf and NaN pass no bound honestly
        raise ValueError(f"{where} must be a finite number; got {value!r}{example}")
    if base == "list" and name == "stop" and not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings (an empty stop string would "
                         f"end every response at once); got {value!r}")
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


def environment_settings(c: Any) -> dict:
    """A rollout actor's multi-turn settings (none without ``data.tool_environment``)."""
    if c.tool_environment is None:
        return {}
    return dict(environment=c.tool_environment, max_turns=c.max_turns, tool_timeout=c.tool_timeout,
                tools_in_system_prompt=c.tools_in_system_prompt)


def sampling_params(c: Any) -> dict:
    return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens,
                stop=tuple(c.stop), min_p=c.min_p, truncated_logprobs=c.truncated_logprobs)
