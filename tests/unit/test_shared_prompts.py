"""The update's shared-prompt forward (learners/shared_prompts.py): each distinct prompt run
once, its cache shared by the responses after it, gives every response token the values and the
gradients of one plain forward of prompt + response per row."""

import numpy as np
import pytest
import torch

from learners.shared_prompts import distinct_prompts, response_outputs
from learners.token_logprobs import head_input, output_embedding


def test_distinct_prompts_in_order_of_first_appearance():
    a, b = np.array([1, 2, 3]), np.array([1, 2])
    firsts, rows = distinct_prompts([a, b, a.copy(), b, np.array([1, 2, 3], np.int32)])
    assert [f.tolist() for f in firsts] == [[1, 2, 3], [1, 2]]
    assert rows.tolist() == [0, 1, 0, 1, 0]


def _plain(model, prompts, responses, outputs):
    """The reference: one right-padded forward of prompt + response per row."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn, keep = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.as_tensor(np.concatenate([p, r]))
        attn[i, :len(p) + len(r)] = 1
        keep[i, len(p) - 1:len(p) - 1 + len(r)] = True
    return outputs(lambda: model(input_ids=ids, attention_mask=attn))[keep]


def _models():
    import transformers

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return {"qwen2": lambda: transformers.Qwen2Config(**small),
            "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # as the learner
            "mistral-sliding": lambda: transformers.MistralConfig(**small, sliding_window=6)}


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "mistral-sliding"])
@pytest.mark.parametrize("through", ["logits", "head input"])
def test_every_response_token_gets_the_plain_forward_s_values_and_gradients(arch, through):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_models()[arch]()).train()
    rng = np.random.default_rng(1)
    groups = [rng.integers(1, 64, n) for n in (5, 9, 3)]
    # groups of 4 rows after one prompt, the groups' rows interleaved; responses of 1 to 12 tokens
    # and one empty (an aborted sample)
    prompts = [groups[i % 3] for i in range(12)]
    responses = [rng.integers(1, 64, int(n)) for n in rng.integers(1, 13, 12)]
    responses[4] = np.zeros(0, np.int64)
    responses[7] = rng.integers(1, 64, 1)
    head = output_embedding(model)

    def outputs(forward):
        return forward().logits if through == "logits" else head_input(model, head, forward)

    shared = response_outputs(model, *distinct_prompts(prompts), responses, "cpu", outputs)
    assert_plain_values_and_gradients(model, shared, _plain(model, prompts, responses, outputs), responses)


def assert_plain_values_and_gradients(model, got, plain, responses):
    """``got`` [N, X] has the plain forward's values, and the gradient of any weighted sum of it
    with respect to the model's parameters is the plain one's (up to float rounding: sums reordered)."""
    assert got.shape == plain.shape == (sum(len(r) for r in responses), plain.shape[-1])
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    weights = torch.randn(plain.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad((plain * weights).sum(), params, allow_unused=True)
    have = torch.autograd.grad((got * weights).sum(), params, allow_unused=True)
    for w, g in zip(want, have):
        if w is None:
            assert g is None or not g.any()
            continue
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


def test_responses_of_one_token_need_no_second_forward():
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_models()["qwen2"]()).eval()
    calls = []

    def outputs(forward):
        calls.append(1)
        return forward().logits

    prompts, responses = [np.array([3, 4, 5])] * 3, [np.array([7]), np.array([8]), np.array([9])]
    with torch.no_grad():
        shared = response_outputs(model, *distinct_prompts(prompts), responses, "cpu", outputs)
        plain = _plain(model, prompts, responses, lambda f: f().logits)
    assert len(calls) == 1
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
