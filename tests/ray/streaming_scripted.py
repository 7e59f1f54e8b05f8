"""A streaming engine (vLLM's ``AsyncLLM``, ``actors.vllm_stream_engine``) whose first turn of
every rollout is ``first_turn`` (then the end-of-turn token, at logprob -0.5): the later turns
are the engine's own, generated after a tool turn. The tiny model never writes a tool call by
itself; this one always does, once."""

from actors.engines import VersionedSample
from actors.vllm_stream_engine import AsyncVLLMEngine


class FirstTurnStreaming(AsyncVLLMEngine):
    def __init__(self, *args, first_turn: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.first = self.tokenizer(first_turn, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    async def sample(self, prompt_token_ids, sampling, logprobs=True):
        if self.tokenizer.decode(prompt_token_ids).count("<|im_start|>assistant") == 1:
            ids = self.first[:sampling.max_tokens]
            return VersionedSample(list(ids), [-0.5] * len(ids) if logprobs else [], "stop", [self.version] * len(ids))
        return await super().sample(prompt_token_ids, sampling, logprobs)
