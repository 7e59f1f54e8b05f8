"""The checks of a config across components: the estimator, the rewards, the engine and its
sampling, the weight transport, the learners' backend, the eval suite, the resources. They run
when a ``GDPOConfig`` is validated, before any actor starts; each error names the field, the
value, the rule and the fix.
The checks of each value by itself are the field table's (``gdpo_ray.config.check_value``).
"""

from __future__ import annotations

from typing import Any, Mapping

from actors.engines import SamplingParams, engine_class, generation_mode, traits_of
from gdpo_ray import config as fields
from gdpo_ray.advantages import ESTIMATORS
from gdpo_ray.eval.pass_at_k import check_ks, parse_ks
from gdpo_ray.eval.suites import make_suite
from gdpo_ray.lora import lora_settings
from gdpo_ray.losses import PolicyLossConfig
from gdpo_ray.rewards import RewardSpec, check_specs, reward_specs
from gdpo_ray.run import judges
from gdpo_ray.run.transports import TRANSPORTS
from learners.backend import learner_class


def check(config: Any) -> None:
    """Every rule on the fields of a ``GDPOConfig``; raises ValueError naming field, value and fix."""
    c = config
    fields.check_fields(c)
    c.lora = lora_settings(c.lora)  # checked and normalized, once: the rest of the run reads c.lora
    if c.estimator not in ESTIMATORS:
        raise ValueError(f"estimator {c.estimator!r} is not one of {ESTIMATORS.names()}; "
                         "use .training(estimator='gdpo')")
    if c.mini_batches > c.prompts_per_step:
        raise ValueError(f"mini_batches ({c.mini_batches}) must be <= prompts_per_step "
                         f"({c.prompts_per_step}): a mini-batch holds whole groups")
    if not c.rewards:
        raise ValueError("no rewards: use .training(rewards=[{'name': 'correct', 'fn': "
                         "'math_correctness'}, ...]) (see gdpo_ray.rewards for the built-ins)")
    specs = reward_specs(c.rewards)
    fns = check_specs(specs)  # unknown functions or params fail here, before any actor starts
    _check_environment(c, specs, fns)
    judges.check(c)
    if c.weight_sync not in TRANSPORTS:
        raise ValueError(f"training.weight_sync must be one of {sorted(TRANSPORTS)}; got {c.weight_sync!r}")
    if c.precision not in ("fp32", "bf16"):
        raise ValueError(f"training.precision must be 'fp32' or 'bf16'; got {c.precision!r}")
    learner_class(c.backend)  # learners.backend: a known name (or a Learner's module:Class)
    if c.model_path is None:
        raise ValueError("no policy model: use .llm(model_path='path/to/hf_model') (or 'demo', "
                         "'tiny', 'smollm2')")
    if c.prompts is None:
        raise ValueError("no prompts: use .data(prompts='train.parquet') (or 'task:addition')")
    if not isinstance(c.columns, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in c.columns.items()):
        raise ValueError(f"columns must map column names to nested fields, e.g. .data(columns="
                         f"{{'ground_truth': 'reward_model.ground_truth'}}); got {c.columns!r}")
    if c.system_prompt is not None and not c.chat_template:
        raise ValueError("data.system_prompt needs llm.chat_template=true: the system message goes to "
                         "the model through the tokenizer's chat template")
    _check_engine(c)
    _check_eval(c)
    PolicyLossConfig.of(c)
    if c.ratio_level == "sequence":
        _check_gspo(c)
    low, high = fields.env_runner_range(c)
    if low != high and not c.custom_resources_per_env_runner:
        raise ValueError(f"num_env_runners {list(c.num_env_runners)} is elastic: rollout actors "
                         "are counted by a custom Ray resource of the rollout nodes; use "
                         ".env_runners(custom_resources_per_env_runner={'rollout': 1})")
    if c.engine_in_learner:
        _check_engine_in_learner(c, low, high)
    if c.colocate:
        if c.max_staleness != 0:
            raise ValueError(f"colocate=True shares devices between generation and learning, which "
                             f"cannot overlap: use max_staleness=0 (got {c.max_staleness})")
        if low != high or low != max(1, c.num_learners):
            raise ValueError(f"colocate=True puts one rollout actor beside each learner: use "
                             f"num_env_runners == num_learners (got {c.num_env_runners} and "
                             f"{c.num_learners})")


