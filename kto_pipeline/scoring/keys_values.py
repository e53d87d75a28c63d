"""Training's key/value cache: the prompts' keys/values kept from the first forward for the KL completions' forward
(`scoring.logprobs.score_policy`), as transformers' `DynamicCache` where the layers run eagerly, as a
`KeptKeysValues` where they are compiled by region (`runtime/compiled.py`'s docstring: a graph that wrote into a
`DynamicCache` at its layer index would be one graph per layer). `keeping_keys_values` wraps each compiled layer's
call (training's `compile_layers(..., wrap_layer=keeping_keys_values)`) to file what the layer hands out.
"""

from __future__ import annotations

from kto_pipeline.models import COMPILED_LAYERS, decoder_body


class KeptKeysValues:
    """Training's key/value cache where the decoder layers are compiled (`keys_values_cache`), read by
    `score_policy` as a `DynamicCache` (`layers[i].keys`, `.values`; `get_seq_length`).

    A layer's `update(keys, values, layer_idx)` ignores its index: a graph that used it would be one graph per layer.
    In the first forward it hands the keys and values out (`latest`: outputs of the graph) and returns them; its
    call's wrapper (`keeping_keys_values`, outside the graph) files them as that layer's. In a later forward the
    wrapper hands the layer its own first (`past`), and `update` returns them followed by the new tokens', as
    DynamicCache does. Where the layers are not called once each, in order, each calling `update` once, it keeps
    nothing (`get_seq_length` 0: the KL completions then run with their prompts again)."""

    def __init__(self):
        self.layers: list[_Kept] = []
        self.latest: tuple | None = None  # the keys and values the last layer call handed out
        self.past: _Kept | None = None  # the keys and values of the layer being called, in a later forward
        self.unusable = False  # a layer called out of order, or without an update: nothing kept (never guessed)
        self.closed = False  # after the KL forward (`close_keys_values`)

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        import torch

        if self.closed:
            return key_states, value_states
        if self.past is not None:
            return (
                torch.cat([self.past.keys, key_states], dim=-2),
                torch.cat([self.past.values, value_states], dim=-2),
            )
        self.latest = (key_states.detach(), value_states.detach())  # read without gradients
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].keys.shape[-2] if self.layers else 0

    def close(self) -> None:
        """Nothing kept from now on, nothing read: a layer recomputed in the backward gets its keys/values back."""
        self.layers, self.closed = [], True


class _Kept:
    """A layer's kept keys and values (as a DynamicCache layer holds them)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def keys_values_cache(model):
    """The key/value cache training's first forward keeps for the KL forward: a `KeptKeysValues` where the layers
    are compiled by region (their calls file it), else transformers' `DynamicCache`."""
    if getattr(decoder_body(model), COMPILED_LAYERS, False):
        return KeptKeysValues()
    from transformers import DynamicCache

    return DynamicCache()


def close_keys_values(cache) -> None:
    """After training's KL forward: `cache` drops the keys/values it kept, and from then on hands a layer that calls
    its `update` (a layer recomputed in the backward under gradient checkpointing, which takes the cache along) its
    keys/values back as they are, as the first forward's call returned them: nothing filed twice, nothing read."""
    if isinstance(cache, KeptKeysValues):
        cache.close()
    else:  # transformers' DynamicCache: its `update(..., layer_idx)` is its layer's
        cache.layers = [_HandedBack() for _ in cache.layers]


class _HandedBack:
    """A closed cache's layer: keeps nothing, hands the keys and values back."""

    keys = values = None

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states


def keeping_keys_values(call, index: int):
    """Layer `index`'s call, filing the keys and values it hands a `KeptKeysValues` (a first forward), or handing
    it its own first (a later forward), outside the compiled graph."""

    def call_keeping(*args, **kwargs):
        kept = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(kept, KeptKeysValues):
            return call(*args, **kwargs)
        kept.past = kept.layers[index] if index < len(kept.layers) else None
        try:
            out = call(*args, **kwargs)
            if kept.past is None and not kept.unusable:
                if kept.latest is None or index != len(kept.layers):  # not one update a layer, in order
                    kept.unusable, kept.layers = True, []  # keeps nothing: the KL completions run with their prompts
                else:
                    kept.layers.append(_Kept(*kept.latest))
        finally:
            kept.past = kept.latest = None
        return out

    return call_keeping
