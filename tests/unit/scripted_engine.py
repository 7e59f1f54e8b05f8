"""A batch engine (``actors.engines.BatchEngine``) that replays a script of turns, for the tests
of multi-turn rollouts: the turns a policy that calls tools would sample. Its tokenizer and chat
template are the model directory's; the k-th assistant turn of a rollout (counted in its
context) is ``script[k]`` encoded, then the end-of-turn token, each at logprob -0.5."""

from actors.engines import Sample


class ScriptedEngine:
    weight_transfer = False
    device = "cpu"

    @classmethod
    def check_sampling(cls, sampling):
        pass

    def __init__(self, model_path, seed=0, script=()):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.script = list(script)
        self.contexts = []

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        out = []
        for context in prompt_token_ids:
            self.contexts.append(list(context))
            turn = self.tokenizer.decode(context).count("<|im_start|>assistant") - 1
            ids = self.tokenizer(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tokenizer.eos_token_id])[:sampling.max_tokens]
            reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
            out.append([Sample(ids, [-0.5] * len(ids), reason) for _ in range(n)])
        return out

    def load_weights(self, named_tensors):
        raise NotImplementedError

    def weight_digests(self, sent):
        raise NotImplementedError

    def sleep(self):
        pass

    def wake_up(self):
        pass

    def shutdown(self):
        pass


class FirstTurnScripted:
    """A real engine whose first turn of every rollout is ``text`` (then the end-of-turn token, at
    logprob -0.5): the later turns are the engine's own, generated after a tool turn."""

    def __init__(self, engine, text):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [engine.tokenizer.eos_token_id]

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        first = [self.tokenizer.decode(c).count("<|im_start|>assistant") == 1 for c in prompt_token_ids]
        rest = [c for c, f in zip(prompt_token_ids, first) if not f]
        real = iter(self.engine.generate(rest, n, sampling, logprobs) if rest else [])
        return [[Sample(list(self.ids), [-0.5] * len(self.ids), "stop")] * n if f else next(real) for f in first]