def _check_engine_in_learner(c: Any, low: int, high: int) -> None:
    """generation.engine_in_learner: one learner hosts the one hf engine, synchronously, on a
    module whose weights it holds whole (``gdpo_ray.run.in_learner``)."""
    rules = [(c.max_staleness != 0, f"max_staleness={c.max_staleness}: the learner generates and "
              "learns in turn, so groups cannot overlap an update; use training.max_staleness=0"),
             (not traits_of(engine_class(c.engine, generation_mode(c.engine, c.mode))).shares_module,
              f"engine {c.engine!r} cannot be built on the learner's module (EngineTraits.shares_module); "
              "use generation.engine=hf"),
             (max(1, c.num_learners) != 1 or (low, high) != (1, 1),
              f"num_learners={c.num_learners} and num_env_runners={c.num_env_runners}: learner rank 0 "
              "hosts the one rollout actor; use learners.num_learners=1 and env_runners.num_env_runners=1"),
             (c.backend != "deepspeed" or c.zero_stage > 2, f"backend {c.backend!r} with zero_stage="
              f"{c.zero_stage}: the engine reads the module's whole weights; use learners.backend=deepspeed "
              "with training.zero_stage <= 2"),
             (c.colocate, "colocate=true places a rollout actor beside each learner; engine_in_learner "
              "puts it inside: set one of them"),
             (c.mode == "streaming", "generation.mode=streaming: the hosted engine generates in "
              "batches between updates; use generation.mode=batched"),
             (c.weight_sync != "object_store", f"weight_sync={c.weight_sync!r}: nothing is sent, the "
              "engine reads the learner's weights; leave training.weight_sync unset"),
             (bool(c.engine_kwargs), f"engine_kwargs={dict(c.engine_kwargs)}: the engine is the "
              "learner's module, with its dtype and device; leave generation.engine_kwargs unset"),
             (c.num_gpus_per_env_runner or c.custom_resources_per_env_runner,
              "the rollout actor runs in the learner's process, on its devices and node: leave "
              "env_runners.num_gpus_per_env_runner and custom_resources_per_env_runner unset "
              "(its CPUs, num_cpus_per_env_runner, are added to the learner's)")]
    for broken, why in rules:
        if broken:
            raise ValueError(f"generation.engine_in_learner=true: {why}")


def _check_environment(c: Any, specs: list[RewardSpec], fns: list) -> None:
    """data.tool_environment loads (``gdpo_ray.environments.spec``), the rewards declared as its
    columns (``fn: environment``) are columns it gives, and rewards that read its instances
    (TRL's ``environments`` parameter) have one."""
    from gdpo_ray.environments.spec import environment_paths, load_environment
    from gdpo_ray.environments.tool_prompt import check_mode
    from gdpo_ray.rewards import takes_environments
    from gdpo_ray.rewards.spec import ENVIRONMENT

    columns = [s.name for s in specs if s.from_environment]
    readers = [s.name for s, fn in zip(specs, fns) if fn is not None and takes_environments(fn)]
    if c.tool_environment is None:
        if columns:
            raise ValueError(f"rewards {columns} are an environment's (fn: {ENVIRONMENT}), and no "
                             "environment is set: set data.tool_environment='module:Class', or give them a function")
        if readers:
            raise ValueError(f"rewards {readers} take TRL's `environments` (the rollouts' environment "
                             "instances), and no environment is set: set data.tool_environment='module:Class'")
        return
    check_mode(c.tools_in_system_prompt)
    if not c.chat_template:
        raise ValueError("data.tool_environment needs llm.chat_template=true: the tools are given to the "
                         "model, and their answers appended, through the tokenizer's chat template")
    envs = {name: load_environment(path, c.tool_timeout) for name, path in environment_paths(c.tool_environment).items()}
    for env in envs.values():
        name = env.cls.__name__
        if env.reward_getter == "get_reward" and (columns != [name] if len(envs) == 1 else name not in columns):
            raise ValueError(f"environment {env.path!r} scores a rollout with get_reward(): declare its "
                             f"one column as TRL names it, {{name: {name}, fn: {ENVIRONMENT}}} in training.rewards "
                             f"(declared as the environment's: {columns or 'none'})")
    if columns and all(env.reward_getter is None for env in envs.values()):
        raise ValueError(f"rewards {columns} are the environment's (fn: {ENVIRONMENT}), and "
                         f"{', '.join(e.path for e in envs.values())} has neither get_rewards() nor "
                         "get_reward(): add get_rewards() returning {name: value} for them")
    if not any(env.reward_getter == "get_rewards" for env in envs.values()):  # only get_reward columns
        named = {env.cls.__name__ for env in envs.values()}
        if set(columns) - named:
            raise ValueError(f"rewards {sorted(set(columns) - named)} are declared as the environments' "
                             f"(fn: {ENVIRONMENT}), and none of them gives such a column (their get_reward() "
                             f"columns: {sorted(named)}); add get_rewards() or give them a function")


