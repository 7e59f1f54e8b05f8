"""The hf engine's KV kept across a rollout's turns (actors/kv_store.py, actors/hf_decode.py
``reused``/``kept``): a later turn that prefills only what follows what it shares with the earlier
one samples the same tokens with the same logprobs as one that prefills its whole context, and
the multi-turn loop on the engine keeps, reuses and forgets its rollouts' KV."""

import numpy as np
import pytest
import torch

from actors.engines import SamplingParams
from actors.hf_decode import decode
from actors.kv_store import KVStore
from gdpo_ray.truncation import Truncation


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _decode(model, prompts, n=1, seed=0, **kw):
    return decode(model, prompts, n, temperature=0.9, truncation=Truncation(top_p=0.95), max_tokens=10,
                  eos_ids=list(range(0, 400, 7)), pad_id=0, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("n", [1, 3])
def test_a_turn_after_kept_kv_equals_one_that_prefills_everything(model, n):
    prompts = [[5, 9, 12, 40], [7], [3, 4, 5, 6, 7, 8, 9]]
    kept, store = [], KVStore()
    first = _decode(model, prompts, n, kept=kept)
    assert len(kept) == len(first) == len(prompts) * n
    for r, ((tokens, _, _), (held, kv)) in enumerate(zip(first, kept)):
        assert held == prompts[r // n] + tokens[:-1].tolist()  # all but the last token was fed
        assert all(k.shape[1] == len(held) == v.shape[1] for k, v in kv)
        store.put(r, held, kv)
    # the next turn: the context, the whole turn, then a tool answer (one row cut short, as a stop
    # string would: it shares less than what was kept; one row with nothing kept)
    contexts = [prompts[r // n] + first[r][0].tolist() + [11, 12, 13 + r] for r in range(len(first))]
    contexts[1] = prompts[0 if n > 1 else 1] + first[1][0].tolist()[:1] + [50, 51]
    reused = [store.take(r, c) for r, c in enumerate(contexts)]
    reused[-1] = None
    # row 1 kept its prompt and its tokens but the last: it shares the prompt and its first token
    # with the cut context (the prompt alone where it sampled one token)
    p1 = prompts[0 if n > 1 else 1]
    assert reused[1][0] == len(p1) + min(1, len(first[1][0]) - 1)
    assert len(store) == 0  # taken entries leave the store
    again = _decode(model, contexts, 1, seed=5, reused=reused)
    plain = _decode(model, contexts, 1, seed=5)
    for (t1, lp1, why1), (t2, lp2, why2) in zip(again, plain):
        assert t1.tolist() == t2.tolist() and why1 == why2
        np.testing.assert_allclose(lp1, lp2, atol=1e-5)


def test_the_store_reuses_the_longest_shared_prefix_and_never_the_last_token():
    kv = [(torch.arange(12.0).reshape(2, 6, 1), torch.zeros(2, 6, 1))]
    store = KVStore()
    store.put("a", [1, 2, 3, 4, 5, 6], kv)
    m, part = store.take("a", [1, 2, 3, 9, 9])
    assert m == 3 and part[0][0].shape == (2, 3, 1) and part[0][0][0, :, 0].tolist() == [0, 1, 2]
    store.put("a", [1, 2, 3], kv)
    assert store.take("a", [1, 2, 3])[0] == 2  # the context's last token is prefilled again: its logits
    store.put("a", [1, 2], kv)
    assert store.take("a", [7, 2]) is None and store.take("a", [1, 2]) is None  # nothing shared; taken
    store.put("b", [1], kv)
    store.release(["b", "never"])
    assert len(store) == 0


def test_the_engine_keeps_kv_for_keyed_rollouts_and_forgets_it(tiny_model_dir):
    from actors.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir)
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    (out,) = engine.generate([[5, 9, 12]], 2, sampling, keys=[("r", 0), ("r", 1)])
    assert len(engine.kv) == 2
    nxt = [[5, 9, 12] + s.token_ids + [3, 4] for s in out]
    engine.generate(nxt, 1, sampling, keys=[("r", 0), None])
    assert engine.kv.reused_tokens == 3 + len(out[0].token_ids) - 1 and len(engine.kv) == 2  # r0 again, r1 kept
    engine.release([("r", 0)])
    assert len(engine.kv) == 1
    engine.load_weights([])  # a push: the kept KV was the old weights'
    assert len(engine.kv) == 0
    engine.generate([[5, 9]], 1, sampling)
    assert len(engine.kv) == 0  # a call without keys keeps nothing


class ForcedFirstTurn:
    """The engine's own calls, but every rollout's first turn replaced by a tool call (a random
    model writes none): the engine keeps the KV of what it sampled, so the second turn reuses its
    prompt (where the forced turn and the sampled one part)."""

    def __init__(self, engine, text):
        self.engine, self.tokenizer, self.traits = engine, engine.tokenizer, engine.traits
        self.ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [engine.tokenizer.eos_token_id]
        self.keys = []

    def generate(self, prompt_token_ids, n, sampling, logprobs=True, keys=None):
        from actors.engines import Sample

        self.keys.append(keys)
        out = self.engine.generate(prompt_token_ids, n, sampling, logprobs, keys=keys)
        first = [self.tokenizer.decode(c).count("<|im_start|>assistant") == 1 for c in prompt_token_ids]
        return [[Sample(list(self.ids), [-0.5] * len(self.ids), "stop")] * n if f else group
                for f, group in zip(first, out)]

    def release(self, keys):
        self.engine.release(keys)


def test_multi_turn_rollouts_on_the_hf_engine_reuse_their_turns_and_leave_nothing(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from actors.hf_engine import HFEngine
    from tests.unit.test_tool_loop import run_tool_rollouts, trajectories

    engine = HFEngine(tiny_model_dir)
    forced = ForcedFirstTurn(engine, '<tool_call>{"name": "add", "arguments": {"value": 3}}</tool_call>')
    tok = engine.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "Put 3 in memory."}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    ts = trajectories(3)
    run_tool_rollouts(forced, [prompt] * 3, ts, SamplingParams(temperature=0.8, max_tokens=160), 2, tok)
    assert [k is not None for k in forced.keys] == [True, True] and len(set(forced.keys[0])) == 3
    assert engine.kv.reused_tokens >= 3 * len(prompt) and len(engine.kv) == 0  # reused, then forgotten
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for t in ts:  # the second turn's logprobs: those of a forward pass over the whole context
        assert t.turns == 2
        with torch.no_grad():
            logits = model(torch.tensor([prompt + t.tokens])).logits[0, len(prompt) - 1:-1].float() / 0.8
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.tokens)[:, None])[:, 0].numpy()
        second = [i for i, m in enumerate(t.mask) if m][len(forced.ids):]
        np.testing.assert_allclose(np.array(t.logprobs)[second], expected[second], atol=1e-4)
