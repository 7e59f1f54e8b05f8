"""The driver's side of the judges: which judge the pool serves, what it asks of the cluster,
its checks before any actor starts, and its start (``actors.judge_pool.JudgePool``).

A ``fn: judge`` reward whose judge names no ``url`` is judged by the pool gdpo-ray serves:
``judges.num_judges`` Ray actors holding ``judge.model`` on ``judges.judge_engine``, each in
``num_cpus_per_judge`` CPUs and ``num_gpus_per_judge`` GPUs, apart from the rollout actors and
learners (counted in the start-up placement check, ``gdpo_ray.run.placement``). One model is
served per run: judges that name different models need an endpoint each (``judge.url``, e.g.
``vllm serve``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from gdpo_ray.rewards import reward_specs


def judge_settings(rewards: Any) -> list:
    """The ``JudgeSetting`` of every judge reward of ``rewards`` (one per rubric)."""
    from gdpo_ray.judges.rubric import rubric_of

    rubrics = {}
    for s in reward_specs(rewards):
        if s.from_judge:
            rubric = rubric_of(s.params)
            rubrics[rubric.name] = rubric.judge
    return list(rubrics.values())


def served_model(rewards: Any) -> str | None:
    """The model the judge pool serves for ``rewards``, or None where every judge is an endpoint."""
    models = sorted({j.model for j in judge_settings(rewards) if j.served})
    if len(models) > 1:
        raise ValueError(f"the judge pool serves one model; judges without url name {models}: serve one of "
                         "them and give the others an endpoint (judge.url, e.g. `vllm serve MODEL`)")
    return models[0] if models else None


def demand(config: Any) -> list[dict[str, float]]:
    """The judge actors' bundles (none where no judge is served)."""
    if served_model(config.rewards) is None:
        return []
    return [{"CPU": config.num_cpus_per_judge, "GPU": config.num_gpus_per_judge}] * config.num_judges


def check(config: Any) -> None:
    """The judges' rules across components (before any actor starts): one served model, that
    model available and the judges' engine known; an endpoint's key variable set here."""
    from actors.engines import engine_class, traits_of
    from gdpo_ray import model_files

    for j in judge_settings(config.rewards):
        if j.api_key_env and not os.environ.get(j.api_key_env):
            raise ValueError(f"the judge at {j.url} reads its key from the environment variable {j.api_key_env}, "
                             "which is not set: export it (where the rollout actors run too; never put the key "
                             "itself in the config)")
    model = served_model(config.rewards)
    if config.judge_decoding not in ("generate", "scores"):
        raise ValueError(f"judges.judge_decoding must be generate or scores; got {config.judge_decoding!r}")
    if model is None:
        return
    traits = traits_of(engine_class(config.judge_engine, "batched"))
    if config.judge_decoding == "scores":
        _check_scores(config, traits.model_logits)
    model_files.check_available(model)
    if model in model_files.BUILT_IN_MODELS or os.path.isdir(os.path.expanduser(model)):
        return
    if model_files.hub_name(model) is None or model_files.hub_model(model) is None:
        raise ValueError(f"the judge pool's model {model!r} is not a model directory, a built-in name "
                         f"({', '.join(model_files.BUILT_IN_MODELS)}) or a model in the local Hugging Face "
                         "cache: give judge.model one of those, or judge.url for a model served elsewhere")


def start_pool(config: Any, seed: int = 0) -> Any:
    """The run's ``JudgePool`` (its actors loaded), or None where no judge is served."""
    from gdpo_ray.config import section_fields

    return pool_for(config.rewards, {k: getattr(config, k) for k in section_fields("judges")},
                    config.num_threads, seed)


