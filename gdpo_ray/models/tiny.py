"""A small causal LM and its tokenizer, created locally (no model hub), saved as a HF directory.

Used by the tests and the CPU demos: a byte-level BPE tokenizer trained on a small corpus, a
ChatML chat template, and a randomly initialised Qwen2 model. ``save_pretrained`` +
``from_pretrained`` of the directory exercise the same loading code as a hub model.

By default the tokenizer's merges are learnt on ``CORPUS`` cut into GPT-2's pieces. A task with
long prompts (the tool-calling demo's system message of JSON schemas) passes its own ``corpus``,
so its words become single tokens, ``QWEN2_PATTERN`` (the pieces the loaded tokenizer cuts) and
its tags as ``added_tokens``, so that a prompt takes few tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

#: its context length (the demo model, warm-started from it, has the same)
MAX_POSITIONS = 1024

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the pieces transformers (5) cuts a qwen2 model's text into before BPE, whatever tokenizer.json
#: says (``Qwen2Tokenizer`` rebuilds its pre-tokenizer): train a tokenizer's merges on these pieces
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CORPUS = [
    "<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "The answer is ",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ( )", "What is 3 + 4? Add the numbers.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"\n",
    "user assistant system", "Let me think step by step.",
]


def build_tiny_model(path: str | Path, *, hidden_size: int = 64, layers: int = 2,
                     vocab_size: int = 384, seed: int = 0, corpus: list[str] | None = None,
                     pattern: str | None = None, added_tokens: list[str] = ()) -> Path:
    """Writes tokenizer + model to ``path`` (created) and returns it.

    ``corpus``: the tokenizer's training texts (default ``CORPUS``); ``vocab_size`` is an upper
    bound (a small corpus may have fewer merges; the model's vocabulary is the tokenizer's).
    ``pattern``: a regex whose matches are the pieces BPE merges within (text between matches
    is a piece too), instead of GPT-2's split at word boundaries. ``added_tokens``: strings that
    are one token each, wherever they occur (cut out of the corpus before training)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    if pattern is None:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = CORPUS * 4 if corpus is None else corpus
    if added_tokens:  # the tokenizer cuts them out of a text first: train on what is left
        cut = re.compile("|".join(re.escape(t) for t in added_tokens))
        texts = [piece for text in texts for piece in cut.split(text) if piece]
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", bos_token=None,
                                        padding_side="left")
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        # head_dim 32: the smallest that vLLM's CPU attention kernels accept
        num_hidden_layers=layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    return path
