"""The update's packed forward (learners/packing.py): rows end to end in lines, each prompt once
per line, attention confined by the mask, gives every response token the values and gradients of
one plain forward of prompt + response per row, on the model families tested, with little padding."""

import numpy as np
import pytest
import torch

from learners.packing import layout, lines_of, packable, packed_outputs
from learners.shared_prompts import distinct_prompts
from learners.token_logprobs import head_input, output_embedding
from tests.unit.test_shared_prompts import _plain, assert_plain_values_and_gradients


def _models():
    import transformers

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return {"qwen2": lambda: transformers.Qwen2Config(**small),
            "llama": lambda: transformers.LlamaConfig(**small),
            "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "mistral-sliding": lambda: transformers.MistralConfig(**small, sliding_window=6),
            "qwen2-mixed-layers": lambda: transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=5,
                                                                   max_window_layers=1)}


def _batch(rng):
    groups = [rng.integers(1, 64, n) for n in (5, 9, 3)]
    prompts = [groups[i % 3] for i in range(12)]  # groups of 4 rows, interleaved
    responses = [rng.integers(1, 64, int(n)) for n in rng.integers(1, 13, 12)]
    responses[4] = np.zeros(0, np.int64)  # an aborted sample
    responses[7] = rng.integers(1, 64, 1)
    return prompts, responses


@pytest.mark.parametrize("arch", list(_models()))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("line_tokens", [1024, 16])
def test_every_response_token_gets_the_plain_forward_s_values_and_gradients(arch, attn, line_tokens):
    import transformers

    torch.manual_seed(0)
    config = _models()[arch]()
    config._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if arch == "qwen2-mixed-layers":
        assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}
    assert packable(model)
    prompts, responses = _batch(np.random.default_rng(1))
    head = output_embedding(model)
    for through in ("logits", "head input"):
        def outputs(forward):
            return forward().logits if through == "logits" else head_input(model, head, forward)

        firsts, row_prompt = distinct_prompts(prompts)
        packed, lay = packed_outputs(model, firsts, row_prompt, responses, "cpu", outputs, line_tokens)
        assert_plain_values_and_gradients(model, packed, _plain(model, prompts, responses, outputs), responses)
        assert (lay.ids.shape[0] > 1) == (line_tokens == 16)


def test_lines_hold_each_prompt_once_and_balance():
    prompts = [np.arange(10), np.arange(4)]
    responses = [np.arange(n) for n in (11, 6, 21, 3, 8, 8)]
    row_prompt = np.array([0, 0, 0, 1, 1, 1])
    # costs (a response's length - 1): prompt 10, rows 10, 5, 20; prompt 4, rows 2, 7, 7; total 65;
    # a group's rows longest first
    assert lines_of(prompts, responses, row_prompt, 1024) == [[(0, [2, 0, 1]), (1, [4, 5, 3])]]
    # 40 tokens a line: 2 lines (40 and 35 tokens), the first group's prompt on both
    assert lines_of(prompts, responses, row_prompt, 40) == [[(0, [2, 0])], [(0, [1]), (1, [4, 5, 3])]]
    lay = layout(prompts, responses, row_prompt, 40)
    assert lay.ids.shape == (2, 40) and lay.padded == 80 - 75
    assert lay.ids[0, :10].tolist() == list(range(10)) and lay.positions[0, 10:30].tolist() == list(range(10, 30))
    assert lay.at[:3].tolist() == [9, 30, 31]  # row 0: its prompt's last position, then its own (after row 2)
    assert lay.at[17:19].tolist() == [9, 10]  # row 2 (after 11 + 6 tokens of rows 0 and 1)
    assert lay.at[11:13].tolist() == [40 + 9, 40 + 10]  # row 1, on the second line after its prompt again
    split = lines_of(prompts, responses, row_prompt, 24)  # 3 lines: the first group's rows split, its prompt again
    assert [u for line in split for u, _ in line] == [0, 0, 1] and sum(len(r) for line in split for _, r in line) == 6


def test_padding_of_the_demo_shape_is_small():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 100, int(n)) for n in rng.integers(24, 32, 16)]
    responses = [rng.integers(1, 100, int(n)) for n in np.clip(rng.geometric(1 / 15, 128), 1, 40)]
    row_prompt = np.repeat(np.arange(16), 8)
    lay = layout(prompts, responses, row_prompt)
    assert lay.padded / lay.computed < 0.05


def test_a_model_packs_only_where_its_kind_and_a_probe_say_so():
    import transformers

    from learners.packing import packs_exactly

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_models()["llama"]()).eval()
    with torch.no_grad():
        assert packs_exactly(model, "cpu")
        forward = model.forward
        model.forward = lambda *a, attention_mask=None, **k: forward(*a, **k)  # a model that ignores the mask
        assert not packs_exactly(model, "cpu")
    neo = transformers.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64)
    assert not packable(transformers.AutoModelForCausalLM.from_config(neo))  # its window is not a mask's
    from types import SimpleNamespace

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert not packable(flash)  # its attention takes no 4-D mask


def test_the_line_length_follows_the_model_s_width():
    from types import SimpleNamespace

    from learners.packing import best_line

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 100, int(n)) for n in rng.integers(24, 32, 16)]
    responses = [rng.integers(1, 100, int(n)) for n in np.clip(rng.geometric(1 / 15, 128), 1, 40)]
    row_prompt = np.repeat(np.arange(16), 8)

    def width(h, i):
        return best_line(SimpleNamespace(config=SimpleNamespace(hidden_size=h, intermediate_size=i)),
                         prompts, responses, row_prompt)

    # attention's share of a token's cost grows with the line and shrinks with the model's width
    assert width(128, 512) <= 256 and width(128, 512) <= width(576, 1536) <= width(4096, 16384)
    assert width(128, 512) < width(4096, 16384)


def test_a_line_past_the_limit_is_not_packed():
    from learners.packing import MAX_LINE_TOKENS

    # one row of a prompt and a response longer than a line may be: no mask is built, no forward runs
    long_prompt, response = np.arange(MAX_LINE_TOKENS - 2) % 50 + 1, np.arange(4)
    assert packed_outputs(None, [long_prompt], np.array([0]), [response], "cpu", None, 1024) is None
    assert layout([long_prompt], [response], np.array([0]), 1024).ids.shape == (1, MAX_LINE_TOKENS + 1)


def test_micro_batches_keep_groups_whole_under_a_budget_of_real_tokens():
    from learners.rows import Row, plan_groups

    def row(prompt, n):
        return Row(np.asarray(prompt), np.arange(n), np.zeros(n, np.float32), 0.0)

    rows = [row([1, 2], n) for n in (10, 30, 20)] + [row([3], n) for n in (5, 5)] + [row([4] * 4, n) for n in (60, 1, 50)]
    plan = plan_groups(rows, 64)
    assert sorted(i for mb in plan for i in mb) == list(range(8))  # each row once
    for mb in plan:  # real tokens: each distinct prompt once, every response
        prompts = {tuple(rows[i].prompt) for i in mb}
        assert sum(map(len, prompts)) + sum(len(rows[i].response) for i in mb) <= 64
    # the first group (2 + 60 = 62) and the second (1 + 10) stay whole; the third (4 + 111) is cut
    # into runs longest first: [60] then [50, 1]
    where = {i: k for k, mb in enumerate(plan) for i in mb}
    assert where[0] == where[1] == where[2] and where[3] == where[4]
    assert where[5] != where[7] and where[7] == where[6]
