"""Test helpers around engines: greedy decoding of an engine's weights as they are (to see which
weights an engine or a rollout actor holds; no engine offers greedy decoding itself), and a
user's own batch engine, given by import path."""

from actors.engines import Sample
from actors.hf_engine import HFEngine


def greedy(engine, prompt_token_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions (argmax at every step, up to and including the stop token) of each
    prompt by an hf or vllm batch engine's model as it is now."""
    if not isinstance(engine, HFEngine):  # actors.vllm_engine.VLLMEngine
        from vllm import SamplingParams as VLLMSampling

        outputs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                                      VLLMSampling(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in outputs]
    torch, out = engine.torch, []
    with torch.no_grad():
        for p in prompt_token_ids:  # one by one: no padding to reason about
            ids = torch.tensor([p], device=engine.device)
            seq = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=max_tokens, pad_token_id=engine.pad_id,
                                        eos_token_id=engine.eos_ids)
            new = seq[0, len(p):].tolist()
            ends = [i for i, t in enumerate(new) if t in engine.eos_ids]
            out.append(new[:ends[0] + 1] if ends else new)
    return out


def actor_greedy(actor, prompts: list, max_tokens: int) -> list[list[int]]:
    """``greedy`` of a rollout actor's engine, its prompts tokenized as the actor tokenizes them
    for generation (run inside the actor: ``handle.__ray_call__.remote(actor_greedy, ...)``)."""
    return greedy(actor.engine, [actor.tokenize(p) for p in prompts], max_tokens)


def greedy_with(model_dir: str, weights: dict, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """``greedy`` of an hf engine on ``model_dir`` holding ``weights`` (name -> numpy array),
    each prompt as one chat-templated user message (as a rollout actor applies it)."""
    import torch

    engine = HFEngine(model_dir)
    engine.load_weights((k, torch.from_numpy(v)) for k, v in weights.items())
    template = engine.tokenizer.apply_chat_template
    ids = [engine.tokenizer(template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     tokenize=False), add_special_tokens=False)["input_ids"] for p in prompts]
    return greedy(engine, ids, max_tokens)


class ScriptedEngine:
    """A user's batch engine (``engine="tests.engines:ScriptedEngine"``), written against
    ``actors.engines.BatchEngine`` alone: sample j of a prompt repeats the prompt's last token
    2j + 1 times, cut at ``max_tokens`` ("length") or not ("stop"), each token with logprob
    -(j + 1); ``loads`` counts the weight pushes it took."""

    weight_transfer = False

    def __init__(self, model_path: str, seed: int = 0, device: str = "cpu") -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = device
        self.loads = 0

    @classmethod
    def check_sampling(cls, sampling) -> None:
        pass

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        out = []
        for p in prompt_token_ids:
            group = []
            for j in range(n):
                length = min(2 * j + 1, sampling.max_tokens)
                reason = "stop" if 2 * j + 1 <= sampling.max_tokens else "length"
                group.append(Sample([p[-1]] * length, [-(j + 1.0)] * length, reason))
            out.append(group)
        return out

    def load_weights(self, named_tensors) -> None:
        from gdpo_ray.weights.digest import digest

        self.held = {name: digest(tensor) for name, tensor in named_tensors}  # what it "computes with"
        self.loads += 1

    def weight_digests(self, sent) -> dict:
        return {name: self.held[name] for name in sent if name in self.held}

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class InertHFEngine(HFEngine):
    """The hf engine with a load that silently does nothing (the fault of issue 30's tamper
    test: an engine that keeps sampling from the weights it started with)."""

    def load_weights(self, named_tensors) -> None:
        for _ in named_tensors:
            pass
