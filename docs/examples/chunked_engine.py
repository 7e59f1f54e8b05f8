"""An engine of your own: the hf engine, generating at most ``max_prompts`` prompts per batch
(bounded activation memory for long prompts). It fulfils ``actors.engines.BatchEngine``, what a
rollout actor calls in ``generation.mode='batched'``; the actor builds it as
``ChunkedHFEngine(model_path, seed=..., **generation.engine_kwargs)``.
"""

from actors.engines import SamplingParams
from actors.hf_engine import HFEngine


class ChunkedHFEngine:
    weight_transfer = False  # weights arrive through load_weights (no NCCL weight transfer of its own)

    def __init__(self, model_path: str, max_prompts: int = 2, **hf_kwargs) -> None:
        self.inner = HFEngine(model_path, **hf_kwargs)
        self.tokenizer, self.device = self.inner.tokenizer, self.inner.device
        self.max_prompts = max_prompts

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        HFEngine.check_sampling(sampling)  # asked when the config is validated

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        out = []
        for i in range(0, len(prompt_token_ids), self.max_prompts):
            out += self.inner.generate(prompt_token_ids[i:i + self.max_prompts], n, sampling, logprobs)
        return out

    def load_weights(self, named_tensors) -> None:
        self.inner.load_weights(named_tensors)

    def weight_digests(self, sent):
        return self.inner.weight_digests(sent)  # what the model holds: every push is attested

    def sleep(self) -> None:
        self.inner.sleep()

    def wake_up(self) -> None:
        self.inner.wake_up()

    def shutdown(self) -> None:
        self.inner.shutdown()
