"""Which models can run packed layouts, and the packing check's verdict a cache records."""

from __future__ import annotations

import functools
import inspect
import re

import torch

from kto_pipeline.models import backbone_or_none, decoder_body, text_config
from kto_pipeline.scoring.attention import layer_reaches


def packing_unsupported(model) -> str | None:
    """Why this model cannot run packed layouts (so the padded path runs instead), or None if it can.

    The 4-D mask is handed to the attention as is, which transformers' `sdpa` and `eager` attention
    take; flash-attention kernels take no arbitrary mask. Models that mix layer types (full, sliding-window,
    chunked) take a mask per type where their backbone hands each layer the mask of its type; models without
    position ids (ALiBi) would see wrong distances."""
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    config = text_config(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no custom 4-D mask (sdpa or eager attention would pack)"
    layer_types = getattr(config, "layer_types", None)
    if (stateful := stateful_layers(model, layer_types)) is not None:
        return f"layers that carry state along the sequence ({stateful}): packed sequences would leak into each other"
    body = backbone_or_none(model)
    if len(set(layer_reaches(model).values())) > 1 and (body is None or not _takes_masks_by_type(type(body))):
        types = ", ".join(sorted(set(layer_types)))
        return f"layers of several attention types ({types}), and the backbone takes one mask for all of them"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rope") == "alibi":
        return "ALiBi attention biases ignore position ids"
    if body is None or "position_ids" not in inspect.signature(body.forward).parameters:
        return f"{type(model).__name__}'s backbone takes no position ids"
    if (layer := _scaled_by_column(body)) is not None:
        return (
            f"{layer} scales its queries by their column in the row (attn_temperature_tuning), "
            "which packing moves: packed sequences would be scaled otherwise"
        )
    return None


@functools.cache
def _takes_masks_by_type(backbone_class) -> bool:
    """Whether a backbone's forward takes its attention mask as a dict by layer type, handing each layer its own
    (transformers' models of several layer types: `if not isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    try:
        source = inspect.getsource(backbone_class.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"isinstance\((\w+\s*:=\s*)?attention_mask,\s*dict\)", source) is not None


def _scaled_by_column(body) -> str | None:
    """The first attention layer of `body` that scales its queries by the token's column in the row rather than its
    position (Llama 4's layers without rope, under `attn_temperature_tuning`), or None."""
    for module in body.modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            return f"{type(module).__name__} {module.layer_idx}"
    return None


# what the reference pass records (`unshared_because`) where its packed layout failed the packing check (a sequence
# scored packed differed from it scored alone): training then pads its batches too (`packing_leaked`)
PACKING_LEAKED = "a packed layout changed sequences' log-probs"


def packing_leaked(manifest) -> str | None:
    """Why the cache's reference pass found that packing leaks between sequences, or None."""
    why = manifest.get("reference_pass", {}).get("unshared_because") or ""
    return why if why.startswith(PACKING_LEAKED) else None


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# what a layer that carries state from token to token (an SSM, a convolution, linear attention) is named or holds
_STATEFUL_NAMES = ("Mamba", "Mixer", "DeltaNet", "ShortConv", "Recurrent", "Rwkv", "SSM", "LinearAttention")


def stateful_layers(model, layer_types=None) -> str | None:
    """What in `model`'s decoder layers carries state along the sequence, or None: the modules that hold a convolution
    over the sequence or are named for a state-space or recurrent mixer, else the layer types other than attention
    (`conv`, `linear_attention`, `hybrid`, `mamba`; a config declares them in some transformers versions, not in
    others, so the modules come first). Such a layer lets one sequence of a packed row reach the next."""
    try:
        layers = getattr(decoder_body(model), "layers", None) or [model]
    except ValueError:  # no backbone: the whole model
        layers = [model]
    classes = set()
    for layer in layers:
        for module in layer.modules():
            name = type(module).__name__
            if isinstance(module, torch.nn.Conv1d) or any(part in name for part in _STATEFUL_NAMES):
                classes.add(name)
    found = sorted(classes - {"Conv1d"}) or sorted(classes) or sorted(set(layer_types or ()) - ATTENTION_LAYER_TYPES)
    return ", ".join(found) if found else None
