"""A vLLM worker extension (``worker_extension_cls``): methods vLLM mixes into its GPU/CPU
worker, called by name through ``collective_rpc``.

The async engine's worker runs in a child process of the engine core, itself a child of the
rollout actor, so tensors cannot be handed over in memory: ``collective_rpc`` re-pickles its
arguments in the engine core, and tensors that arrived zero-copy cannot be pickled there
("cannot pickle memoryview objects"). A push is therefore one safetensors file (in
``/dev/shm``: memory, not disk) that the worker maps and loads through vLLM's own layer-wise
``reload_weights``.

``gdpo_weight_digests`` reads back what the worker computes with, for the attestation of a push
(``gdpo_ray.weights.digest``: a digest of every element's value and position): the model's
parameters, and the LoRA weights of an adapter as vLLM's LoRA manager holds them in the slot its
kernels read. Where the worker holds several pushed tensors as one (vLLM's ``qkv_proj`` = q, k,
v; ``gate_up_proj`` = gate, up), that one's digest is reported under the pushed names joined by
``digest.FUSED`` in the order the parameter holds them (the model's ``packed_modules_mapping``),
and the driver places each part by its sent shape; vocabulary padding rows are zeros, which add
nothing. On CPU, vLLM packs each linear layer's weight for its GEMM kernel (oneDNN, or
sgl's AMX packing) and frees the parameter (it becomes an empty tensor): such a weight is read
back through the layer's own kernel, ``cpu_linear(I) = W^T`` for an identity ``I``, a block of
columns at a time, each digested where it sits in ``W`` (exact: every
output element is one weight times 1 plus exact zeros; the one value that does not survive is a
-0.0 weight, read back as +0.0). A slot is ``max_lora_rank`` wide: lora_B's first ``r`` columns
(the adapter's rank, from vLLM's copy of the adapter) are digested as the sent ``[out, r]``
tensor, the rest where zeros add nothing and anything else shows; lora_A's rows past ``r`` are
zeros after its end. A PEFT module vLLM splits over several slices (one fused qkv adapter on a
3-slice layer) is read back slice by slice, lora_B's rows each at their place, lora_A (which
every slice repeats) once. LoRA: vLLM merges the scale into lora_B as it loads an adapter
(``lora_b *= lora_alpha / r``), so lora_B is read back as ``held / scale``, exact when the scale
is a power of two (1, 2, 0.5, ...). For any other scale ``B`` cannot be recovered bit for bit
from ``fl(B * scale)`` (about 15% of the elements differ by one ulp); there the worker checks
instead that its slot holds bit for bit what vLLM's loading makes of the adapter file's lora_B
(``B.to(lora dtype) *= scale``, zeros around it) and reports that file tensor's digest if so,
``held / scale`` if not (which then differs from the sent one). Without the file (an adapter
path not given) lora_B is left out of the report there. vLLM holds LoRA weights in the model's
dtype (``lora_dtype`` is auto, float16 or bfloat16): a bfloat16 engine's adapter is reported
as bfloat16 values converted to the dtype asked, so ask for "bfloat16" (digests of the sent
tensors cast to it) there. Only linear layers' LoRA is read back (what ``llm.lora`` may target);
an adapter vLLM no longer holds (evicted from its CPU cache) is not reported.

This module imports nothing of gdpo-ray but ``gdpo_ray.weights.digest`` (where digests are
taken, lazily): the engine processes only need the repository on ``sys.path``.
"""

from __future__ import annotations


import logging
import math
from typing import Any

from gdpo_ray.lora import is_adapter_tensor

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
PROBE_BYTES = 64 << 20  # the identity rows fed through a packed CPU linear at a time
MOD = 1 << 64  # digests are sums mod 2**64 (gdpo_ray.weights.digest.MOD)


