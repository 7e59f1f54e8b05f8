"""A rollout actor's judges: its judge columns scored while the rest of the actor goes on.

``Judging`` holds the rubrics of the actor's ``fn: judge`` columns (``gdpo_ray.judges.rubric``)
and, per rubric, its judge: an endpoint (``gdpo_ray.judges.endpoint.EndpointJudge``) or the pool
(``actors.judge_pool.PoolJudge``). They run on an event loop of their own, on a thread of their
own: the engine's calls (which hold the actor's event loop in a batched call) and the reward
workers never wait for them, and they never wait for those. ``submit`` renders one message per
(rubric, rollout) (every criterion of a rubric is judged in one answer), sends them, and returns
at once a future of the judged columns, taken by ``RewardPool.score`` after its own workers are
done (``GivenColumn``s: a criterion's score, or NaN with its kind and reason). The same message
asked twice in one step (the same prompt and completion: a group's identical samples, a prompt
asked again) is judged once (``new_step`` forgets them).

``take_stats`` gives what was judged since the last take, for the driver's ``judge/*`` metrics
(``actors.rollout_group``): calls (judge requests made), cached (messages answered from the
step's cache), tokens, failures (columns' rows left NaN by their judge), retries, the latencies
of the answered requests, the queue (requests asked but not yet answered, at the last submit)
and wait_s (seconds the scoring waited for judges after its own rewards were done).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from actors.judge_pool import PoolJudge
from gdpo_ray.judges.endpoint import MAX_BACKOFF_S, EndpointJudge, JudgeUnavailable
from gdpo_ray.judges.rubric import JUDGE, Rubric, rubric_of
from gdpo_ray.judges.verdict import parse_verdict, render


class Judging:
    """Args:
        specs: the actor's ``RewardSpec``s (the ``fn: judge`` ones are judged here).
        pool: the judge pool's actor handles (``JudgePool.handles``), for rubrics without url.
        batch_size: messages per call of a pool actor (``judges.judge_batch_size``).
    """

    def __init__(self, specs: Sequence[Any], pool: Sequence[Any] | None = None, batch_size: int = 8) -> None:
        self.rubrics: dict[str, Rubric] = {}
        for s in specs:
            if s.fn == JUDGE:
                rubric = rubric_of(s.params)
                self.rubrics.setdefault(rubric.name, rubric)
        self.columns = [c for r in self.rubrics.values() for c in r.columns]
        self._batch_size = batch_size
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="gdpo-judges")
        self._thread.start()
        self._judges = {name: (EndpointJudge(r.judge) if r.judge.url
                               else PoolJudge(pool or (), r.judge, batch_size, r.criteria))
                        for name, r in self.rubrics.items()}
        self._cache: dict[tuple[str, str], asyncio.Future] = {}
        self._lock = threading.Lock()
        self._stats = _new_stats()
        self._open = 0  # requests asked and not yet answered
        self._retried = 0  # the judges' retries at the last take_stats

    def submit(self, prompts: Sequence[Any], completions: Sequence[Any],
               rows: Sequence[Mapping[str, Any]]) -> concurrent.futures.Future:
        """Judges N rollouts (their prompts, completions and dataset rows); a future of
        {column: (values, kinds, errors)} for every judge column."""
        return asyncio.run_coroutine_threadsafe(self._judge(list(prompts), list(completions), list(rows)), self._loop)

    def collector(self, future: concurrent.futures.Future, n: int) -> Callable[[], dict]:
        """What ``RewardPool.score`` calls for the judged columns (``judged``): waits for
        ``future``, at most the longest its requests may take with their retries (then its rows
        are NaN, kind timeout), and counts the wait (``wait_s``)."""
        def judged() -> dict:
            start = time.perf_counter()
            try:
                return future.result(timeout=self.bound_s(n))
            except concurrent.futures.TimeoutError:
                future.cancel()
                why = f"the judges gave no verdict within {self.bound_s(n):g} s (all their requests and retries)"
                self._count("failures", n * len(self.columns))
                return {c: ([math.nan] * n, ["timeout"] * n, [why] * n) for c in self.columns}
            finally:
                self._count("wait_s", time.perf_counter() - start)

        return judged

    def bound_s(self, n: int) -> float:
        """The longest ``n`` rollouts' judging may take: every request in turn through its
        judge's open slots, each with all its retries and backoffs."""
        worst = 0.0
        for r in self.rubrics.values():
            rounds = math.ceil(n / (r.judge.max_in_flight if r.judge.url else self._batch_size))
            worst += rounds * (r.judge.retries + 1) * (r.judge.timeout_s + MAX_BACKOFF_S)
        return worst + 30.0

    def new_step(self) -> None:
        """A new policy version: what was judged before is judged again when asked."""
        asyncio.run_coroutine_threadsafe(self._forget(), self._loop).result()

    async def _forget(self) -> None:
        self._cache = {}

    def take_stats(self) -> dict[str, Any]:
        retried = sum(j.retried for j in self._judges.values())
        with self._lock:
            stats, self._stats = self._stats, _new_stats()
        stats["retries"], self._retried = float(retried - self._retried), retried
        return stats

    async def _judge(self, prompts: list, completions: list, rows: list) -> dict[str, tuple[list, list, list]]:
        n = len(completions)
        out: dict[str, tuple[list, list, list]] = {c: ([math.nan] * n, ["error"] * n, [""] * n) for c in self.columns}
        asked: list[tuple[Rubric, int, asyncio.Future]] = []
        for rubric in self.rubrics.values():
            for i in range(n):
                try:
                    message = render(rubric.prompt, rubric.criteria, prompts[i], completions[i], rows[i])
                except KeyError as err:
                    self._fail(out, rubric, i, "error", str(err.args[0]))
                    continue
                key = (rubric.name, message)
                future = self._cache.get(key)
                if future is None:
                    future = self._cache[key] = asyncio.ensure_future(self._ask(rubric.name, message))
                else:
                    self._count("cached", 1)
                asked.append((rubric, i, future))
        with self._lock:
            self._stats["queue"] = float(self._open)
        for rubric, i, future in asked:
            try:
                answer = await asyncio.shield(future)
            except JudgeUnavailable as err:
                self._fail(out, rubric, i, err.kind if err.kind in ("timeout", "infra") else "error", str(err))
                continue
            except Exception as err:  # noqa: BLE001 - the client itself broke: this row's criteria say so
                self._fail(out, rubric, i, "infra", f"the judge's client raised {type(err).__name__}: {err}")
                continue
            for c, (value, why) in zip(rubric.criteria, parse_verdict(answer.text, rubric.criteria)):
                values, kinds, errors = out[rubric.column(c)]
                values[i], kinds[i], errors[i] = value, ("" if not why else "error"), why
                if why:
                    self._count("failures", 1)
        return out

    async def _ask(self, rubric: str, message: str) -> Any:
        judge = self._judges[rubric]
        self._open += 1
        self._count("calls", 1)
        try:
            answer = await judge.ask(message)
        finally:
            self._open -= 1
        with self._lock:
            self._stats["tokens"] += answer.tokens
            self._stats["latencies"].append(answer.latency_s)
        return answer

    def _fail(self, out: dict, rubric: Rubric, i: int, kind: str, why: str) -> None:
        for column in rubric.columns:
            values, kinds, errors = out[column]
            values[i], kinds[i], errors[i] = math.nan, kind, why
        self._count("failures", len(rubric.criteria))

    def _count(self, key: str, amount: float) -> None:
        with self._lock:
            self._stats[key] += amount

    def close(self) -> None:
        async def closing() -> None:
            for judge in self._judges.values():
                await judge.close()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(closing(), self._loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _new_stats() -> dict[str, Any]:
    return {"calls": 0.0, "cached": 0.0, "tokens": 0.0, "failures": 0.0, "retries": 0.0, "wait_s": 0.0,
            "queue": 0.0, "latencies": []}


class JudgeStats:
    """The driver's sum of its rollout calls' ``take_stats`` over a step: ``take`` gives the
    step's ``judge/*`` metrics (none in a run without judges)."""

    def __init__(self) -> None:
        self._calls: list[dict[str, Any]] = []
        self._judged = False  # a call with judges has reported: every step has judge/* from then on

    def add(self, stats: dict[str, Any]) -> None:
        self._calls.append(stats)
        self._judged = True

    def take(self) -> dict[str, float]:
        calls, self._calls = self._calls, []
        if not self._judged:
            return {}
        step = merged(calls) or _new_stats()  # nothing judged since the last step: zeros
        latencies = step.pop("latencies")
        out = {f"judge/{key}": float(value) for key, value in step.items()}
        out["judge/latency_s"] = float(sum(latencies) / len(latencies)) if latencies else math.nan
        out["judge/latency_p95_s"] = _quantile(latencies, 0.95)
        return out


def merged(stats: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several ``take_stats`` as one (None where there are none)."""
    stats = [s for s in stats if s]
    if not stats:
        return None
    out = {key: sum(s[key] for s in stats) for key in stats[0] if key not in ("latencies", "queue")}
    return out | {"latencies": [t for s in stats for t in s["latencies"]], "queue": max(s["queue"] for s in stats)}


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)])
