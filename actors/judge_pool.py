"""The judge pool gdpo-ray serves: Ray actors holding a judge model on an engine, and the rollout
actors' side of them.

``JudgeActor`` (a Ray actor) holds one judge model on a batch engine (``actors.engines``: ``hf``
on CPU, ``vllm`` on a GPU, or a ``package.module:Class``) and answers a batch of judge messages
per call: ``judges.judge_decoding: generate`` writes the verdict, greedily (``judge.temperature``
0) or sampled; ``scores`` (the hf engine) reads it from the model's next-token probabilities
instead, as G-Eval does: for each criterion the judge's answer is begun as ``{"<name>":`` and the
score is the expected value of the scale's integers under the probabilities of their tokens
(renormalized over them): never unparsable, and finer than one integer (fewer ties within a
group, which GDPO's per-group normalization would blow up). The answer is written as the JSON
object of those scores. ``JudgePool`` (the driver's) starts
``judges.num_judges`` of them in their own resources (``judges.num_cpus_per_judge``,
``num_gpus_per_judge``: apart from the rollout actors and the learners), waits until each has
loaded its model (a model that cannot load fails the run's start, naming it), and lets Ray restart
one that dies (``max_restarts=-1``: the same handle serves again once it has reloaded).

``PoolJudge`` is what a rollout actor asks (``actors.judging``): ``ask(message)`` gathers the
messages asked in the same turn of its event loop into batches of ``judges.judge_batch_size``,
sends each to the judge actor with the fewest batches in flight, and answers each message when
its batch returns. A batch whose actor died under it, or that took longer than the judge's
``timeout_s``, is sent again (to any actor) up to ``retries`` times; then its messages fail
(``JudgeUnavailable``: infra or timeout). A message too long for the judge fails alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Sequence

from gdpo_ray.judges.endpoint import Answer, JudgeUnavailable
from gdpo_ray.judges.rubric import JudgeSetting

#: seconds the pool waits for its actors to load their model before the run fails
READY_TIMEOUT_S = 900.0


class JudgeActor:
    """One judge model on one engine (run as a Ray actor by ``JudgePool``)."""

    def __init__(self, model_path: str, engine: str = "hf", engine_kwargs: Mapping[str, Any] | None = None,
                 num_threads: int = 1, seed: int = 0, max_prompt_tokens: int = 4096, model_files: Any = None,
                 decoding: str = "generate") -> None:
        import torch

        from actors.engines import make_engine, traits_of
        from gdpo_ray.model_files import local_dir

        torch.set_num_threads(num_threads)
        shipped = model_files[0] if isinstance(model_files, list) else model_files  # (a ref the pool keeps)
        self.engine = make_engine(engine, local_dir(model_path, shipped), mode="batched", seed=seed,
                                  **dict(engine_kwargs or {}))
        self.tokenizer = self.engine.tokenizer
        self.max_prompt_tokens, self.decoding = max_prompt_tokens, decoding
        if decoding == "scores" and not traits_of(type(self.engine)).model_logits:
            raise ValueError(f"judges.judge_decoding: scores reads the judge model's logits: it needs the hf engine "
                             f"(judges.judge_engine: hf); got {engine!r}")

    def ready(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def judge(self, messages: Sequence[str], max_tokens: int, temperature: float,
              criteria: Sequence[tuple[str, float, float]] = ()) -> list[tuple[str, int, str]]:
        """Per message (its answer, prompt + answer tokens, "") or ("", 0, why it was not judged);
        ``criteria`` (name, low, high): what ``scores`` decoding reads."""
        from actors.engines import SamplingParams

        ids = [self._tokens(m) for m in messages]
        fits = [i for i, t in enumerate(ids) if len(t) <= self.max_prompt_tokens]
        out = [("", 0, f"the judge's prompt is {len(t)} tokens, over judges.judge_max_prompt_tokens "
                       f"({self.max_prompt_tokens})") for t in ids]
        if not fits:
            return out
        if self.decoding == "scores":
            for i in fits:
                out[i] = self._expected_scores(ids[i], criteria)
            return out
        greedy = temperature == 0
        sampling = SamplingParams(temperature=1.0 if greedy else temperature, top_k=1 if greedy else 0,
                                  top_p=1.0, max_tokens=max_tokens)
        samples = self.engine.generate([ids[i] for i in fits], 1, sampling, logprobs=False)
        for i, (sample,) in zip(fits, samples):
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            out[i] = (text, len(ids[i]) + len(sample.token_ids), "")
        return out

    def _expected_scores(self, ids: list[int], criteria: Sequence[tuple[str, float, float]]) -> tuple[str, int, str]:
        import json

        import torch

        import copy

        from gdpo_ray.causal_lm import cached_call, new_cache

        model, device, verdict = self.engine.model, self.engine.device, {}
        with torch.no_grad():  # the message once, then each criterion's opening after it
            cache = new_cache(model)
            ones = torch.ones(1, len(ids), dtype=torch.long, device=device)
            cached_call(model, torch.tensor([ids], device=device), ones, torch.arange(len(ids), device=device)[None],
                        cache)
            for name, low, high in criteria:
                values = list(range(int(low), int(high) + 1))
                tokens = [self._score_token(v) for v in values]
                if int(low) != low or int(high) != high or None in tokens:
                    return "", 0, (f"judges.judge_decoding: scores needs an integer scale whose every value is one "
                                   f"token of the judge's tokenizer; {name!r} has [{low:g}, {high:g}]")
                opening = self.tokenizer(f'{{"{name}":', add_special_tokens=False)["input_ids"]
                total = len(ids) + len(opening)
                logits = cached_call(model, torch.tensor([opening], device=device),
                                     torch.ones(1, total, dtype=torch.long, device=device),
                                     torch.arange(len(ids), total, device=device)[None], copy.deepcopy(cache),
                                     last_only=True).logits[0, -1]
                p = torch.softmax(logits[tokens].double(), dim=0)
                verdict[name] = round(float((p * torch.tensor(values, dtype=torch.float64)).sum()), 6)
        return json.dumps(verdict), len(ids), ""

    def _score_token(self, value: int) -> int | None:
        """The one token that writes `` <value>`` after ``":`` (or ``<value>``), None if none does."""
        for text in (f" {value}", str(value)):
            pieces = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(pieces) == 1:
                return pieces[0]
        return None

    def _tokens(self, message: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                      add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(message)["input_ids"]

    def shutdown(self) -> None:
        self.engine.shutdown()


class JudgePool:
    """The driver's judge actors (see the module docstring); ``handles`` go to the rollout actors."""

    def __init__(self, model_path: str, num_judges: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 engine: str = "hf", engine_kwargs: Mapping[str, Any] | None = None, num_threads: int = 1,
                 max_prompt_tokens: int = 4096, model_files: Any = None, seed: int = 0,
                 decoding: str = "generate") -> None:
        import ray

        remote = ray.remote(JudgeActor).options(
            num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1, max_task_retries=0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        # the model's files go by a reference the pool holds (nested: not resolved by Ray into the
        # actor's arguments, which a restart could not read again once they left the store)
        self.model_path, self.model_files = model_path, model_files
        shipped = [model_files] if model_files is not None else None
        self.handles = [remote.remote(model_path, engine, dict(engine_kwargs or {}), num_threads, seed + i,
                                      max_prompt_tokens, shipped, decoding) for i in range(num_judges)]
        try:
            ray.get([h.ready.remote() for h in self.handles], timeout=READY_TIMEOUT_S)
        except BaseException as err:
            self.shutdown()
            if isinstance(err, ray.exceptions.GetTimeoutError):
                raise RuntimeError(f"the judge pool's {num_judges} actor(s) did not load {model_path!r} within "
                                   f"{READY_TIMEOUT_S:g} s: is the cluster short of judges.num_cpus_per_judge / "
                                   "num_gpus_per_judge?") from None
            raise RuntimeError(f"a judge actor could not load {model_path!r} on engine {engine!r}: {err}") from err

    def shutdown(self) -> None:
        import ray

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.handles = []


class PoolJudge:
    """A rollout actor's client of the pool (see the module docstring), on one event loop."""

    def __init__(self, handles: Sequence[Any], setting: JudgeSetting, batch_size: int,
                 criteria: Sequence[Any] = ()) -> None:
        if not handles:
            raise ValueError("no judge pool was started: a judge without url needs the pool (judges: section)")
        self.handles, self.setting, self.batch_size = list(handles), setting, batch_size
        self.criteria = [(c.name, c.scale[0], c.scale[1]) for c in criteria]  # (for scores decoding)
        self.in_flight = [0] * len(self.handles)
        self.retried = 0  # batches sent again
        self._waiting: list[tuple[str, asyncio.Future]] = []
        self._flushing = False
        self._batches: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks

    async def ask(self, message: str) -> Answer:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((message, future))
        if not self._flushing:  # every message asked in this turn of the loop joins the batches
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._flushing = False
        waiting, self._waiting = self._waiting, []
        for start in range(0, len(waiting), self.batch_size):
            task = asyncio.ensure_future(self._batch(waiting[start:start + self.batch_size]))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _batch(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        import ray

        s, last, kind = self.setting, "", "infra"
        for attempt in range(s.retries + 1):
            if attempt:
                self.retried += 1
            k = min(range(len(self.handles)), key=self.in_flight.__getitem__)
            self.in_flight[k] += 1
            start = time.perf_counter()
            ref = self.handles[k].judge.remote([m for m, _ in batch], s.max_tokens, s.temperature, self.criteria)
            try:
                answers = await asyncio.wait_for(asyncio.wrap_future(ref.future()), s.timeout_s)
            except asyncio.TimeoutError:
                try:
                    ray.cancel(ref)  # a batch still queued at its actor is dropped there
                except Exception:  # noqa: BLE001 - one that runs finishes unheard
                    pass
                kind, last = "timeout", f"the judge pool gave no answer within {s.timeout_s:g} s (judge.timeout_s)"
                continue
            except ray.exceptions.RayActorError as err:
                kind, last = "infra", f"a judge actor died under the call ({type(err).__name__})"
                continue
            except Exception as err:  # noqa: BLE001 - the engine raised: every message of the batch hears of it
                kind, last = "infra", f"the judge actor raised {type(err).__name__}: {str(err)[:300]}"
                continue
            finally:
                self.in_flight[k] -= 1
            seconds = time.perf_counter() - start
            for (_, future), (text, tokens, error) in zip(batch, answers):
                if future.done():
                    continue
                if error:
                    future.set_exception(JudgeUnavailable("error", error))
                else:
                    future.set_result(Answer(text, tokens, seconds))
            return
        for _, future in batch:
            if not future.done():
                future.set_exception(JudgeUnavailable(kind, f"{last} ({s.retries + 1} attempts)"))

    async def close(self) -> None:
        pass
