"""The HF transformers engine: the CPU default, also one GPU; it decodes with its own loop
(``actors.hf_decode``: a prompt prefilled once for its n samples, one random number per token).

With ``llm.lora`` the model is wrapped in PEFT's LoRA layers, as the learners' is (the same
targets, names and scaling), and the pushed adapter tensors go into them; each layer's adapter
is then merged into its base layer's weight, W = W0 + PEFT's delta, always from the pristine W0
(kept aside), so that pushes never accumulate rounding. Generation runs on the plain model: each
LoRA layer is swapped out of the module tree for its base layer, at the plain model's speed. The merged model computes the learners'
function up to float rounding (the order of a sum), as any engine does. Before the first push
the adapter's B matrices are zero: the engine computes the base model, as a fresh adapter does.
Attestation reads back the adapter tensors the engine holds, and reports a layer's only if its
weight is their merge (a load that did not merge is caught)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from actors.engines import EngineTraits, Sample, SamplingParams
from actors.kv_store import KVStore, plain_cache
from gdpo_ray.causal_lm import new_cache

ADAPTER = "default"  # PEFT's name of the one adapter


class HFEngine:
    """A transformers model decoded by ``actors.hf_decode`` on CPU (or one GPU), an
    ``actors.engines.BatchEngine``; any min-p/top-k/top-p, its logprobs those of the truncated
    distribution or (``truncated_logprobs`` off) of the full one."""

    weight_transfer = False  # weights arrive by load_weights (object store, gloo or NCCL buckets)
    traits = EngineTraits(exact_dtype=True, default_dtype="float32", model_logits=True, kv_reuse=True,
                          digests_by_name=True, shares_module=True)

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        pass

    def sleep(self) -> None:
        pass  # its weights stay where they are

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass  # nothing outlives the actor

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0, lora: Mapping[str, Any] | None = None, model: Any = None) -> None:
        """``model``: a module already built, whose weights this engine shares and never loads
        into, on its own device, in its own mode outside ``generate`` (a learner's module, with
        its LoRA layers if it has them: ``generation.engine_in_learner``); ``dtype``, ``device``
        and ``lora`` are then its own."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.shared = model is not None
        if self.shared:
            self.model, self.lora = model, None
            device = next(model.parameters()).device
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
            self.lora = lora or None
        if self.lora:
            from peft import get_peft_model

            from gdpo_ray.lora import peft_config

            torch.manual_seed(seed)  # the adapter's A matrices (B is zero until the first push)
            peft_model = get_peft_model(self.model, peft_config(self.lora))
            self._layers = _lora_layers(peft_model)
            self._adapter = _adapter_tensors(self._layers)
            for name, (layer, _) in self._layers.items():  # generation sees plain layers
                parent, _, child = name.rpartition(".")
                setattr(peft_model.get_submodule(parent), child, layer.base_layer)
            self.model = peft_model.get_base_model()
            self._merge(self._layers)
        if not self.shared:
            self.model.to(device).eval()
        self.device = device
        self.eos_ids = _eos_ids(self.model.generation_config.eos_token_id, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._calls = 0
        self._seed = seed
        self.kv = KVStore()  # rows' KV kept across a rollout's turns (actors.kv_store)
        self.reuse_kv = plain_cache(new_cache(self.model))  # False: every turn prefills its whole context

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True, keys: list | None = None) -> list[list[Sample]]:
        """(``logprobs`` is for the contract: this engine always records them.) ``keys``: per
        sample (prompt-major), the rollout it continues, or None: a sample's KV is kept under its
        key, and a prompt whose key kept KV before prefills only what follows it (``kv_reuse``,
        ``actors.kv_store``; ``release`` forgets them)."""
        from actors.hf_decode import decode

        self._calls += 1
        self.generator.manual_seed(self._seed * 1_000_003 + self._calls)
        keys = keys if self.reuse_kv and keys is not None and any(k is not None for k in keys) else None
        if keys is not None and n > 1 and any(k in self.kv for k in keys):  # each sample its own KV
            flat = self.generate([p for p in prompt_token_ids for _ in range(n)], 1, sampling, logprobs, keys)
            return [[group[0] for group in flat[i * n:(i + 1) * n]] for i in range(len(prompt_token_ids))]
        reused = None
        if keys is not None and n == 1:
            reused = [None if k is None else self.kv.take(k, p) for k, p in zip(keys, prompt_token_ids)]
            self.kv.reused_tokens += sum(r[0] for r in reused if r is not None)
        self.kv.prefilled_tokens += sum(map(len, prompt_token_ids)) - sum(r[0] for r in reused or [] if r)
        kept = [] if keys is not None else None
        training = self.model.training  # a shared module may be in training mode (dropout)
        self.model.eval()
        try:
            rows = decode(self.model, prompt_token_ids, n, temperature=sampling.temperature,
                          truncation=sampling.truncation, truncated_logprobs=sampling.truncated_logprobs,
                          max_tokens=sampling.max_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                          generator=self.generator, stop_check=self._stop_check(sampling.stop),
                          reused=reused, kept=kept)
        finally:
            self.model.train(training)
        for key, (tokens, kv) in zip(keys or [], kept or []):
            if key is not None:
                self.kv.put(key, tokens, kv)
        samples = []
        for tokens, lps, reason in rows:
            end = _stop_string_end(self.tokenizer, tokens.tolist(), sampling.stop) if sampling.stop else None
            if end is not None:
                tokens, lps, reason = tokens[:end], lps[:end], "stop"
            samples.append(Sample(tokens.tolist(), lps.tolist(), reason))
        return [samples[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]

    def _stop_check(self, stop: tuple[str, ...]):
        """Whether a row's tokens so far hold a stop string: its last tokens' text is looked at
        (four tokens per character of the longest, for byte-level pieces), then the whole."""
        if not stop:
            return None
        window = 4 * max(len(s) for s in stop) + 4
        decode = self.tokenizer.decode

        def check(tokens: list[int]) -> bool:
            return any(s in decode(tokens[-window:]) for s in stop) and any(s in decode(tokens) for s in stop)

        return check

    def release(self, keys: Iterable[Any]) -> None:
        """Forget the KV kept for these rollouts (they ended)."""
        self.kv.release(keys)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """New weights by reference, never written in place: a tensor already on the right
        device with the right dtype becomes the parameter's storage as it is (zero-copy: for a
        push through the object store, the read-only shared-memory buffer, which generation only
        reads); anything else is converted into fresh memory. With LoRA: the adapter's tensors,
        under the names PEFT saves them with. An engine that shares its module takes none: the
        module is the sender's (an empty load only forgets the KV of the old weights)."""
        import warnings

        named_tensors = list(named_tensors)
        if self.shared and named_tensors:
            raise ValueError("this engine shares its module's weights (generation.engine_in_learner): "
                             "nothing is loaded into it")

        self.kv.clear()  # KV of the old weights
        params = self._held()
        with self.torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # as_tensor of a read-only buffer
            touched = set()
            for name, tensor in named_tensors:
                if name not in params:
                    raise ValueError(f"the model has no {'adapter tensor' if self.lora else 'parameter'} "
                                     f"{name!r}" + (" (is llm.lora the learners'?)" if self.lora else ""))
                target, source = params[name], self.torch.as_tensor(tensor)
                if tuple(source.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: shape {tuple(source.shape)} does not match the "
                                     f"model's {tuple(target.shape)}")
                if source.device == target.device and source.dtype == target.dtype:
                    target.data = source
                else:
                    target.data = source.to(device=target.device, dtype=target.dtype)
                touched.add(name.rpartition(".lora_")[0])
            if self.lora:
                self._merge(touched)

    def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        """The digest of every pushed tensor as the model holds it (``BatchEngine``)."""
        from gdpo_ray.weights.digest import digest_as

        params = self._held()
        if self.lora:  # a layer whose weight is not the merge of its adapter reports nothing of it
            layers = {n.rpartition(".lora_")[0] for n in sent} & self._layers.keys()  # those asked of
            stale = {name for name in layers if not self.torch.equal(
                self._layers[name][0].base_layer.weight, self._merged(name))}
            params = {n: p for n, p in params.items() if n.rpartition(".lora_")[0] not in stale}
        return {name: digest_as(params[name].data, dtype) for name, dtype in sent.items() if name in params}

    def _merged(self, name: str):
        """Layer ``name``'s weight with its adapter merged: W0 + PEFT's delta."""
        layer, base = self._layers[name]
        return base + layer.get_delta_weight(ADAPTER)

    def _merge(self, names: Iterable[str]) -> None:
        """The adapter of these layers merged into their (base layers') weights."""
        for name in names:
            self._layers[name][0].base_layer.weight.data = self._merged(name)

    def _held(self) -> dict[str, Any]:
        """The tensors a push replaces, by the names it sends: every state-dict entry (tied
        weights under both names), or with LoRA the adapter's, under PEFT's saved names."""
        return self._adapter if self.lora else self.model.state_dict(keep_vars=True)


def _lora_layers(model) -> dict[str, tuple[Any, Any]]:
    """Each LoRA layer by its module name (the prefix of its adapter tensors' names), with a
    copy of its base weight W0."""
    from peft.tuners.lora import LoraLayer

    return {name: (module, module.base_layer.weight.detach().clone())
            for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _adapter_tensors(layers: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The LoRA layers' adapter tensors under the names PEFT saves them with."""
    from gdpo_ray.lora import adapter_key, is_adapter_tensor

    return {adapter_key(f"{name}.{tensor}"): value for name, (layer, _) in layers.items()
            for tensor, value in layer.named_parameters() if is_adapter_tensor(f"{name}.{tensor}")}


def _eos_ids(configured: Any, tokenizer: Any) -> list[int]:
    ids = configured if isinstance(configured, list) else [configured]
    ids = [i for i in ids if i is not None]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no EOS token id (generation_config or tokenizer)")
    return ids


def _stop_string_end(tokenizer: Any, tokens: list[int], stop: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of ``tokens`` whose text contains a stop string, or None."""
    if not stop or not any(s in tokenizer.decode(tokens) for s in stop):
        return None
    lo, hi = 1, len(tokens)  # containment only grows with the prefix: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(tokens[:mid]) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    return lo