class _RotaryIsComputed(logging.Filter):
    """vLLM's layer-wise reload warns at every push that RotaryEmbedding "failed to load"
    weights: its cos/sin cache is computed, no checkpoint holds it, and vLLM puts it back."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


def quiet_rotary_reload_warning() -> None:
    """Installs the filter above once in this process (the process of vLLM's worker)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryIsComputed) for f in logger.filters):
        logger.addFilter(_RotaryIsComputed())


class WeightsFromFile:
    """Mixed into vLLM's worker: ``self`` is the worker (``reload_weights`` is its method)."""

    def reload_from_file(self, path: str) -> int:
        """Loads every tensor of the safetensors file ``path``; returns how many."""
        from safetensors.torch import load_file

        quiet_rotary_reload_warning()
        weights = load_file(path)
        self.reload_weights(weights_iterator=list(weights.items()))
        return len(weights)

    def gdpo_weight_digests(self, sent: dict[str, str], lora_id: int | None = None,
                            lora_scale: float = 1.0, lora_path: str | None = None) -> dict[str, int]:
        """The digest of what this worker holds of each pushed tensor (``sent``: name -> the
        dtype it was sent in), read back from the model (full weights) and, for the LoRA names,
        from adapter ``lora_id``'s slot in vLLM's LoRA layers (``lora_scale``: lora_alpha / r,
        which vLLM merged into lora_B; ``lora_path``: the adapter's directory, for a scale
        that is no power of two). See the module docstring."""
        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        full = {n: d for n, d in sent.items() if not is_adapter_tensor(n)}
        held = param_digests(model, full) if full else {}
        lora = {n: d for n, d in sent.items() if is_adapter_tensor(n)}
        if lora and lora_id is not None:
            held.update(lora_digests(self.model_runner.lora_manager, model, lora_id, lora_scale, lora,
                                     lora_path))
        return held


def param_digests(model: Any, sent: dict[str, str]) -> dict[str, int]:
    """Per parameter of ``model`` that holds pushed tensors: its digest under their names
    (joined by FUSED where several were stacked into it)."""
    from gdpo_ray.weights.digest import FUSED, digest_as

    params = {name.replace(".base_layer.", "."): (name, p)
              for name, p in model.named_parameters(remove_duplicate=False)}
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in sent:
        found = vllm_param_name(model, name, params)
        if found is not None:
            target, place = found
            groups.setdefault(target, []).append((place, name))
    held = {}
    for target, placed in groups.items():
        names = [name for _, name in sorted(placed)]  # as the parameter holds them: q, k, v
        full_name, p = params[target]
        held[FUSED.join(names)] = held_digest(model, full_name, p, sent[names[0]], digest_as)
    return held


def vllm_param_name(model: Any, name: str, params: dict) -> tuple[str, int] | None:
    """(the name of the vLLM parameter that holds checkpoint tensor ``name``, from the model's
    ``hf_to_vllm_mapper``, then its ``packed_modules_mapping``; the place of ``name`` among the
    tensors packed into it, by that mapping: q, k, v = 0, 1, 2), or None where it holds none."""
    place = packed_place(model, name)
    if name in params:
        return name, 0
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapped = (mapper.map_name if hasattr(mapper, "map_name") else mapper._map_name)(name)
        if mapped is None:
            return None
        if mapped in params:
            return mapped, place
        name = mapped
    for packed, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for part in parts:
            candidate = name.replace(f".{part}.", f".{packed}.", 1)
            if candidate != name and candidate in params:
                return candidate, place
    return None


def packed_place(model: Any, name: str) -> int:
    """The index of checkpoint tensor ``name``'s module among those vLLM packs into one
    parameter (the model's ``packed_modules_mapping``, in the order the parameter holds them:
    the order its LoRA slices follow too); 0 for a module packed with none."""
    for parts in (getattr(model, "packed_modules_mapping", None) or {}).values():
        for place, part in enumerate(parts):
            if f".{part}." in name:
                return place
    return 0


def held_digest(model: Any, full_name: str, param: Any, dtype: str, digest_as: Any) -> int:
    """A parameter's digest as ``dtype``; a CPU linear weight vLLM packed (and emptied) is read
    back through the layer's kernel, a block of columns at a time (module docstring)."""
    if param.numel() > 0 or not full_name.endswith(".weight"):
        return digest_as(param.data, dtype)
    layer = model.get_submodule(full_name.rpartition(".")[0])
    if not hasattr(layer, "cpu_linear"):
        raise RuntimeError(f"vLLM holds {full_name} as an empty tensor and no CPU kernel to read it from")
    import torch

    k = layer.input_size_per_partition
    kind = getattr(layer, "params_dtype", param.dtype)
    rows = max(1, PROBE_BYTES // (k * torch.empty(0, dtype=kind).element_size()))
    total = 0
    with torch.no_grad():
        for start in range(0, k, rows):
            n = min(rows, k - start)
            probe = torch.zeros(n, k, dtype=kind)
            probe[torch.arange(n), torch.arange(start, start + n)] = 1
            columns = layer.cpu_linear(probe, layer.weight, None).t()  # = W[:, start:start+n]
            total += digest_as(columns, dtype, start, k)  # where those columns sit in W
    return total % MOD


def lora_digests(worker_manager: Any, model: Any, lora_id: int, scale: float,
                 sent: dict[str, str], path: str | None = None) -> dict[str, int]:
    """Adapter ``lora_id``'s LoRA weights as its slot in vLLM's LoRA layers holds them (the
    adapter activated into a slot first where it is not in one), per pushed PEFT name; a slot
    holding non-zero weights no pushed name covers is reported under its PEFT name (so the
    comparison flags it). lora_B: ``held / scale`` where ``scale`` is a power of two, else
    checked against the adapter file at ``path`` (module docstring)."""
    import torch

    from gdpo_ray.weights.digest import digest_as
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = worker_manager._adapter_manager
    if lora_id not in manager.list_adapters():
        return {}
    if lora_id not in manager.lora_index_to_id:
        manager.activate_adapter(lora_id)
    slot = manager.lora_index_to_id.index(lora_id)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()  # as vLLM's LoRA loader maps adapter names
    wanted = {}
    for name in sent:
        try:
            wanted[parse_fine_tuned_lora_name(name, mapper)] = name
        except ValueError:
            continue
    exact_b = math.frexp(scale)[0] == 0.5  # a power of two: held / scale is exact
    adapter = manager.list_adapters().get(lora_id)
    held: dict[str, int] = {}
    b_rows: dict[str, int] = {}  # lora_B rows read back so far (a module over several slices)
    for module_name, module in manager.modules.items():
        a_stacked, b_stacked = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if not isinstance(a_stacked, (tuple, list)) or not isinstance(b_stacked, (tuple, list)):
            continue  # embedding / logits LoRA layers: not read back (module docstring)
        parts = manager.packed_modules.get(module_name, [module_name])
        if len(parts) != len(a_stacked):
            parts = [module_name] * len(a_stacked)
        ranks = adapter_ranks(manager, adapter, module_name, len(a_stacked))
        for part, a, b, rank in zip(parts, a_stacked, b_stacked, ranks):
            for is_a, tensor in ((True, a[slot]), (False, b[slot])):
                name = wanted.get((part, is_a))
                if name is None:  # no pushed tensor is held here: it must hold zeros
                    if bool(torch.any(tensor != 0)):
                        name = f"base_model.model.{part}.lora_{'A' if is_a else 'B'}.weight"
                        kind = str(tensor.dtype).removeprefix("torch.")
                        held[name] = (held.get(name, 0) + digest_as(tensor, kind)) % MOD
                    continue
                if is_a:  # [1, max_rank, in]: rows past the rank are zeros past A's end
                    if name not in held:  # every slice of one module repeats its A
                        held[name] = digest_as(tensor, sent[name])
                    continue
                if exact_b:
                    tensor = tensor / scale if scale != 1 else tensor
                elif path is None:
                    continue
                else:
                    tensor = scaled_back(tensor, scale, name, path)
                first = b_rows.get(name, 0)
                b_rows[name] = first + tensor.shape[-2]
                held[name] = (held.get(name, 0) + b_digest(tensor, rank, sent[name], first, digest_as)) % MOD
    return held


PADDING_AT = 1 << 60  # where a slot's columns past the rank are digested: beyond any tensor's end


def adapter_ranks(manager: Any, adapter: Any, module_name: str, count: int) -> list[int | None]:
    """The rank of each of a LoRA module's ``count`` slices in vLLM's copy of ``adapter`` (its
    lora_A's rows), None where vLLM holds none or it is not known (a slot then counts as the
    adapter's own width)."""
    find = getattr(manager, "_get_lora_layer_weights", None)
    weights = None if adapter is None else (find(adapter, module_name) if find else adapter.get_lora(module_name))
    a = getattr(weights, "lora_a", None)
    a = list(a) if isinstance(a, (list, tuple)) else [a] * count
    ranks = [None if t is None else int(t.shape[0]) for t in a]
    return ranks if len(ranks) == count else [None] * count


def b_digest(tensor: Any, rank: int | None, dtype: str, first_row: int, digest_as: Any) -> int:
    """lora_B as sent (``[out, rank]``; its rows from ``first_row`` on, for one of several
    slices) from a slot ``[1, out, max_rank]`` (or the adapter file's ``[out, rank]``): the
    first ``rank`` columns where they sit in the sent tensor, the columns past them where zeros
    add nothing and anything else changes the digest."""
    width = tensor.shape[-1]
    rank = width if rank is None or rank > width else rank
    rows = tensor.reshape(-1, width)
    total = digest_as(rows[:, :rank], dtype, first_row * rank, rank)
    if rank < width:
        total += digest_as(rows[:, rank:], dtype, PADDING_AT + first_row * (width - rank), width - rank)
    return total % MOD


def scaled_back(held: Any, scale: float, name: str, path: str) -> Any:
    """lora_B ``name`` as pushed, for a scale that is no power of two: the adapter file's tensor
    (in the dtype vLLM holds it in) where ``held`` (a slot: [1, out, max_rank]) is bit for bit
    what vLLM's loading makes of it (``lora_b *= scale`` in that dtype, zeros around it), else
    ``held / scale`` (which then differs from what was sent)."""
    import os

    import torch
    from safetensors import safe_open

    with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as f:
        given = f.get_tensor(name).to(held.dtype) if name in f.keys() else None
    fits = given is not None and given.dim() == 2 and given.shape[0] <= held.shape[-2] \
        and given.shape[1] <= held.shape[-1]
    if fits:
        scaled = given.clone()
        scaled *= scale  # as vLLM's LoRALayerWeights.optimize does
        expected = torch.zeros_like(held)
        expected[..., :given.shape[0], :given.shape[1]] = scaled
        if torch.equal(_bits(expected), _bits(held)):
            return given
    return held / scale


def _bits(tensor: Any) -> Any:
    """The tensor's bit patterns as integers of its width (a bitwise comparison: -0.0 != 0.0)."""
    import torch

    return tensor.contiguous().view(getattr(torch, f"int{8 * tensor.element_size()}"))
