"""The tiny vision-language models the vision tests build (no download): each family's processor and model
written and read back offline, the image placeholder expanded to the model's image tokens, a finite forward, the
same weights from the same seed."""

import pytest
import torch

from kto_pipeline.demo.tiny_vision import KINDS, build_tiny_vlm, save_tiny_vlm, toy_images

IMAGE_TOKENS = {"llava": 16, "idefics3": 4}  # a 32 x 32 image in 8 x 8 patches; Idefics3's pixel shuffle by 2


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_vlm_reads_back_offline_and_expands_its_image_tokens(kind, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    directory = save_tiny_vlm(kind, tmp_path / kind)
    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    image_token = model.config.image_token_id
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    assert text.count("<image>") == 1 and text.endswith("A cat.<|im_end|>\n")
    batch = processor(images=[toy_images(1)], text=[text], return_tensors="pt")
    assert int((batch["input_ids"] == image_token).sum()) == IMAGE_TOKENS[kind]
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    again, _ = build_tiny_vlm(kind)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_toy_images_are_seeded_rgb_of_varied_sizes():
    first, second = toy_images(4, seed=1), toy_images(4, seed=1)
    assert [im.tobytes() for im in first] == [im.tobytes() for im in second]
    assert all(im.mode == "RGB" for im in first) and len({im.size for im in first}) > 1
    with pytest.raises(ValueError, match="expected one of llava, idefics3"):
        build_tiny_vlm("qwen2-vl")
