"""Tiny vision-language models and their processors, built deterministically on this machine (no download).

The package index serves no small VLM's weights, so vision tests build them here from a config: the character
tokenizer of `tiny.py` with the family's image tokens added and a chat template that renders trl's
`{"type": "image"}` message parts as the image token, an image processor that needs no torchvision, and a
randomly initialised model seeded as `tiny.build_tiny_model` is.

    llava     LLaVA: a CLIP vision tower, a projector and a Llama; a 32 x 32 image becomes 16 image tokens
    idefics3  Idefics3 (SmolVLM's family): a SigLIP-style tower, pixel shuffle and a Llama; 4 image tokens

`save_tiny_vlm(kind, directory)` writes model and processor as `from_pretrained` reads them (AutoProcessor and
AutoModelForImageTextToText); `toy_images` makes seeded RGB images of varied sizes.
"""

from __future__ import annotations

from pathlib import Path

from kto_pipeline.demo.tiny import build_char_tokenizer

# trl's message parts: {"type": "image"} renders as the family's image token, {"type": "text"} as its text
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIZE, PATCH_SIZE = 32, 8  # (32 / 8)^2 = 16 patches
IMAGE_TOKENS = {"llava": ["<image>"], "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>"]}
KINDS = tuple(IMAGE_TOKENS)


def build_vision_tokenizer(kind: str):
    """`tiny.build_char_tokenizer` with `kind`'s image tokens added (after the characters) and the vision template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS[kind]})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm(kind: str, hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """(model, processor) of `kind` ("llava" or "idefics3"), float32, seeded."""
    import torch

    if kind not in IMAGE_TOKENS:
        raise ValueError(f"tiny VLM {kind!r}: expected one of {', '.join(KINDS)}")
    tokenizer = build_vision_tokenizer(kind)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    vision = dict(hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=num_layers)
    vision |= dict(num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    if kind == "llava":
        from transformers import (
            CLIPVisionConfig,
            LlamaConfig,
            LlavaConfig,
            LlavaForConditionalGeneration,
            LlavaProcessor,
        )

        tokens = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLIP adds a CLS feature, the default strategy drops it
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**vision, projection_dim=hidden_size),
            text_config=LlamaConfig(**text),
            image_token_index=image_token,
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
            image_seq_length=tokens,
        )
        size = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        processor = LlavaProcessor(
            image_processor=_pil_image_processor("CLIPImageProcessor")(**size, do_center_crop=True, do_resize=True),
            tokenizer=tokenizer,
            chat_template=VISION_CHAT_TEMPLATE,
            patch_size=PATCH_SIZE,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
        model = LlavaForConditionalGeneration(config)
    else:
        from transformers import (
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3Processor,
        )

        scale = 2  # pixel shuffle: 16 patches -> 4 image tokens
        config = Idefics3Config(
            vision_config=vision,
            text_config=dict(text, model_type="llama"),
            scale_factor=scale,
            image_token_id=image_token,
            pad_token_id=tokenizer.pad_token_id,
        )
        edge = {"longest_edge": IMAGE_SIZE}
        processor = Idefics3Processor(
            image_processor=_pil_image_processor("Idefics3ImageProcessor")(
                do_image_splitting=False, size=edge, max_image_size=edge
            ),
            tokenizer=tokenizer,
            image_seq_len=(IMAGE_SIZE // PATCH_SIZE) ** 2 // scale**2,
            chat_template=VISION_CHAT_TEMPLATE,
        )
        model = Idefics3ForConditionalGeneration(config)
    return model.to(torch.float32), processor


def _pil_image_processor(name: str):
    """transformers' image processor `name` on PIL (no torchvision): `<name>Pil` in transformers 5, `name` before."""
    import transformers

    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)


def save_tiny_vlm(kind: str, directory: str | Path, **kwargs) -> Path:
    """Build `kind`'s tiny VLM and write model and processor to `directory` (from_pretrained reads them)."""
    directory = Path(directory)
    model, processor = build_tiny_vlm(kind, **kwargs)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def toy_images(count: int, seed: int = 0) -> list:
    """`count` seeded RGB PIL images of 24-48 pixels a side (the processors resize them)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = rng.integers(24, 49, size=(count, 2))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
