"""The engine protocols and their registry (no engine is built here)."""

import pytest

from actors.engines import (ENGINES, BatchEngine, SamplingParams, StreamingEngine, engine_class,
                            protocol_members)
from gdpo_ray.weights.channels import AsyncWeightReceiver, WeightReceiver


class EchoEngine:
    """A user's batch engine by import path: it only has to fulfil ``BatchEngine``."""

    weight_transfer = False

    @classmethod
    def check_sampling(cls, sampling):
        if sampling.top_k:
            raise ValueError("EchoEngine: no top-k")

    def generate(self, prompt_token_ids, n, sampling, logprobs=True): ...
    def load_weights(self, named_tensors): ...
    def weight_digests(self, sent): ...
    def sleep(self): ...
    def wake_up(self): ...
    def shutdown(self): ...


class Broken:
    """Half a batch engine: no generate, no load_weights."""

    @classmethod
    def check_sampling(cls, sampling): ...

    def sleep(self): ...
    def wake_up(self): ...
    def shutdown(self): ...


class StreamEcho:
    """A user's streaming engine: coroutines where the streaming actor awaits them."""

    check_sampling = EchoEngine.check_sampling

    async def sample(self, prompt_token_ids, sampling, logprobs=True): ...
    async def generate(self, prompt_token_ids, n, sampling, logprobs=True): ...
    def write_weights(self, named_tensors): ...
    async def weight_digests(self, sent): ...
    async def push(self, path, version): ...
    async def sleep(self): ...
    async def wake_up(self): ...
    def shutdown(self): ...


class SyncSample(StreamEcho):
    def sample(self, prompt_token_ids, sampling, logprobs=True): ...


class HalfTransfer(EchoEngine):
    """Offers vLLM's weight transfer, but only half of it."""

    def join_weight_transfer(self, host, port, rank, world_size): ...


class AsyncTransferInBatch(EchoEngine):
    async def join_weight_transfer(self, host, port, rank, world_size): ...
    async def receive_broadcast(self, update_info, version): ...


HERE = "tests.unit.test_engines"


def test_the_protocols_are_exactly_what_the_actors_call():
    # (method -> whether the actor awaits it), then the attributes it reads
    assert protocol_members(BatchEngine) == (
        {"check_sampling": False, "generate": False, "load_weights": False, "weight_digests": False,
         "sleep": False, "wake_up": False, "shutdown": False}, ("tokenizer", "device", "weight_transfer"))
    assert protocol_members(StreamingEngine) == (
        {"check_sampling": False, "sample": True, "write_weights": False,
         "weight_digests": True, "push": True, "sleep": True, "wake_up": True, "shutdown": False},
        ("tokenizer", "device", "weight_transfer", "max_num_seqs", "active", "pause_s"))
    assert protocol_members(WeightReceiver) == ({"join_weight_transfer": False, "receive_broadcast": False}, ())
    assert protocol_members(AsyncWeightReceiver) == ({"join_weight_transfer": True, "receive_broadcast": True}, ())


def test_registry_resolves_names_per_mode_and_import_paths():
    from actors.hf_engine import HFEngine
    from actors.vllm_engine import VLLMEngine
    from actors.vllm_stream_engine import AsyncVLLMEngine

    assert set(ENGINES) == {"hf", "vllm", "simulated"}
    assert engine_class("hf") is HFEngine and engine_class("vllm") is VLLMEngine
    assert engine_class("vllm", "streaming") is AsyncVLLMEngine
    assert engine_class(f"{HERE}:EchoEngine") is EchoEngine
    assert engine_class(f"{HERE}:StreamEcho", "streaming") is StreamEcho
    with pytest.raises(ValueError, match="unknown engine 'tgi'; known: hf, vllm, simulated"):
        engine_class("tgi")
    with pytest.raises(ValueError, match="cannot import no_such.mod:E"):
        engine_class("no_such.mod:E")
    with pytest.raises(ValueError, match="generation.mode must be one of"):
        engine_class("hf", "continuous")


def test_a_name_without_a_streaming_class_says_to_batch():
    with pytest.raises(ValueError) as err:
        engine_class("hf", "streaming")
    assert str(err.value) == (
        "generation.mode='streaming' needs a continuous-batching engine (vllm, simulated, or a class of "
        "actors.engines.StreamingEngine); engine 'hf' takes batch calls: use generation.mode='batched' "
        "or generation.engine='vllm'")


