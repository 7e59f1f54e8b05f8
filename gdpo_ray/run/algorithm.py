"""GDPO as an RLlib algorithm: ``GDPOConfig`` (builder sections, validation) and ``GDPO``.

``GDPO.training_step`` runs five named, timed phases (DESIGN.md §2):

1. take_groups: B complete groups from the ArrowBuffer (the rollout actors keep generating in the
   background, within the staleness bound; dynamic sampling drops groups that would get no
   advantage, ``informative_groups``, and refills);
2. advantages: GDPO advantages over the step's B groups, on the driver, from the groups'
   metadata (rewards, errors, lengths travel beside each payload: the driver never reads one);
3. update: the learners' policy update (DeepSpeed or FSDP2: ``learners.backend``; the rollout
   group is pumped meanwhile, so generation for the next step overlaps learning when
   max_staleness >= 1);
4. push_weights: new weights (version + 1) to every rollout actor; too-stale groups re-issued;
5. metrics: per-step metrics into ``self.metrics``, prompts marked trained, and the automatic
   checkpoint every ``checkpoint_every`` steps.

RLlib's own machinery (env runners, RLModules, its LearnerGroup) is not built: ``setup`` sets the
attributes the base class reads and builds gdpo-ray's actors instead. Checkpoints and recovery
from a dead learner: ``gdpo_ray.run.algorithm_state.GDPOState``.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import tempfile
import time
from typing import Any

import numpy as np

from gdpo_ray import config as fields
from gdpo_ray import metrics as step_metrics
from gdpo_ray import model_files
from gdpo_ray.advantages import compute_advantage_details
from gdpo_ray.completion_log import CompletionLog
from gdpo_ray.data import load_prompts
from gdpo_ray.environments.spec import with_environment_columns
from gdpo_ray.groups import finish_reasons, response_lengths, reward_errors, rewards_matrix, turn_counts
from gdpo_ray.judges.rubric import expand_judges
from gdpo_ray.losses import PolicyLossConfig
from gdpo_ray.truncation import Truncation
from gdpo_ray.reward_watch import RewardWatch
from gdpo_ray.rewards.spec import plain_declaration
from gdpo_ray.run import judges as run_judges
from gdpo_ray.run import preflight, quiet, validation
from gdpo_ray.run.algorithm_state import GDPOState
from gdpo_ray.run.cluster import ensure_ray
from gdpo_ray.run.presets import section_settings
from gdpo_ray.run.rllib_base import Algorithm, AlgorithmConfig, NotProvided
from gdpo_ray.run.sampling import take_groups

logger = logging.getLogger(__name__)

MAX_RECOVERIES_PER_STEP = 3  # learner deaths in one step before the run stops


def _section(self: "GDPOConfig", section: str, values: dict) -> "GDPOConfig":
    allowed = fields.section_fields(section)
    for key, value in values.items():
        if value is NotProvided:
            continue
        if key not in allowed:
            raise TypeError(fields.unknown_key(key, section_settings(self, section), f".{section}()"))
        if key == "rewards" and isinstance(value, (list, tuple)):
            value = [plain_declaration(r) for r in value]
        setattr(self, key, value)
    return self


class GDPOConfig(AlgorithmConfig):
    """RLlib config of GDPO. The fields and their defaults are ``gdpo_ray.config.FIELDS``.

    >>> config = (GDPOConfig()
    ...           .llm(model_path="demo")
    ...           .data(prompts="task:addition")
    ...           .training(group_size=8, prompts_per_step=8, lr=1e-4,
    ...                     rewards=[{"name": "correct", "fn": "math_correctness"}])
    ...           .env_runners(num_env_runners=1)
    ...           .learners(num_learners=1))
    >>> algo = config.build_algo(); algo.train()
    """

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or GDPO)
        for name in (*fields.FIELDS, *fields.RLLIB_FIELDS):  # RLlib's get GDPO's defaults
            setattr(self, name, fields.default(name))
        self.min_time_s_per_iteration = None
        self.min_sample_timesteps_per_iteration = 0
        self.min_train_timesteps_per_iteration = 0
        self.log_sys_usage = False  # Tune's monitor thread: warns without gputil, our metrics say more
        quiet.install()

    def training(self, **kwargs: Any) -> "GDPOConfig":
        """GDPO's fields of section ``training`` (see ``gdpo_ray.config.FIELDS``) and RLlib's own
        training arguments (``lr``, ``grad_clip``, ``num_epochs``, ...)."""
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in fields.FIELDS}
        valid = section_settings(self, "training")
        for key in kwargs:
            if key not in valid:
                raise TypeError(fields.unknown_key(key, valid, ".training()"))
        super().training(**kwargs)
        return _section(self, "training", ours)

    def learners(self, **kwargs: Any) -> "GDPOConfig":
        """RLlib's learner settings (``num_learners``, ``num_gpus_per_learner``, ...) and GDPO's
        ``backend`` (deepspeed or fsdp2: ``learners.backend``)."""
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in fields.section_fields("learners")}
        super().learners(**kwargs)
        return _section(self, "learners", ours)

    def llm(self, **kwargs: Any) -> "GDPOConfig":
        """The policy model: ``model_path``, ``chat_template``, ``max_prompt_tokens``."""
        return _section(self, "llm", kwargs)

    def generation(self, **kwargs: Any) -> "GDPOConfig":
        """The rollout engine and sampling: ``engine``, ``temperature``, ``max_tokens``, ..."""
        return _section(self, "generation", kwargs)

    def data(self, **kwargs: Any) -> "GDPOConfig":
        """The prompts: ``prompts`` (path, ``task:<name>`` or rows), ``tool_environment``, ..."""
        return _section(self, "data", kwargs)

    def judges(self, **kwargs: Any) -> "GDPOConfig":
        """The judge pool gdpo-ray serves: ``num_judges``, ``num_cpus_per_judge``, ``judge_engine``, ..."""
        return _section(self, "judges", kwargs)

    def simulation(self, **kwargs: Any) -> "GDPOConfig":
        """The timing model of simulated engines and learners: ``timing``, ``response_lengths``, ..."""
        return _section(self, "simulation", kwargs)

    def validate(self) -> None:
        """GDPO's rules first (their messages name the fix), then RLlib's own. An environment
        class scoring with ``get_reward()`` gets its column if it is not declared, as in TRL
        (``gdpo_ray.environments.spec.with_environment_columns``)."""
        fields.check_fields(self)
        self.rewards = expand_judges(with_environment_columns(self.rewards, self.tool_environment, self.tool_timeout))
        validation.check(self)
        model_files.check_available(self.model_path)  # smollm2 without gguf: the install command
        super().validate()

    def _validate_framework_settings(self) -> None:
        """RLlib's check of its network framework (it imports torch): GDPO's driver runs no
        network (``gdpo_ray.run.rllib_base``); torch is a dependency of the package, and its
        settings here (torch.compile of RLlib's learners) are RLlib's own, which GDPO never builds."""

    @property
    def rollout_resources(self) -> dict:
        """What one rollout actor asks of Ray (CPUs, GPUs and the custom resources)."""
        return {"CPU": self.num_cpus_per_env_runner, "GPU": self.num_gpus_per_env_runner,
                **self.custom_resources_per_env_runner}

    @property
    def weight_bucket_bytes(self) -> int:  # weight_bucket_mb: the size of one bucket of a push
        return int(self.weight_bucket_mb) << 20

    @property
    def learner_config(self):
        from actors.engines import digest_variants
        from learners.learner import LearnerConfig

        return LearnerConfig(
            model_path=self.model_path, backend=self.backend, zero_stage=self.zero_stage, precision=self.precision,
            lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
            micro_batch_tokens=self.micro_batch_tokens, packing=self.packing, mini_batches=self.mini_batches,
            epochs=self.num_epochs, temperature=self.temperature, gradient_checkpointing=self.gradient_checkpointing,
            loss=PolicyLossConfig.of(self), truncation=Truncation.of(self), seed=self.seed or 0, num_threads=self.num_threads,
            threads_alone=self.threads_alone, lora=self.lora,
            base_model_name=model_files.hub_name(self.model_path),
            digest_variants=digest_variants(self.engine, self.mode, self.engine_kwargs),
            pushes=not self.engine_in_learner, simulation=self.simulation_settings)

    @property
    def simulation_settings(self) -> dict:
        return {k: getattr(self, k) for k in fields.section_fields("simulation")}

    @property
    def rollout_actor_kwargs(self) -> dict:
        from actors.engines import engine_settings, generation_mode

        return dict(model_path=self.model_path, rewards=list(self.rewards), group_size=self.group_size,
                    engine=self.engine, mode=generation_mode(self.engine, self.mode),
                    engine_kwargs=engine_settings(self.engine, self.mode, self.engine_kwargs, self.simulation_settings),
                    sampling=fields.sampling_params(self), chat_template=self.chat_template,
                    system_prompt=self.system_prompt,
                    max_prompt_tokens=self.max_prompt_tokens, reward_workers=self.reward_workers,
                    num_threads=self.num_threads, seed=self.seed or 0, lora=self.lora,
                    judge_batch_size=self.judge_batch_size,
                    **fields.environment_settings(self))  # data.tool_environment: multi-turn rollouts


class GDPO(GDPOState, Algorithm):
    """The GDPO algorithm (see the module docstring for the phases)."""

    @classmethod
    def get_default_config(cls) -> GDPOConfig:
        return GDPOConfig(cls)

    @classmethod
    def default_resource_request(cls, config: Any):
        """The driver, the rollout actors and the learners, as one placement group (Tune)."""
        from ray.tune.execution.placement_groups import PlacementGroupFactory

        if not isinstance(config, GDPOConfig):
            config = cls.get_default_config().update_from_dict(config)
        learner = {"CPU": config.num_cpus_per_learner, "GPU": config.num_gpus_per_learner}
        bundles = [{"CPU": config.num_cpus_for_main_process}]
        if config.colocate or config.engine_in_learner:  # each learner's bundle also holds its rollout actor
            learner = fields.merge_resources(learner, config.rollout_resources)
        else:
            bundles += [config.rollout_resources] * fields.env_runner_range(config)[0]
        bundles += [learner] * max(1, config.num_learners) + run_judges.demand(config)
        return PlacementGroupFactory([fields.merge_resources(b) for b in bundles],
                                     strategy=config.placement_strategy)

    # ---------------------------------------------------------------------------------------
    # setup and teardown

    def setup(self, config: GDPOConfig) -> None:
        from ray.rllib.utils import force_list

        from actors.buffer import ArrowBuffer
        from actors.prompts import PromptSource
        from gdpo_ray.rewards import reward_specs

        # RLlib's setup() would build env runners and an RLModule learner group: not ours.
        self.callbacks = [cls() for cls in force_list(self.config.callbacks_class)]
        self.env_runner_group = self.eval_env_runner_group = None
        self.evaluation_config = self.offline_data = None
        self._set_up_metrics()
        c = self.config
        ensure_ray(c)  # as RLlib's algorithms do: a local Ray when none is running
        preflight.ensure(c)  # model, dataset, rewards on sample rows: before any actor starts
        specs = reward_specs(c.rewards)
        self.reward_names = [s.name for s in specs]
        self.reward_weights = np.array([s.weight for s in specs], np.float64)
        self.reward_gates = {s.name: (self.reward_names.index(s.condition.on), s.condition.min)
                             for s in specs if s.condition is not None}
        self.reward_watch = RewardWatch(  # judge criteria declare their scale: near-tie diagnostics
            self.reward_names, c.reward_failure_limit, c.reward_failure_steps, estimator=c.estimator,
            scales={s.name: tuple(s.params["scale"]) for s in specs if s.fn == "judge" and "scale" in s.params})
        self.model_path = model_files.resolve_model_path(c.model_path)
        self.model_files = model_files.pack(self.model_path)  # for nodes that cannot read it
        self.prompts = PromptSource(load_prompts(c.prompts, c.num_prompts, c.seed or 0), prompt_column=c.prompt_column,
                                    id_column=c.id_column, seed=c.seed or 0,
                                    columns=dict(c.columns))
        self.buffer = ArrowBuffer(c.prompts_per_step, c.max_staleness)
        self.policy_version = 0
        self.counters = {"filtered_groups": 0, "learner_recoveries": 0, "trained_groups": 0}
        self._groups_during_update = 0  # groups that finished while the learners updated
        self._pushed: dict = {}  # the last push's bytes and seconds
        self._checkpoint_root = pathlib.Path(c.checkpoint_dir or tempfile.mkdtemp(prefix="gdpo-ckpt-"))
        self._last_checkpoint: str | None = None
        self.last_recovery: tuple[int, int] | None = None  # (the step a learner died in, the step restored)
        self.completion_log, self.last_completions = CompletionLog(self.model_path, self.reward_names, c.log_completions), []
        self.judge_pool = run_judges.start_pool(c, c.seed or 0)  # the judges the rollout actors ask
        try:
            if c.colocate or c.engine_in_learner:  # the rollout actors go into the learners' placement group (process)
                self._start_learners()
                self.rollouts = self._build_rollouts()
            else:  # the rollout actors start while the learners set up (both take seconds)
                self.rollouts = self._build_rollouts()
                try:
                    self._start_learners()
                except BaseException:
                    self.rollouts.shutdown()
                    raise
        except BaseException:
            if self.judge_pool is not None:
                self.judge_pool.shutdown()
            raise
        from gdpo_ray.eval.suites import held_out_suite
        from gdpo_ray.run.eval_rewards import training_suite_options

        self.eval_suite = held_out_suite(c.eval_suite, load_prompts(c.prompts, c.num_prompts, c.seed or 0), c.prompt_column,
                                         length_limit=c.eval_length_limit, **training_suite_options(c)) if c.eval_suite else None
        if self.eval_suite is not None:
            self.eval_suite.set_correct(c.eval_correct, "training.eval_correct")
        self.last_eval: dict | None = None  # the latest eval report (its "step": the policy version)
        self._initial_state = self.get_state()
        self._callback("on_algorithm_init", algorithm=self, metrics_logger=self.metrics)

    def _start_learners(self) -> None:
        """The learners, and the weight transport (``training.weight_sync``) that sends from them."""
        from gdpo_ray.run.in_learner import RolloutHost
        from gdpo_ray.run.transports import SharedTransport, make_transport
        from learners.learner_group import LearnerGroup

        c = self.config
        extra = c.rollout_resources if c.colocate or c.engine_in_learner else None
        learner_config = dataclasses.replace(c.learner_config, model_path=str(self.model_path),
                                             model_files=self.model_files)
        self.learners = LearnerGroup(learner_config, num_learners=max(1, c.num_learners),
                                     num_cpus_per_learner=c.num_cpus_per_learner,
                                     num_gpus_per_learner=c.num_gpus_per_learner, bundle_extra=extra,
                                     host=RolloutHost if c.engine_in_learner else None)
        self.transport = (SharedTransport() if c.engine_in_learner
                          else make_transport(c.weight_sync, self.learners, c.weight_bucket_bytes))

    def _host_rollouts(self, index: int, actor_kwargs: dict):
        """The rollout actor hosted by learner rank 0 (``generation.engine_in_learner``): its handle."""
        learner = self.learners.learners[0]
        learner.host_rollouts.remote(actor_kwargs)  # before the group's ready(): one queue of calls
        return learner

    def _build_rollouts(self):
        from actors.rollout_group import RolloutGroup, request_rollout_nodes

        c = self.config
        low, high = fields.env_runner_range(c)
        if low != high:
            request_rollout_nodes(c.custom_resources_per_env_runner, high)
        return RolloutGroup(dict(c.rollout_actor_kwargs, model_path=str(self.model_path), model_files=self.model_files,
                                 judges=self.judge_pool.handles if self.judge_pool is not None else None),
                            num_actors=low, prompts=self.prompts, buffer=self.buffer,
                            prompts_per_call=c.prompts_per_call, calls_per_actor=c.calls_per_actor,
                            num_cpus=c.num_cpus_per_env_runner, num_gpus=c.num_gpus_per_env_runner,
                            resources=c.custom_resources_per_env_runner,
                            placement_group=self.learners.pg if c.colocate else None,
                            start=self._host_rollouts if c.engine_in_learner else None)

    def _callback(self, name: str, **kwargs: Any) -> None:
        from ray.rllib.callbacks.utils import make_callback

        make_callback(name, callbacks_objects=self.callbacks,
                      callbacks_functions=getattr(self.config, f"callbacks_{name}", None), kwargs=kwargs)

    def cleanup(self) -> None:
        for part in ("rollouts", "learners", "judge_pool"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    obj.shutdown()
                except Exception as err:  # noqa: BLE001 - teardown goes on
                    logger.warning("shutting down %s: %s", part, err)
                setattr(self, part, None)

    def restore_env_runners(self, env_runner_group: Any) -> list:
        return []  # the RolloutGroup replaces dead rollout actors itself

    # ---------------------------------------------------------------------------------------
    # the training step

    def training_step(self) -> None:
        """One step, the one after the last: a step in which a learner died is redone on new
        learners from the last checkpoint (or the start), with the steps between that checkpoint
        and it, so every ``train()`` returns the metrics of the next step, each step once."""
        import ray

        from actors.attestation import WeightsLost

        target = self.policy_version + 1
        for _ in range(MAX_RECOVERIES_PER_STEP):
            try:
                while self.policy_version < target:  # more than one after a recovery
                    self._step()
                return None
            # from the update, push or checkpoint; or a push's weights lost with its learner
            except (ray.exceptions.RayActorError, WeightsLost) as err:
                self._recover(err)
        raise RuntimeError(f"the learners died {MAX_RECOVERIES_PER_STEP} times in a row on step "
                           f"{target}; check the learners' logs (memory, the device)")

    def _step(self) -> None:
        c, timers, step = self.config, {}, self.policy_version
        with step_metrics.timed(timers, "take_groups"):
            self.rollouts.fit_to_cluster(*fields.env_runner_range(c))
            groups, dropped = take_groups(c, self.rollouts, self.buffer, self.prompts, self.reward_weights)
            self.counters["filtered_groups"] += len(dropped)
        with step_metrics.timed(timers, "advantages"):  # from the groups' metadata: no payload is read here
            rewards, index = rewards_matrix(groups)
            errors = reward_errors(groups)
            # (named as the metrics name the step: the version it makes)
            self.reward_watch.check_failures(step + 1, rewards, errors)  # stops a run whose reward always fails
            details = compute_advantage_details(rewards, index, estimator=c.estimator,
                                                weights=self.reward_weights, eps=c.eps)
        latency = step_metrics.latency_metrics([g.finished_at for g in groups], time.time())
        with step_metrics.timed(timers, "update"):
            learner_metrics = self._update(groups, np.asarray(details.advantages, np.float32))
        with step_metrics.timed(timers, "push_weights"):
            self._push_weights(self.policy_version + 1)
            self.rollouts.pump()  # the calls the new version admits start now, beside the metrics
        with step_metrics.timed(timers, "metrics"):
            self.prompts.mark_trained([g.group_id for g in groups])
            self.counters["trained_groups"] += len(groups)
            values = self._step_metrics(step, groups, rewards, errors, details, dropped)
            values |= step_metrics.failure_metrics(errors, self.reward_names)
            values.update({f"learner/{k}": v for k, v in learner_metrics.items()}, **latency)
            self.last_completions = self.completion_log.samples(groups, details.advantages)
            if c.checkpoint_every and self.policy_version % c.checkpoint_every == 0:
                self._checkpoint_step()
        if c.eval_every and self.policy_version % c.eval_every == 0:
            with step_metrics.timed(timers, "eval"):
                values |= self._eval_metrics()
        values.update({f"timing/{k}_s": v for k, v in timers.items()})
        values["timing/step_s"] = sum(timers.values())
        values |= step_metrics.throughput_metrics(values["tokens"], len(rewards), values["timing/step_s"])
        for key, value in values.items():
            self.metrics.log_value(key, value, reduce="mean", window=1)
        return None

    def evaluate_policy(self, **settings: Any) -> dict | None:
        """The eval suite's report (``gdpo_ray.eval``) of the current policy, generated on the
        rollout actors, with the config's eval settings (``settings`` override them: samples,
        temperature, top_p, max_tokens, limit, pass_k); None without a suite, or when the eval failed
        (logged; training goes on)."""
        from gdpo_ray.run.eval_runner import evaluate_during_training

        c = self.config
        if self.eval_suite is None:
            return None
        report = evaluate_during_training(self.eval_suite, self.rollouts, self.policy_version, **(dict(
            samples=c.eval_samples, temperature=c.eval_temperature, top_p=c.eval_top_p,
            max_tokens=c.eval_max_tokens, limit=c.eval_limit, pass_k=c.eval_pass_k) | settings))
        self.last_eval = report or self.last_eval
        return report

    def _eval_metrics(self) -> dict:
        report = self.evaluate_policy()
        return {} if report is None else {
            f"eval/{report['suite']}/{m}": v for m, v in report["overall"].items() if not np.isnan(v)}

    def _update(self, groups, advantages: np.ndarray) -> dict:
        """The learner update; the rollout group is pumped while it runs (overlap)."""
        import ray

        if self.config.colocate:  # the engines give the shared devices to the learners
            self.rollouts.sleep()
        before = self.rollouts.stats["groups"]
        alone = self.config.threads_alone or self.config.num_threads
        idle = self.rollouts.in_flight == 0  # the rollout actors' cores are free from the start
        refs = self.learners.update_async(groups, advantages, threads=alone if idle else None,
                                          version=self.policy_version)
        lent = idle or alone == self.config.num_threads  # nothing (more) to lend
        while pending := ray.wait(refs, num_returns=len(refs), timeout=0)[1]:
            # wakes as a learner finishes or a rollout item arrives (after which the lending is
            # looked at again): no polling, whose ray.wait calls cost the driver ~0.3 ms each
            self.rollouts.pump(timeout=1.0, until=pending)
            if not lent and self.rollouts.in_flight == 0:
                self.learners.set_threads(alone)  # the rollouts' cores are idle now: lend them
                lent = True
        self._groups_during_update = self.rollouts.stats["groups"] - before
        metrics = ray.get(refs)[0]
        if self.config.colocate:
            self.rollouts.wake_up()
        return metrics

    def _push_weights(self, version: int) -> None:
        """The policy as ``version`` to every rollout actor, through the run's transport (the
        one place a version goes out: after an update, a learner recovery, a restore)."""
        from gdpo_ray.run.transports import push_weights

        start = time.perf_counter()
        pushed = push_weights(self.transport, self.rollouts, version)
        self.policy_version = version
        self._pushed = {"weights/push_bytes": float(pushed.sent.bytes), "weights/push_s": time.perf_counter() - start}

    def _step_metrics(self, step, groups, rewards, errors, details, dropped) -> dict:
        lengths, reasons, turns = response_lengths(groups), finish_reasons(groups), turn_counts(groups)
        values = {"step": float(self.policy_version), "groups": float(len(groups)),
                  "filtered_groups": float(len(dropped)),
                  "tokens": float(lengths.sum()), "prompt_epoch": float(self.prompts.epoch)}
        values |= step_metrics.reward_metrics(rewards, self.reward_names, errors)
        if self.config.dynamic_sampling:  # what the policy sampled, the dropped groups too
            values |= step_metrics.sampled_reward_metrics(rewards, rewards_matrix(dropped)[0], self.reward_names)
        values |= step_metrics.advantage_metrics(details, self.reward_names)
        values |= step_metrics.signal_metrics(rewards, details, self.reward_names, self.reward_gates)
        values |= self.reward_watch.diagnose(step + 1, rewards, details)  # degeneracy: metrics, warnings once
        values |= step_metrics.rollout_metrics(lengths, reasons, turns)
        values |= step_metrics.staleness_metrics(step, np.array([g.policy_version for g in groups]))
        values |= self.rollouts.step_metrics()
        values |= {"rollout/dropped_stale": float(self.buffer.dropped_stale),
                   # generation that overlapped the learning
                   "rollout/groups_during_update": float(self._groups_during_update),
                   **self._pushed, "weights/attested": float(self.rollouts.ledger.attested),
                   "learner_recoveries": float(self.counters["learner_recoveries"])}
        return values
