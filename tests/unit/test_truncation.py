"""Importance ratios under truncated sampling (gdpo_ray/truncation.py): the rule itself, the
ratio's expectation, and the rollout's recorded logprobs equal to the learner's on-policy."""

import numpy as np
import pytest
import torch

from actors.hf_decode import decode, draw
from gdpo_ray.truncation import Truncation, narrowed, support
from learners.rows import Row


def test_min_p_then_top_k_then_top_p_as_vllm_orders_them():
    scores = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]]))
    # min_p 0.2: p >= 0.08 keeps 4; top_k 3 keeps 0.40 0.25 0.15; top_p 0.75 over those renormalized
    # (0.5, 0.3125, 0.1875): ascending cumsum 0.1875 <= 0.25 cuts the third
    assert support(scores, Truncation(min_p=0.2)).tolist() == [[True] * 4 + [False] * 2]
    assert support(scores, Truncation(min_p=0.2, top_k=3)).tolist() == [[True] * 3 + [False] * 3]
    assert support(scores, Truncation(min_p=0.2, top_k=3, top_p=0.75)).tolist() == [[True] * 2 + [False] * 4]
    # top-p over the full distribution would keep 0.40 0.25 0.15 (0.80 >= 0.75): the order matters
    assert support(scores, Truncation(top_p=0.75)).tolist() == [[True] * 3 + [False] * 3]
    assert support(scores, Truncation(top_p=1e-9), always=torch.tensor([4])).tolist() == [
        [True, False, False, False, True, False]]  # the most likely stays; `always` joins it
    assert torch.equal(narrowed(scores, Truncation()), scores)


def _ratios(mu_logits, pi_logits, t):
    """Per token y: mu's truncated probability, the corrected ratio pi_t/mu_t, the full-distribution
    ratio pi/mu (both sides untruncated) and TRL's mixed one pi/mu_t (a truncated behaviour logprob
    against a full learner one)."""
    mu_t = torch.softmax(narrowed(mu_logits, t), -1)
    pi_t = torch.softmax(narrowed(pi_logits, t), -1)
    mu, pi = torch.softmax(mu_logits, -1), torch.softmax(pi_logits, -1)
    return mu_t, pi_t / mu_t, pi / mu, pi / mu_t


@pytest.mark.parametrize("t", [Truncation(top_p=0.8), Truncation(top_k=5), Truncation(min_p=0.1, top_p=0.9)])
def test_the_corrected_ratio_has_expectation_one_and_the_uncorrected_ones_do_not(t):
    gen = torch.Generator().manual_seed(0)
    # five likely tokens and 35 unlikely ones; the next policy moves mass among the five and
    # away from the rest, keeping each rule's support (checked)
    mu_logits = torch.cat([torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0]), torch.randn(35, generator=gen) * 0.5 - 2])
    pi_logits = mu_logits + torch.cat([torch.tensor([-0.5, 0.5, 0.3, 0.2, 0.0]), torch.full((35,), -0.5)])
    mu_logits, pi_logits = mu_logits.double()[None], pi_logits.double()[None]
    assert torch.equal(support(mu_logits, t), support(pi_logits, t))
    mu_t, corrected, full, mixed = _ratios(mu_logits, pi_logits, t)
    kept = mu_t > 0
    exact = {name: float((mu_t[kept] * r[kept]).sum()) for name, r in
             (("corrected", corrected), ("full", full), ("mixed", mixed))}
    assert exact["corrected"] == pytest.approx(1.0, abs=1e-12)
    assert abs(exact["full"] - 1) > 0.04 and abs(exact["mixed"] - 1) > 0.05
    # and as a run sees it: tokens drawn by the sampler's own draw, the sample mean of each ratio
    draws = torch.cat([draw(mu_t, gen) for _ in range(50_000)])
    assert bool(kept[0, draws].all())
    sem = lambda r: float(r[0, draws].std()) / len(draws) ** 0.5
    for name, r in (("corrected", corrected), ("full", full), ("mixed", mixed)):
        mean = float(r[0, draws].mean())
        assert abs(mean - exact[name]) < 5 * sem(r) + 1e-12, name
    assert abs(float(full[0, draws].mean()) - 1) > 10 * sem(full)
    assert abs(float(corrected[0, draws].mean()) - 1) < 5 * sem(corrected)


def test_on_policy_the_mixed_ratio_is_below_one_and_the_corrected_one_is_one():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    mu_t, corrected, _, mixed = _ratios(logits, logits, Truncation(top_p=0.7))
    kept = mu_t[0] > 0
    assert torch.allclose(corrected[0, kept], torch.ones(int(kept.sum()), dtype=torch.float64))
    assert float(mixed[0, kept].max()) < 0.75  # p / p_t = the kept mass, about top_p


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("t", [Truncation(top_p=0.8), Truncation(top_k=7, min_p=0.02), Truncation()])
def test_the_learners_logprobs_are_the_rollouts_own_on_policy(model, fused, t):
    """Sampled by hf_decode under the truncation, then through the learner's logprob path
    (fused head in slices, or the plain logits) with the same weights: the ratio is 1 per token."""
    from learners.response_logprobs import response_logprobs

    prompts = [[5, 9, 12], [7], [3, 4, 5, 6]]
    rows = decode(model, prompts, 2, temperature=0.8, truncation=t, max_tokens=10, eos_ids=[10**6], pad_id=0,
                  generator=torch.Generator().manual_seed(2))
    learner_rows = [Row(np.asarray(prompts[i // 2]), tokens, logprobs, 0.0) for i, (tokens, logprobs, _) in enumerate(rows)]
    with torch.no_grad():
        got, mask, _ = response_logprobs(model, learner_rows, device="cpu", temperature=0.8, truncation=t,
                                         shared=None, fused=fused)
    for i, r in enumerate(learner_rows):
        np.testing.assert_allclose(got[i, :len(r.response)].numpy(), r.rollout_logprobs, atol=3e-5)
    if t.active:  # the full distribution's logprobs are lower: the learner did truncate
        with torch.no_grad():
            full, _, _ = response_logprobs(model, learner_rows, device="cpu", temperature=0.8,
                                           truncation=Truncation(), shared=None, fused=fused)
        assert float((full - got)[mask].mean()) < -1e-3


def test_sliced_truncated_logprobs_and_gradients_equal_the_plain_ones(monkeypatch):
    import learners.token_logprobs as tl

    gen = torch.Generator().manual_seed(0)
    n, h, v = 9, 6, 30
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    t = Truncation(top_p=0.6, top_k=12)
    monkeypatch.setattr(tl, "SLICE_BYTES", 4 * v * 2)  # 2 rows per slice
    got, _ = tl.token_logprobs(hidden, weight, targets, 0.9, t)
    (got * torch.arange(1.0, n + 1, dtype=torch.float64)).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = narrowed(hidden @ weight.T / 0.9, t, always=targets)
    plain = logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1)
    (plain * torch.arange(1.0, n + 1, dtype=torch.float64)).sum().backward()
    assert torch.allclose(got.double(), plain, atol=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], weight.grad, atol=1e-5)
    outside = ~support(hidden.detach() @ weight.detach().T / 0.9, t)
    assert bool(outside.any())  # the rule cut tokens, so the test compares what it should
