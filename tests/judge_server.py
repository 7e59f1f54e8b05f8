"""A judge for the tests: a real OpenAI-compatible HTTP server (``JudgeServer``) and a batch engine
(``VerdictEngine``, for the judge pool's actors) that answer a judge message with the verdict of
``scripted_verdict``, a rule the tests compute too.

``scripted_verdict`` reads the criteria (``- name (low to high): ...`` lines) and the response
(the text after ``The response:``, up to the format line) of the default prompt, and scores
criterion ``c`` as ``expected_score(c, response)``. Markers in the response choose a fault:
``MALFORMED`` (an answer with no JSON), ``OUTOFSCALE`` (every score 7), ``SLOW`` (the server
sleeps 30 s before answering), ``FLAKY`` (the server answers 500 the first time it sees the
message), ``NOSCORE`` (the first criterion left out).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

from tests.unit.scripted_engine import ScriptedEngine

RESPONSE = re.compile(r"The response:\n(.*)\n\nReply with one JSON object", re.DOTALL)
CRITERION = re.compile(r"^- ([A-Za-z0-9_\-]+) \(", re.MULTILINE)


def expected_score(criterion: str, response: str) -> float:
    """The score the scripted judge gives: 0 or 1 from the response's length and the criterion's."""
    return float((len(response) + len(criterion)) % 2)


def scripted_verdict(message: str) -> str:
    criteria = CRITERION.findall(message)
    m = RESPONSE.search(message)
    response = m.group(1) if m else ""
    if "MALFORMED" in response:
        return "The response looks fine to me, I would rate it highly."
    scores = {c: (7 if "OUTOFSCALE" in response else expected_score(c, response)) for c in criteria}
    if "NOSCORE" in response and criteria:
        scores.pop(criteria[0])
    return "Verdict:\n```json\n" + json.dumps(scores) + "\n```"


class JudgeServer:
    """``/v1/chat/completions`` on 127.0.0.1 (a free port), in a thread of its own. ``key``: the
    bearer token it demands (401 otherwise). ``fault_first``: "500" or "slow" (``slow_s``) for the
    first request of every message; ``malformed_every``: every n-th distinct message (by the
    order first seen) is answered without a verdict; ``delay_s``: every answer takes that long
    (a judge model's time, without its CPU). ``requests``: the requests it received;
    ``bodies`` their JSON; ``headers`` their headers; ``malformed`` the messages answered so."""

    def __init__(self, key: str | None = None, slow_s: float = 30.0, fault_first: str | None = None,
                 malformed_every: int = 0, delay_s: float = 0.0) -> None:
        self.key, self.slow_s, self.fault_first, self.malformed_every = key, slow_s, fault_first, malformed_every
        self.malformed: set[str] = set()
        self.delay_s = delay_s
        self._first: dict[str, int] = {}
        self.requests = 0
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self._seen: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        from aiohttp import web

        async def completions(request: web.Request) -> web.Response:
            self.requests += 1
            self.headers.append(dict(request.headers))
            if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
                return web.json_response({"error": "bad key"}, status=401)
            body = await request.json()
            self.bodies.append(body)
            message = body["messages"][-1]["content"]
            first = message not in self._first
            if first:
                self._first[message] = len(self._first)
                if self.fault_first == "500":
                    return web.json_response({"error": "overloaded"}, status=500)
                if self.fault_first == "slow":
                    await asyncio.sleep(self.slow_s)
            if "SLOW" in message.split("The response:")[-1]:
                await asyncio.sleep(self.slow_s)
            if "FLAKY" in message.split("The response:")[-1] and message not in self._seen:
                self._seen.add(message)
                return web.json_response({"error": "overloaded"}, status=500)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            text = scripted_verdict(message)
            if self.malformed_every and self._first[message] % self.malformed_every == self.malformed_every - 1:
                self.malformed.add(message)
                text = "No verdict today."
            return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"],
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                   "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": len(message) // 4, "completion_tokens": 10,
                                                "total_tokens": len(message) // 4 + 10}})

        async def models(request: web.Request) -> web.Response:
            if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
                return web.json_response({"error": "bad key"}, status=401)
            return web.json_response({"object": "list", "data": [{"id": "judge", "object": "model"}]})

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", completions)
            app.router.add_get("/v1/models", models)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "JudgeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VerdictEngine(ScriptedEngine):
    """A batch engine (``actors.engines.BatchEngine``) whose answer to a judge message is
    ``scripted_verdict``'s (its tokenizer the model directory's; the rest a ``ScriptedEngine``'s);
    ``SLOW`` sleeps ``slow_s``."""

    def __init__(self, model_path, seed=0, slow_s=30.0):
        super().__init__(model_path, seed)
        self.slow_s = slow_s

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        from actors.engines import Sample

        out = []
        for ids in prompt_token_ids:
            message = self.tokenizer.decode(ids, skip_special_tokens=True)
            if "SLOW" in message.split("The response:")[-1]:
                time.sleep(self.slow_s)
            tokens = self.tokenizer(scripted_verdict(message), add_special_tokens=False)["input_ids"]
            out.append([Sample(tokens, [], "stop")] * n)
        return out