def pool_for(rewards: Any, settings: Mapping[str, Any], num_threads: int = 1, seed: int = 0) -> Any:
    """A ``JudgePool`` for ``rewards``' judges without url (None where there are none), with the
    ``judges:`` section's ``settings`` (missing ones: the field table's defaults)."""
    from actors.judge_pool import JudgePool
    from gdpo_ray import model_files
    from gdpo_ray.config import default

    model = served_model(rewards)
    if model is None:
        return None
    s = {k: settings.get(k, default(k)) for k in ("num_judges", "num_cpus_per_judge", "num_gpus_per_judge",
                                                 "judge_engine", "judge_engine_kwargs", "judge_max_prompt_tokens",
                                                 "judge_decoding")}
    path = model_files.resolve_model_path(model)
    import ray

    # the model's files travel by the object store only to a cluster of several nodes (a reference
    # among an actor's arguments is what Ray warns of for actors it restarts)
    shipped = model_files.pack(path) if len([n for n in ray.nodes() if n.get("Alive")]) > 1 else None
    return JudgePool(str(path), num_judges=s["num_judges"], num_cpus=s["num_cpus_per_judge"],
                     num_gpus=s["num_gpus_per_judge"], engine=s["judge_engine"],
                     engine_kwargs=dict(s["judge_engine_kwargs"]), num_threads=num_threads,
                     max_prompt_tokens=s["judge_max_prompt_tokens"], model_files=shipped, seed=seed,
                     decoding=s["judge_decoding"])


def check_columns(config: Any, columns: list[str], where: str) -> None:
    """Every dataset column a judge's prompt names (``{ground_truth}``) is one of ``columns``."""
    from gdpo_ray.judges.rubric import rubric_of
    from gdpo_ray.judges.verdict import columns_asked

    for s in reward_specs(config.rewards):
        if s.from_judge:
            rubric = rubric_of(s.params)
            missing = [c for c in columns_asked(rubric.prompt or "") if c not in columns]
            if missing:
                raise ValueError(f"the prompt of judge {rubric.name!r} names {missing[0]!r}, which {where} does "
                                 f"not have; its columns: {columns}. Name one of them, or add the column")


def _check_scores(config: Any, model_logits: bool) -> None:
    """``judge_decoding: scores`` reads the judge model's logits (an engine whose traits say it
    holds them: hf) over integer scales."""
    from gdpo_ray.judges.rubric import rubric_of

    if not model_logits:
        raise ValueError(f"judges.judge_decoding: scores reads the judge model's logits, which engine "
                         f"{config.judge_engine!r} does not hold: use judges.judge_engine: hf, or judge_decoding: "
                         "generate")
    for s in reward_specs(config.rewards):
        if s.from_judge and rubric_of(s.params).judge.served:
            low, high = s.params["scale"]
            if low != int(low) or high != int(high) or high - low > 20:
                raise ValueError(f"judge column {s.name!r}: judges.judge_decoding: scores reads a score per integer "
                                 f"of its scale; [{low:g}, {high:g}] is not one of at most 21 integers (e.g. [0, 1], "
                                 "[1, 10])")


#: seconds the start-up check waits for an endpoint's answer to GET /models
PROBE_TIMEOUT_S = 5.0


def probe_endpoints(config: Any) -> list[str]:
    """One ``GET {url}/models`` per endpoint judge (the key sent as the requests will send it),
    before any actor starts: a warning for each that cannot be reached or refuses the key (its
    criteria would be NaN on every rollout, and the run would stop)."""
    import urllib.error
    import urllib.request

    warnings = []
    for j in {j.url: j for j in judge_settings(config.rewards) if not j.served}.values():
        key = os.environ.get(j.api_key_env) if j.api_key_env else None
        request = urllib.request.Request(f"{j.url}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
                pass
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                warnings.append(f"the judge at {j.url} refused the key in {j.api_key_env or '(none: no api_key_env)'} "
                                f"(HTTP {err.code} to GET /models): every request would fail")
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            warnings.append(f"the judge at {j.url} cannot be reached from here (GET /models: {reason}): its "
                            "criteria would be NaN on every rollout and the run would stop; start the server, "
                            "or fix judge.url (an OpenAI-compatible base URL ending in /v1)")
    return warnings