def test_a_class_missing_methods_is_refused_naming_exactly_those():
    with pytest.raises(ValueError) as err:
        engine_class(f"{HERE}:Broken")
    assert str(err.value) == (
        f"engine '{HERE}:Broken' ({HERE}:Broken) does not fulfil actors.engines.BatchEngine, what "
        "generation.mode='batched' calls: missing: generate, load_weights, weight_digests. Write them "
        "as the protocol's docstrings say")
    with pytest.raises(ValueError, match="missing: check_sampling, generate, load_weights, weight_digests, "
                                         "sleep, wake_up, shutdown"):
        engine_class("json:loads")  # a function, not an engine


def test_a_streaming_engine_must_be_async_where_the_actor_awaits():
    with pytest.raises(ValueError) as err:
        engine_class(f"{HERE}:SyncSample", "streaming")
    assert str(err.value) == (
        f"engine '{HERE}:SyncSample' ({HERE}:SyncSample) does not fulfil actors.engines.StreamingEngine, "
        "what generation.mode='streaming' calls: not async (declare them async def): sample. Write "
        "them as the protocol's docstrings say")
    # a batch engine named for streaming: everything it lacks, and the mode it fits
    with pytest.raises(ValueError) as err:
        engine_class(f"{HERE}:EchoEngine", "streaming")
    assert str(err.value).endswith(
        "calls: missing: sample, write_weights, push; not async (declare them async def): "
        "weight_digests, sleep, wake_up. Write them as the protocol's docstrings say; or, as it fulfils BatchEngine, use "
        "generation.mode='batched'")
    # and the other way round
    with pytest.raises(ValueError) as err:
        engine_class(f"{HERE}:StreamEcho")
    assert str(err.value).endswith(
        "calls: missing: load_weights; async where the actor calls them plainly (declare them def): "
        "generate, weight_digests, sleep, wake_up. Write them as the protocol's docstrings say; or, as it fulfils "
        "StreamingEngine, use generation.mode='streaming'")


def test_an_engine_offering_the_weight_transfer_offers_all_of_it():
    with pytest.raises(ValueError, match=r"does not fulfil gdpo_ray\.weights\.channels\.WeightReceiver, what "
                                         r"generation.mode='batched' calls: missing: receive_broadcast\."):
        engine_class(f"{HERE}:HalfTransfer")
    with pytest.raises(ValueError, match="async where the actor calls them plainly .*: "
                                         "join_weight_transfer, receive_broadcast"):
        engine_class(f"{HERE}:AsyncTransferInBatch")
    from actors.vllm_engine import VLLMEngine
    from actors.vllm_stream_engine import AsyncVLLMEngine

    assert engine_class("vllm") is VLLMEngine and engine_class("vllm", "streaming") is AsyncVLLMEngine


def test_a_config_naming_a_broken_engine_fails_validation_with_the_missing_methods():
    from gdpo_ray import GDPOConfig

    config = (GDPOConfig().llm(model_path="demo").data(prompts="task:addition")
              .training(rewards=[{"name": "correct", "fn": "math_correctness"}], group_size=4,
                        prompts_per_step=2)
              .generation(engine=f"{HERE}:Broken"))
    with pytest.raises(ValueError, match="BatchEngine, what generation.mode='batched' calls: missing: "
                                         "generate, load_weights"):
        config.validate()
    config.generation(engine=f"{HERE}:StreamEcho", mode="streaming").validate()


def test_each_engine_says_which_sampling_it_can_do_exactly():
    truncated = SamplingParams(top_p=0.9, top_k=20, min_p=0.05)  # logprobs of the truncated distribution
    full = SamplingParams(top_p=0.9, top_k=20, truncated_logprobs=False)  # TRL's: of the full one
    for params in (truncated, full, SamplingParams()):
        engine_class("hf").check_sampling(params)
    for mode in ("batched", "streaming"):
        engine_class("vllm", mode).check_sampling(truncated)  # vLLM's processed logprobs
        engine_class("vllm", mode).check_sampling(SamplingParams(truncated_logprobs=False))  # nothing cut
        with pytest.raises(ValueError, match="set truncated_logprobs=true"):
            engine_class("vllm", mode).check_sampling(full)
        with pytest.raises(ValueError, match="samples greedily at a temperature below 1e-05"):
            engine_class("vllm", mode).check_sampling(SamplingParams(temperature=1e-6))