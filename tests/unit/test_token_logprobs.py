"""Token logprobs in slices of rows (learners/token_logprobs.py) against log_softmax then gather:
the values, the entropies and the gradients of the hidden states and of the weight."""

import pytest
import torch

from learners import token_logprobs as tl


@pytest.mark.parametrize("temperature, slice_rows", [(1.0, 3), (0.7, 1), (1.3, 100)])
def test_sliced_logprobs_and_gradients_equal_the_plain_ones(monkeypatch, temperature, slice_rows):
    torch.manual_seed(0)
    n, h, v = 7, 5, 11
    monkeypatch.setattr(tl, "SLICE_BYTES", 4 * v * slice_rows)  # slice_rows rows per slice
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    grad = torch.randn(n, dtype=torch.float64)

    logp, entropy = tl.token_logprobs(hidden, weight, targets, temperature)
    (logp.double() * grad).sum().backward()
    mine = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    plain = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
    expected = plain.gather(1, targets[:, None])[:, 0]
    (expected.double() * grad).sum().backward()
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, -(plain.exp() * plain).sum(-1), rtol=0, atol=1e-5)
    assert not entropy.requires_grad
    torch.testing.assert_close(mine[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[1], weight.grad, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_no_rows_is_empty():
    hidden = torch.randn(4, 3, requires_grad=True)
    weight = torch.randn(6, 3)  # the LM head under LoRA: frozen
    logp, _ = tl.token_logprobs(hidden, weight, torch.tensor([0, 1, 2, 5]))
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    empty, entropy = tl.token_logprobs(torch.zeros(0, 3), weight, torch.zeros(0, dtype=torch.long))
    assert empty.shape == entropy.shape == (0,)


def test_the_probe_takes_a_plain_head_and_refuses_a_scaled_one(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert tl.fused_head(model, "cpu")
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda _m, _a, out: out * 2.0)  # logits that are not the head's product
    assert not tl.fused_head(model, "cpu")
