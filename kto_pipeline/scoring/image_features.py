"""Images in the scorer (vision-language models): their tensors joined in the order a forward meets them, and their
features placed at their image tokens before the language model runs.

The scorer runs a vision-language model's language model as it runs a causal LM's backbone (packed layouts, tree
masks, chunked head): `token_inputs` hands it embeddings in which each image's features already sit in the places of
its image tokens, computed by the model's own vision tower and projector (`get_image_features`) and placed by its
own rule (`get_placeholder_mask`, or Idefics3's `inputs_merger`). Attention settings are set on the text config
only (`attention.attending_with`), so the vision tower attends as it always does.
"""

from __future__ import annotations

import torch

from kto_pipeline.models import backbone_of


def token_inputs(model, input_ids: torch.Tensor, images: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """What the backbone takes for `input_ids`: the ids themselves, or, with `images` (a vision-language model), their
    embeddings with each image's features in the places of its image tokens, in order. The vision tower and projector
    run here, once per image, and never see the language model's attention settings (packed layouts, tree masks):
    the backbone then runs from the embeddings, as it would after merging them itself."""
    if images is None:
        return {"input_ids": input_ids}
    backbone = backbone_of(model)
    embeds = backbone.get_input_embeddings()(input_ids)
    features = backbone.get_image_features(**images, return_dict=True).pooler_output
    features = torch.cat(list(features), dim=0).to(embeds.device, embeds.dtype)
    if hasattr(backbone, "get_placeholder_mask"):  # LLaVA, Qwen2-VL, Gemma 3, ...
        where = backbone.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
        return {"inputs_embeds": embeds.masked_scatter(where, features)}
    return {"inputs_embeds": backbone.inputs_merger(input_ids, embeds, features)}  # Idefics3, SmolVLM


def join_images(parts: list[dict[str, torch.Tensor]], device=None) -> dict[str, torch.Tensor] | None:
    """The image tensors of several prompts (or sequences) in order, one forward's: each name's tensors joined along
    dim 0 (one entry per image). None when none has an image."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    return {name: torch.cat([p[name] for p in parts]).to(device) for name in parts[0]}