def _check_eval(c: Any) -> None:
    """An eval schedule needs a suite, and the suite must load (its data, its packages) and be
    generated as the run's rollouts are (the same tool environment, or none); pass@k needs k <=
    eval_samples and a suite with a correct metric."""
    if c.eval_correct and not c.eval_suite:
        raise ValueError(f"training.eval_correct={c.eval_correct} needs a suite: set training.eval_suite")
    if c.eval_every and not c.eval_suite:
        raise ValueError(f"training.eval_every={c.eval_every} needs a suite: set training.eval_suite "
                         f"(e.g. task:addition, math:data/aime.jsonl, humaneval, bfcl:simple_python)")
    if c.eval_pass_k:
        check_ks(parse_ks(c.eval_pass_k, "training.eval_pass_k"), c.eval_samples,
                 "training.eval_pass_k", "training.eval_samples")
    if c.eval_suite:
        from gdpo_ray.run.eval_rewards import training_suite_options

        suite = make_suite(c.eval_suite, length_limit=c.eval_length_limit, **training_suite_options(c))
        suite.close()
        suite.set_correct(c.eval_correct, "training.eval_correct")
        if suite.environment != c.tool_environment:  # in-training eval runs on the run's rollout actors
            raise ValueError(f"training.eval_suite {c.eval_suite} is generated "
                             + (f"with the tools of {suite.environment}" if suite.environment else "in one turn")
                             + f", and this run's rollouts {f'use {c.tool_environment}' if c.tool_environment else 'have no tools'}"
                             f": evaluate it after training (gdpo-ray eval RUN_DIR --suite {c.eval_suite}), or "
                             + (f"set data.tool_environment={suite.environment}" if suite.environment
                                else "pick a suite of this environment's task"))
        if c.eval_pass_k and suite.correct_metric() is None:
            raise ValueError(f"training.eval_pass_k: suite {c.eval_suite} reports neither pass@1 nor accuracy "
                             f"(its metrics: {', '.join(suite.metrics)}); say which samples are correct with "
                             f"training.eval_correct (e.g. ['{suite.metrics[0]}>=1']), or set training.eval_pass_k=null")


def _check_engine(c: Any) -> None:
    """The engine's class for the generation mode, checked against the mode's protocol, and
    the sampling it must do with exact logprobs."""
    mode = generation_mode(c.engine, c.mode)
    if mode not in ("streaming", "batched"):
        raise ValueError(f"generation.mode must be 'streaming' or 'batched'; got {c.mode!r}")
    cls = engine_class(c.engine, mode)
    cls.check_sampling(SamplingParams(**fields.sampling_params(c)))
    if c.lora and not _takes(cls, "lora"):
        raise ValueError(f"llm.lora trains a LoRA adapter, and generation.engine {c.engine!r} "
                         f"({cls.__module__}.{cls.__qualname__}) cannot serve one: its __init__ takes "
                         f"no lora= argument (the PEFT settings; see actors.engines.BatchEngine); use "
                         f"engine 'hf' or 'vllm', or leave llm.lora out")
    if mode == "streaming" and c.colocate:
        raise ValueError("generation.mode='streaming' keeps requests in flight through every update, "
                         "and colocated engines sleep during updates: use generation.mode='batched' "
                         "with colocate=True")
    _check_simulation(c, traits_of(cls).simulated, getattr(learner_class(c.backend), "simulated", False))


def _check_simulation(c: Any, engine: bool, learner: bool) -> None:
    """Section ``simulation``, where a simulated engine or learner reads it; a simulated
    learner's payload is held by simulated engines only."""
    if learner and not engine:
        raise ValueError(f"learners.backend={c.backend!r} pushes a payload of simulation.weight_bytes that no "
                         f"model holds, and generation.engine={c.engine!r} loads a model: use "
                         "generation.engine='simulated' too (docs/scale.md)")
    if engine or learner:
        from gdpo_ray.simulation import ResponseLengths, timing_model

        timing_model(c.timing)
        ResponseLengths.of(c.response_lengths)


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


def _takes(cls: type, argument: str) -> bool:
    """Whether ``cls(...)`` accepts the keyword ``argument`` (by name or through ``**kwargs``)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters.values()
    return any(p.name == argument or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
