"""An OpenAI-compatible judge endpoint (``judge.url``: ``vllm serve``, an API behind a key), asked
asynchronously.

``EndpointJudge.ask(message)`` posts one chat completion (``POST {url}/chat/completions``, the
judge's ``model``, ``max_tokens``, ``temperature``) with at most ``max_in_flight`` requests open
at once, each within ``timeout_s``. A request that fails in transport (refused, reset, DNS), times
out, or gets a 5xx or 429 is retried ``retries`` times with exponential backoff (0.5 s doubling,
capped at 8 s, jittered; a 429's Retry-After is honoured up to the cap). Any other status (a 401:
a wrong key; a 404: a wrong url or model) is not retried: it would fail again. What the judge
answered is returned as it is, never retried: a malformed verdict is the verdict
(``gdpo_ray.judges.verdict``). A request that cannot be answered raises ``JudgeUnavailable`` with
its kind (``timeout`` or ``infra``) and a text that never holds the key.

The key is read from the environment variable ``api_key_env`` names, on the machine that asks (a
rollout actor's node), at each request; it is sent as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from gdpo_ray.judges.rubric import JudgeSetting

#: first backoff, its cap (s)
BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0
#: characters of an error body quoted
QUOTED = 300


class JudgeUnavailable(RuntimeError):
    """A judge request that could not be answered after its retries (``kind``: timeout or infra)."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


class Answer:
    """A judge's answer: its text, tokens (prompt + completion, as the server counts them) and the
    seconds the request took (the successful attempt's)."""

    __slots__ = ("text", "tokens", "latency_s")

    def __init__(self, text: str, tokens: int, latency_s: float) -> None:
        self.text, self.tokens, self.latency_s = text, tokens, latency_s


class EndpointJudge:
    """One endpoint's client on one event loop (it opens its HTTP session there on first use)."""

    def __init__(self, setting: JudgeSetting) -> None:
        if setting.url is None:
            raise ValueError("EndpointJudge needs judge.url")
        self.setting = setting
        self._session: Any = None
        self._open = asyncio.Semaphore(setting.max_in_flight)
        self.retried = 0  # requests sent again (counted for judge/retries)

    def _headers(self) -> dict[str, str]:
        env = self.setting.api_key_env
        if env is None:
            return {}
        key = os.environ.get(env)
        if not key:
            raise JudgeUnavailable("infra", f"the judge's key is missing: environment variable {env} is not set on "
                                            "this node (set it where the rollout actors run)")
        return {"Authorization": f"Bearer {key}"}

    def _clean(self, text: str) -> str:
        key = os.environ.get(self.setting.api_key_env or "", "")
        return text.replace(key, "***") if key else text

    async def ask(self, message: str) -> Answer:
        import aiohttp

        s = self.setting
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {"model": s.model, "messages": [{"role": "user", "content": message}],
                "max_tokens": s.max_tokens, "temperature": s.temperature}
        url = f"{s.url}/chat/completions"
        last = ""
        for attempt in range(s.retries + 1):
            if attempt:
                self.retried += 1
            wait = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** attempt) * (0.5 + random.random() / 2)
            kind = "infra"
            async with self._open:
                start = time.perf_counter()
                try:
                    async with self._session.post(url, json=body, headers=self._headers(),
                                                  timeout=aiohttp.ClientTimeout(total=s.timeout_s)) as r:
                        text = await r.text()
                        if r.status == 200:
                            return self._answer(text, time.perf_counter() - start)
                        last = f"{s.url} answered HTTP {r.status}: {text[:QUOTED]!r}"
                        if r.status != 429 and r.status < 500:
                            raise JudgeUnavailable("infra", self._clean(f"{last} (not retried: fix the judge's "
                                                                        "url, model or key)"))
                        if r.status == 429 and r.headers.get("Retry-After", "").isdigit():
                            wait = min(MAX_BACKOFF_S, float(r.headers["Retry-After"]))
                except asyncio.TimeoutError:
                    kind, last = "timeout", f"{s.url} gave no answer within {s.timeout_s:g} s"
                except aiohttp.ClientError as err:
                    last = f"{s.url} could not be reached: {type(err).__name__}: {err}"
                except _Malformed as err:
                    last = f"{s.url} sent a body that is not a chat completion: {err}"
            if attempt < s.retries:
                await asyncio.sleep(wait)
        tries = f" ({s.retries + 1} attempts)"
        raise JudgeUnavailable(kind, self._clean(last + tries))

    @staticmethod
    def _answer(body: str, seconds: float) -> Answer:
        import json

        try:
            data = json.loads(body)
            text = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise _Malformed(f"{type(err).__name__} reading choices[0].message.content of {body[:QUOTED]!r}") from None
        usage = data.get("usage") or {}
        tokens = usage.get("total_tokens") or (usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0))
        return Answer(str(text), int(tokens or 0), seconds)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Malformed(Exception):
    """A 200 whose body is not a chat completion (a proxy's page): retried as a transport fault."""
