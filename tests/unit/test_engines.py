"""The engine contract and its registry (no engine is built here)."""

import pytest

from actors.engines import ENGINES, SamplingParams, engine_class


class EchoEngine:
    """A user's engine by import path: it only has to fulfil the contract."""

    weight_transfer = False

    @classmethod
    def check_sampling(cls, sampling):
        if sampling.top_k:
            raise ValueError("EchoEngine: no top-k")

    def generate(self, prompt_token_ids, n, sampling): ...
    def greedy(self, prompt_token_ids, max_tokens): ...
    def load_weights(self, named_tensors): ...
    def sleep(self): ...
    def wake_up(self): ...


def test_registry_by_name_and_by_import_path():
    from actors.hf_engine import HFEngine
    from actors.vllm_engine import VLLMEngine

    assert engine_class("hf") is HFEngine and engine_class("vllm") is VLLMEngine
    assert set(ENGINES) == {"hf", "vllm"}
    assert engine_class("tests.unit.test_engines:EchoEngine") is EchoEngine
    with pytest.raises(ValueError, match="unknown engine 'tgi'; known: hf, vllm"):
        engine_class("tgi")
    with pytest.raises(ValueError, match=r"lacks \['generate', 'greedy'"):
        engine_class("json:loads")
    with pytest.raises(ValueError, match="cannot import no_such.mod:E"):
        engine_class("no_such.mod:E")


def test_each_engine_says_which_sampling_it_can_do_exactly():
    truncated = SamplingParams(top_p=0.9, top_k=20)
    engine_class("hf").check_sampling(truncated)  # logprobs of the full distribution
    with pytest.raises(ValueError, match="use top_p=1.0 and top_k=0 with engine='vllm'"):
        engine_class("vllm").check_sampling(truncated)
    engine_class("vllm").check_sampling(SamplingParams())
