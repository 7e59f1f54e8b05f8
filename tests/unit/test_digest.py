"""The order-aware weight digest (issue 50): every element's value and position and the tensor's
row length count; additive by global offset (fused and sharded tensors); zeros add nothing
(padding); the numpy and torch paths agree bit for bit; the faults an order-blind sum missed are
refused."""

import numpy as np
import pytest
import torch

from gdpo_ray.weights import digest as dg
from gdpo_ray.weights.digest import (FUSED, MOD, Sent, combine, compare, device_digest, digest, digest_as,
                                     digest_raw, rounded_digests, shifted)

K, R = dg.SCRAMBLE, dg.BASE


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) % MOD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % MOD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % MOD
    return z ^ (z >> 31)


def reference(t: torch.Tensor, offset: int = 0, row_length: int | None = None) -> int:
    """The module docstring's formula as a plain loop: S(C) * sum_i R**pos(i) * g(b_i), with
    g(b) = v ^ (v >> w/2), v = b * K mod 2**w (w the element's bits) read as signed w bits,
    S(C) = splitmix64(C) | 1, all mod 2**64."""
    shape = tuple(t.shape)
    length = (shape[-1] if len(shape) >= 2 else 1) if row_length is None else row_length
    block = row_length is not None and len(shape) >= 2 and shape[-1] != length
    width = shape[-1] if block else None
    w = 8 * t.element_size()
    bits = t.contiguous().view(getattr(torch, f"int{w}")).reshape(-1).tolist()
    total = 0
    for k, b in enumerate(bits):
        position = offset + (k // width) * length + k % width if block else offset + k
        v = b * K % (1 << w)
        g = v ^ (v >> (w // 2))
        g -= (1 << w) if g >> (w - 1) else 0  # signed
        total += g * pow(R, position, MOD)
    return total * (splitmix64(length) | 1) % MOD


def order_blind(t: torch.Tensor) -> int:
    """The digest before issue 50: the sum of the elements' bit patterns, mod 2**64."""
    return int(t.contiguous().view(getattr(torch, f"int{8 * t.element_size()}")).sum(dtype=torch.int64)) % MOD


@pytest.fixture
def small_batches(monkeypatch):
    """Rows of 8 elements and steps of 24: every loop of the digest runs many times on small
    tensors (a tail row, several column pieces, several batches)."""
    monkeypatch.setattr(dg, "WIDTH", 8)
    monkeypatch.setattr(dg, "HOST_BATCH", 24)
    monkeypatch.setattr(dg, "DEVICE_BATCH", 24)
    monkeypatch.setattr(dg, "ROUND_BATCH", 10)


TENSORS = {
    "float32 matrix": lambda: torch.randn(7, 5),
    "float32 vector": lambda: torch.randn(61),
    "bfloat16": lambda: torch.randn(9, 11).bfloat16(),
    "float16 3-d": lambda: torch.randn(2, 3, 13).half(),
    "float64": lambda: torch.randn(4, 6).double(),
    "int64 with negatives": lambda: torch.randint(-(1 << 62), 1 << 62, (23,)),
    "int8": lambda: torch.randint(-128, 127, (3, 17), dtype=torch.int8),
    "scalar": lambda: torch.tensor(2.5),
    "empty": lambda: torch.zeros(0, 4),
    "no columns": lambda: torch.zeros(3, 0),
}


@pytest.fixture(params=["compiled", "numpy"])
def host(request, monkeypatch):
    """The host path: the compiled loop, or numpy's (what a process running vLLM uses)."""
    if request.param == "numpy":
        monkeypatch.setattr(dg, "_NUMPY_ONLY", True)
    return request.param


@pytest.mark.parametrize("batches", ["default", "small"])
@pytest.mark.parametrize("kind", sorted(TENSORS))
def test_the_digest_is_the_docstrings_formula_on_every_path_bit_for_bit(kind, batches, host, request):
    """The host loop (numba, or numpy's array operations), torch (the device path, run here on
    the host) and the plain loop agree exactly, whole or shifted, in batches of any size."""
    if batches == "small":
        request.getfixturevalue("small_batches")
    torch.manual_seed(0)
    t = TENSORS[kind]()
    expected = reference(t)
    assert digest(t) == device_digest(t) == expected
    if t.dtype != torch.bfloat16:  # numpy has no bfloat16
        assert digest(t.numpy()) == expected
    assert digest(t, 1000) == device_digest(t, 1000) == reference(t, 1000) == shifted(expected, 1000)


def test_a_process_whose_engine_cannot_abide_numba_keeps_to_numpy(monkeypatch):
    """vLLM's CPU kernel registration fails on llvmlite's objects, so its engines call
    ``keep_to_numpy`` before loading it: the host digest then never loads numba, and gives the
    same values."""
    from actors import vllm_engine, vllm_stream_engine

    t = torch.randn(5, 7)
    expected = digest(t)
    assert dg._compiled() is not None
    monkeypatch.setattr(dg, "_NUMPY_ONLY", False)
    dg.keep_to_numpy()
    assert dg._compiled() is None and digest(t) == expected
    assert vllm_engine.keep_to_numpy is vllm_stream_engine.keep_to_numpy is dg.keep_to_numpy


def test_one_pinned_value():
    """[1.0]: b = 0x3F800000, v = b * K mod 2**32 = 0x3F800000 * 0x1CE4E5B9 mod 2**32, g = v ^ (v >> 16)
    (the top bit clear: positive); C = 1, i = 0 (R**0 = 1): digest = g * (splitmix64(1) | 1) mod
    2**64. Pinned, so that a change to the definition (which senders and receivers of one release
    share) is a decision, not an accident."""
    v = 0x3F800000 * 0x1CE4E5B9 % (1 << 32)
    assert v == 0x63800000 and (v ^ (v >> 16)) == 0x63806380
    assert digest(torch.tensor([1.0])) == 0x63806380 * (splitmix64(1) | 1) % MOD == 16436408341167408000


def test_parts_where_they_sit_add_up_to_the_whole(small_batches, host):
    """Row shards, column blocks (each row at offset + r * row_length) and runs of a flat
    tensor, each digested where it sits, sum to the whole's digest; the device path too."""
    torch.manual_seed(1)
    w = torch.randn(6, 21)
    whole = digest(w)
    rows = [w[:2], w[2:5], w[5:]]
    assert sum(digest(p, 21 * s, 21) for p, s in zip(rows, (0, 2, 5))) % MOD == whole
    columns = [w[:, :4], w[:, 4:13], w[:, 13:]]
    assert sum(digest(c, s, 21) for c, s in zip(columns, (0, 4, 13))) % MOD == whole
    assert sum(device_digest(c, s, 21) for c, s in zip(columns, (0, 4, 13))) % MOD == whole
    assert digest(columns[1], 4, 21) == reference(columns[1], 4, 21)
    flat = w.reshape(-1)
    assert (digest(flat[:50], 0, 21) + digest(flat[50:], 50, 21)) % MOD == whole
    with pytest.raises(ValueError, match="wider than the rows"):
        digest(w, 0, 20)


def test_fused_tensors_are_the_parts_placed_by_their_sizes():
    """vLLM's qkv_proj = cat(q, k, v) along rows: its digest is combine(the parts' digests, their
    sizes) = d_q + R**|q| d_k + R**(|q|+|k|) d_v; compare places a FUSED key's parts by the sent
    shapes. The same parts in another order (shards swapped) are refused."""
    torch.manual_seed(2)
    q, k, v, o = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 8)
    sent = {"q": digest(q), "k": digest(k), "v": digest(v), "o": digest(o)}
    shapes = {"q": (8, 4), "k": (2, 4), "v": (2, 4), "o": (4, 8)}
    qkv = torch.cat([q, k, v])
    assert digest(qkv) == combine([sent["q"], sent["k"], sent["v"]], [32, 8, 8]) \
        == (sent["q"] + pow(R, 32, MOD) * sent["k"] + pow(R, 40, MOD) * sent["v"]) % MOD
    held = {f"q{FUSED}k{FUSED}v": digest(qkv), "o": digest(o)}
    assert compare(sent, held, shapes=shapes) == []
    kqv = torch.cat([k, q, v])  # a loader that put k's rows where q's belong
    assert compare(sent, {"q+k+v": digest(kqv), "o": digest(o)}, shapes=shapes) == [
        "q+k+v: the engine holds other values than were sent"]
    assert order_blind(kqv) == order_blind(qkv)  # what the order-blind sum let through
    assert compare(sent, held) == ["q+k+v: the sent shape of q was not recorded, so the tensors it joins "
                                   "cannot be placed (Sent.shapes)"]
    biases = [torch.randn(8), torch.randn(2), torch.randn(2)]  # vectors fuse alike (row length 1)
    assert digest(torch.cat(biases)) == combine([digest(b) for b in biases], [8, 2, 2])


def test_zero_padding_adds_nothing_and_anything_else_shows():
    """vLLM pads the vocabulary rows of embed_tokens / lm_head with zeros: the padded tensor's
    digest is the unpadded one's (g(0) = 0). A non-zero pad, even -0.0 (bits 0x80000000), is not."""
    torch.manual_seed(3)
    embed = torch.randn(10, 4)
    padded = torch.cat([embed, torch.zeros(6, 4)])
    assert digest(padded) == digest(embed)
    assert digest_as(padded.bfloat16(), "float32") == digest_as(embed.bfloat16(), "float32")
    padded[12, 1] = -0.0
    assert digest(padded) != digest(embed)


def faults(t: torch.Tensor) -> dict:
    """The faults the issue names, each holding the very values of ``t`` in other places (an
    order-blind sum of bit patterns cannot see them)."""
    n = t.shape[0]
    pair = t.clone().reshape(-1)
    pair[17] = -pair[3]  # x at 3, -x at 17 ...
    signs_swapped = pair.clone()
    signs_swapped[3], signs_swapped[17] = pair[17], pair[3]  # ... held as -x at 3, x at 17
    shards = t.reshape(2, n // 2, -1)
    return {
        "permuted rows": (t, t[torch.randperm(n, generator=torch.Generator().manual_seed(0))]),
        "reversed rows": (t, t.flip(0)),
        "a square transpose": (t, t.t().contiguous()),
        "swapped shards": (t, torch.cat([shards[1], shards[0]])),
        "a +x/-x pair with its signs swapped": (pair.reshape(t.shape), signs_swapped.reshape(t.shape)),
        "another row length": (t, t.reshape(n // 2, -1)),
    }


@pytest.mark.parametrize("name", ["permuted rows", "reversed rows", "a square transpose", "swapped shards",
                                  "a +x/-x pair with its signs swapped", "another row length"])
def test_the_right_values_in_the_wrong_places_are_refused(name):
    torch.manual_seed(4)
    sent, held = faults(torch.randn(16, 16))[name]
    assert not torch.equal(sent, held.reshape(sent.shape)) or sent.shape != held.shape
    assert order_blind(held) == order_blind(sent)  # the old digest let it through
    assert digest(held) != digest(sent)
    assert compare({"w": digest(sent)}, {"w": digest(held)}) == ["w: the engine holds other values than were sent"]


def test_every_pair_of_opposite_one_ulp_changes_is_refused():
    """+1 ulp at i and -1 ulp at j leaves the sum of bit patterns as it was; here each of 2,000
    such pairs (and 2,000 swaps of two elements, and 2,000 single flipped bits) changes the digest."""
    torch.manual_seed(5)
    t = torch.randn(64, 48)
    base = digest(t)
    bits = t.view(torch.int32).reshape(-1)
    rng = np.random.default_rng(5)
    for i, j in rng.choice(t.numel(), size=(2000, 2)):
        if i == j:
            continue
        changed = bits.clone()
        changed[i] += 1
        changed[j] -= 1
        assert order_blind(changed) == order_blind(bits)
        assert digest(changed.view(torch.float32).reshape(t.shape)) != base, (i, j)
        swapped = bits.clone()
        swapped[i], swapped[j] = bits[j], bits[i]
        assert bool(bits[i] == bits[j]) or digest(swapped.view(torch.float32).reshape(t.shape)) != base, (i, j)
        flipped = bits.clone()
        bit = int(rng.integers(32))
        flipped[i] ^= (1 << bit) if bit < 31 else -(1 << 31)
        assert digest(flipped.view(torch.float32).reshape(t.shape)) != base, i


def test_raw_bytes_need_their_shape(small_batches):
    torch.manual_seed(6)
    w = torch.randn(5, 7)
    raw = w.view(-1).view(torch.uint8)
    assert digest_raw(raw.numpy(), "float32", (5, 7)) == digest_raw(raw, "float32", (5, 7)) == digest(w)
    assert digest_raw(raw.numpy(), "float32", (7, 5)) != digest(w)  # the row length counts
    with pytest.raises(ValueError, match="140 bytes of float32 are 35 elements, not a tensor of shape"):
        digest_raw(raw.numpy(), "float32", (6, 7))


def test_rounded_digests_are_what_an_engine_holding_the_lower_precision_reports(small_batches):
    """Rounded ROUND_BATCH elements at a time (10 here), each batch digested where it sits; a
    fused key matches the parts' rounded digests placed alike."""
    torch.manual_seed(7)
    q, k = torch.randn(6, 3), torch.randn(3, 3)
    rounded = {"q": rounded_digests(q, "float32", ("bfloat16", "float16")),
               "k": rounded_digests(k.view(-1).view(torch.uint8).numpy(), "float32", ("bfloat16",), (3, 3))}
    assert rounded["q"] == {"bfloat16": digest(q.bfloat16().float()), "float16": digest(q.half().float())}
    assert rounded["k"] == {"bfloat16": digest(k.bfloat16().float())}
    held = torch.cat([q, k]).bfloat16()  # a bfloat16 engine's fused tensor, read back as float32
    sent = {"q": digest(q), "k": digest(k)}
    assert compare(sent, {"q+k": digest_as(held, "float32")}, rounded, {"q": (6, 3), "k": (3, 3)}) == []
    assert compare(sent, {"q+k": digest_as(held, "float32")}, None, {"q": (6, 3), "k": (3, 3)}) != []
    assert rounded_digests(q.half(), "float16", ("bfloat16",)) == {}


def test_digest_as_converts_a_block_at_a_time_where_it_sits(small_batches):
    torch.manual_seed(8)
    w = torch.randn(5, 9).bfloat16()
    assert digest_as(w, "float32") == digest(w.float())
    assert (digest_as(w[:, :4], "float32", 0, 9) + digest_as(w[:, 4:], "float32", 4, 9)) % MOD == digest(w.float())


def test_sent_records_shapes_from_buckets():
    from gdpo_ray.weights.buckets import pack_buckets

    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5))]
    sent = Sent()
    for bucket in pack_buckets(tensors, 1 << 20):
        sent.add_bucket(bucket)
    assert sent.shapes == {"a": (3, 4), "b": (5,)} and sent.digests == {n: digest(t) for n, t in tensors}


# --- the vLLM worker's read-back helpers, without vLLM ------------------------------------------

class PackedLinear(torch.nn.Module):
    """A CPU linear layer whose weight vLLM packed for its kernel (the parameter left empty)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.packed, self.input_size_per_partition, self.params_dtype = w, w.shape[1], w.dtype
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def cpu_linear(self, x, weight, bias):
        return x @ self.packed.t()


def test_a_packed_cpu_linear_is_read_back_a_block_of_columns_at_a_time(monkeypatch):
    from actors import vllm_worker_ext as ext

    torch.manual_seed(9)
    w = torch.randn(6, 10)
    model = torch.nn.Module()
    model.proj = PackedLinear(w)
    monkeypatch.setattr(ext, "PROBE_BYTES", 3 * 10 * 4)  # 3 identity rows a probe: 4 blocks of columns
    assert ext.held_digest(model, "proj.weight", model.proj.weight, "float32", digest_as) == digest(w)
    model.proj.packed = w.flip(1)
    assert ext.held_digest(model, "proj.weight", model.proj.weight, "float32", digest_as) != digest(w)


def test_a_lora_slot_wider_than_the_rank_is_read_back_as_the_sent_tensor():
    """A slot is max_lora_rank wide: B [out, r] sits in its first r columns; its rows over two
    slices add up at their places; a non-zero outside the adapter's columns shows."""
    from actors.vllm_worker_ext import adapter_ranks, b_digest

    torch.manual_seed(10)
    b = torch.randn(6, 4)
    slot = torch.zeros(1, 6, 8)
    slot[0, :, :4] = b
    assert b_digest(slot, 4, "float32", 0, digest_as) == digest(b)
    assert b_digest(slot, None, "float32", 0, digest_as) != digest(b)  # read as [6, 8]
    top, bottom = slot[:, :2], slot[:, 2:]  # one PEFT module over two slices
    assert (b_digest(top, 4, "float32", 0, digest_as) + b_digest(bottom, 4, "float32", 2, digest_as)) % MOD \
        == digest(b)
    slot[0, 5, 6] = 1.0
    assert b_digest(slot, 4, "float32", 0, digest_as) != digest(b)

    class Weights:
        lora_a = [torch.zeros(4, 3), None]

    class Adapter:
        def get_lora(self, module_name):
            return Weights() if module_name == "qkv" else None

    assert adapter_ranks(object(), Adapter(), "qkv", 2) == [4, None]
    assert adapter_ranks(object(), Adapter(), "qkv", 3) == [None] * 3
    assert adapter_ranks(object(), Adapter(), "o", 1) == [None]
    assert adapter_ranks(object(), None, "qkv", 2) == [None, None]


def test_fused_names_are_joined_in_the_order_the_parameter_holds_them():
    """vLLM's Qwen2 maps q/k/v_proj straight to qkv_proj (its hf_to_vllm_mapper): the place of
    each part still comes from packed_modules_mapping, so the key reads q+k+v, not k+q+v."""
    from actors.vllm_worker_ext import vllm_param_name

    class Mapper:
        def map_name(self, name):
            for part, packed in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj.")):
                name = name.replace(part, packed)
            return name

    class Model:
        hf_to_vllm_mapper = Mapper()
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    params = {"l.qkv_proj.weight": None, "l.gate_up_proj.weight": None, "l.o_proj.weight": None}
    found = {n: vllm_param_name(Model(), n, params) for n in
             ("l.k_proj.weight", "l.v_proj.weight", "l.q_proj.weight", "l.up_proj.weight", "l.gate_proj.weight",
              "l.o_proj.weight", "l.x_proj.weight")}
    assert found == {"l.k_proj.weight": ("l.qkv_proj.weight", 1), "l.v_proj.weight": ("l.qkv_proj.weight", 2),
                     "l.q_proj.weight": ("l.qkv_proj.weight", 0), "l.up_proj.weight": ("l.gate_up_proj.weight", 1),
                     "l.gate_proj.weight": ("l.gate_up_proj.weight", 0), "l.o_proj.weight": ("l.o_proj.weight", 0),
                     "l.x_proj.weight": None}
