"""A tiny model and tokenizer built deterministically on this machine, for the demo and the tests.

No download: the tokenizer is character-level (printable ASCII, newline, tab) with ChatML-style
special tokens and a chat template, and the model is a 2-layer Llama initialised from a seed.
"""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def build_char_tokenizer(vocab_size: int | None = None):
    """A lossless character-level fast tokenizer with `eos_token = <|im_end|>` and a chat template.

    `vocab_size` pads the vocabulary with unused entries (`<unusedN>`), so that a model built for it has the
    embedding and LM head of a real model's vocabulary (the benchmarks)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    entries = SPECIAL_TOKENS + chars
    entries += [f"<unused{i}>" for i in range((vocab_size or 0) - len(entries))]
    vocab = {tok: i for i, tok in enumerate(entries)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token=None,
        eos_token="<|im_end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, **overrides):
    """A randomly initialised Llama causal LM sized for CPU tests (seeded, so always the same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**(settings | overrides))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(torch.float32)


def ensure_tiny_model(path: str | Path, **kwargs) -> Path:
    """Build and save the tiny model + tokenizer at `path` unless it is already there."""
    path = Path(path)
    if not (path / "config.json").exists():
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, **kwargs)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path
