"""The hf engine's decoding loop (actors/hf_decode.py): its filters are transformers' warpers,
its draw follows the probabilities exactly, and every sample it returns is what the model gives
its prompt, token by token, whatever the padding, the sharing of a prompt's cache by its
samples, and the rows leaving the batch."""

import numpy as np
import pytest
import torch

from actors.hf_decode import decode, draw
from gdpo_ray.truncation import Truncation, narrowed


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (7, 0.8), (0, 1e-9), (500, 0.999)])
def test_the_filters_are_transformers_top_k_then_top_p(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(16, 50, generator=gen) * 3
    scores[0, :10] = 2.5  # ties at the k-th score
    expected = scores.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = narrowed(scores, Truncation(top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], scores[~torch.isinf(got)])  # kept scores unchanged
    assert (~torch.isinf(got)).sum(-1).min() >= 1


def test_the_draw_follows_the_probabilities_and_never_picks_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([draw(probs, gen) for _ in range(40_000)])  # [N, 3]
    for row in range(3):
        freq = np.bincount(draws[:, row].numpy(), minlength=5) / len(draws)
        expected = (probs[row] / probs[row].sum()).numpy()
        assert np.all(freq[expected == 0] == 0)
        np.testing.assert_allclose(freq, expected, atol=0.01)  # 4 sigma of 40,000 draws: 0.01
    assert torch.equal(draw(probs, torch.Generator().manual_seed(1)), draws[0])  # the generator decides


def test_the_draw_at_the_top_of_the_cdf_stays_on_a_token_with_mass(monkeypatch):
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1, dtype=torch.float64))  # u = mass
    assert draw(probs, None).item() == 1


def _teacher_forced(model, prompt, response, temperature):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1), logits


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("n, top_k, top_p, truncated_logprobs",
                         [(3, 0, 1.0, True), (1, 0, 1.0, True), (4, 20, 0.9, True), (4, 20, 0.9, False)])
def test_each_sample_is_the_model_s_own_continuation_of_its_prompt(model, n, top_k, top_p, truncated_logprobs):
    """Prompts of different lengths (left padding), n samples sharing a prompt's cache, and a
    third of the vocabulary ending a row, so that rows finish at many steps and leave the batch:
    every token's logprob is what the model gives it after its prompt and the tokens before it,
    under the truncated distribution it was drawn from (or the full one: truncated_logprobs off)."""
    vocab = model.config.vocab_size
    prompts = [[5, 9, 12], [7], [3, 4, 5, 6, 7, 8, 9], [11, 2], [40, 41], [8, 30, 31, 2, 6], [17], [60, 3]]
    eos = list(range(0, vocab, 10))
    rows = decode(model, prompts, n, temperature=0.7, truncation=Truncation(top_k=top_k, top_p=top_p), truncated_logprobs=truncated_logprobs, max_tokens=12,
                  eos_ids=eos, pad_id=0, generator=torch.Generator().manual_seed(3))
    assert len(rows) == len(prompts) * n
    ends = set()
    for r, (tokens, logprobs, reason) in enumerate(rows):
        prompt = prompts[r // n]
        assert 1 <= len(tokens) <= 12 and len(logprobs) == len(tokens)
        assert not set(tokens[:-1].tolist()) & set(eos)  # nothing after an EOS token
        assert reason == ("stop" if tokens[-1] in eos else "length")
        assert reason == "stop" or len(tokens) == 12
        _, scores = _teacher_forced(model, prompt, tokens, 0.7)
        truncated = torch.log_softmax(narrowed(scores, Truncation(top_k=top_k, top_p=top_p)), -1)
        expected = (truncated if truncated_logprobs else torch.log_softmax(scores, -1))
        np.testing.assert_allclose(logprobs, expected[np.arange(len(tokens)), tokens].numpy(), atol=2e-5)
        kept = ~torch.isinf(truncated)
        assert kept[np.arange(len(tokens)), tokens].all()  # only tokens the filters keep
        ends.add(len(tokens))
    assert len(ends) >= 3  # rows ended at several steps (the batch shrank on the way)


def test_top_k_one_is_the_model_s_greedy_continuation(model):
    rows = decode(model, [[5, 9, 12], [7]], 2, temperature=1.0, truncation=Truncation(top_k=1, top_p=1.0), max_tokens=6,
                  eos_ids=[10**6], pad_id=0, generator=torch.Generator().manual_seed(0))
    for r, (tokens, _, reason) in enumerate(rows):
        _, scores = _teacher_forced(model, [[5, 9, 12], [7]][r // 2], tokens, 1.0)
        assert reason == "length" and tokens.tolist() == scores.argmax(-1).tolist()


def test_a_stop_check_ends_a_row_where_it_says(model):
    seen = []

    def stop_check(tokens):
        seen.append(len(tokens))
        return len(tokens) == 3

    rows = decode(model, [[5, 9]], 2, temperature=1.0, truncation=Truncation(top_k=0, top_p=1.0), max_tokens=8, eos_ids=[10**6],
                  pad_id=0, generator=torch.Generator().manual_seed(0), stop_check=stop_check)
    assert [(len(t), reason) for t, _, reason in rows] == [(3, "stop"), (3, "stop")]
    assert seen == [1, 1, 2, 2, 3, 3]


def test_the_engine_cuts_a_sample_at_its_stop_string(tiny_model_dir):
    """HFEngine with a stop string: a sample that holds it ends at the token that completes its
    first occurrence ("stop"); one that does not ran to an EOS token or max_tokens."""
    from collections import Counter

    from actors.engines import SamplingParams
    from actors.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir, seed=0)
    decode_text = engine.tokenizer.decode
    prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
    plain = engine.generate([prompt], 8, SamplingParams(temperature=1.0, max_tokens=24))[0]
    common = Counter("".join(decode_text(s.token_ids) for s in plain)).most_common()
    stop = next(c for c, _ in common if c.strip())  # the most frequent visible character
    samples = engine.generate([prompt], 8, SamplingParams(temperature=1.0, max_tokens=24, stop=(stop,)))[0]
    hits = 0
    for s in samples:
        assert len(s.logprobs) == len(s.token_ids)
        if stop in decode_text(s.token_ids):
            hits += 1
            assert s.finish_reason == "stop" and stop not in decode_text(s.token_ids[:-1])
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 24 or s.token_ids[-1] in engine.eos_ids
    assert hits >= 4


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral-sliding"])
def test_other_architectures_decode_their_own_continuations(arch):
    """Absolute position embeddings (GPT-2), a Llama and a sliding-window attention narrower
    than the sequence (Mistral): the logprobs are the teacher-forced ones."""
    import transformers

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = {"gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
              "llama": lambda: transformers.LlamaConfig(**small),
              "mistral-sliding": lambda: transformers.MistralConfig(**small, sliding_window=4)}[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = [[5, 9, 12], [7], [3, 4, 5, 6, 7, 8, 9]]
    rows = decode(model, prompts, 3, temperature=1.0, truncation=Truncation(top_k=0, top_p=1.0), max_tokens=10,
                  eos_ids=list(range(0, 64, 9)), pad_id=0, generator=torch.Generator().manual_seed(5))
    for r, (tokens, logprobs, _) in enumerate(rows):
        expected, _ = _teacher_forced(model, prompts[r // 3], tokens, 1.0)
        np.testing.assert_allclose(logprobs, expected[np.arange(len(tokens)), tokens].numpy(), atol=2e-5)
