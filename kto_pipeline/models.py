"""Loading models and tokenizers, shared by both stages and by `generate`.

A `--model` can be a hub id, a local Hugging Face directory, a saved PEFT adapter directory (its
base with the adapter merged in), or a single `.gguf` file (llama.cpp's format, dequantized to
float32 by transformers; the gguf package reads it). Every failure becomes one KTOPipelineError
that names the flag and says what to do; in particular a hub id on a machine without network
fails in seconds with the way out (a local directory), not after a minute of retries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import weakref
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.quantization import Quantization, one_product_in_eval_and_training


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def check_quantizable(name: str, flag: str, quantization: Quantization | None) -> None:
    """A checkpoint that is already quantized (GPTQ, AWQ, a GGUF file...) cannot be quantized again by bitsandbytes:
    refused before loading, naming what it holds."""
    if quantization is None:
        return
    if is_gguf(name):
        raise KTOPipelineError(
            f"{flag} {name}: a GGUF file is quantized by llama.cpp's own scheme; --load-in-{quantization.bits}bit "
            "quantizes a float checkpoint (this file loads dequantized without it)"
        )
    try:
        from transformers import AutoConfig

        existing = getattr(AutoConfig.from_pretrained(name), "quantization_config", None)
    except Exception:
        return  # loading will name the problem
    if existing:
        method = (
            existing.get("quant_method", "?") if isinstance(existing, dict) else getattr(existing, "quant_method", "?")
        )
        raise KTOPipelineError(
            f"{flag} {name}: the checkpoint is already quantized ({method}); --load-in-{quantization.bits}bit "
            "quantizes a float checkpoint: give its float original, or drop the option"
        )


def check_model_path(name: str, flag: str) -> None:
    path = Path(name).expanduser()
    # a hub id is `name` or `owner/name`: a trailing slash, or more than one, names a local path
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/") or is_gguf(name)
    if looks_local and not path.exists():
        what = "file" if is_gguf(name) else "directory"
        raise KTOPipelineError(f"{flag} {name}: no such {what}. Pass a local model directory or a hub id.")
    if is_gguf(name):
        if importlib.util.find_spec("gguf") is None:
            raise KTOPipelineError(
                f"{flag} {name}: reading GGUF files needs the gguf package: `pip install gguf` "
                "(or `pip install 'kto-pipeline[gguf]'`), or pass a Hugging Face model directory."
            )
        return
    if path.is_file():
        raise KTOPipelineError(
            f"{flag} {name}: a file, not a model directory. Pass the directory a model was saved in "
            "(save_pretrained: config.json and the weights), a hub id, or a .gguf file."
        )
    if path.exists() and not ((path / "config.json").exists() or (path / "adapter_config.json").exists()):
        raise KTOPipelineError(
            f"{flag} {name}: the directory has no config.json (nor adapter_config.json), so it is not a saved model."
        )
    if not path.exists():
        _check_hub_reachable(name, flag)


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not a valid repo id: transformers will say so
        return False


def _check_hub_reachable(name: str, flag: str) -> None:
    """A hub id needs the hub, unless its files are already in the local Hugging Face cache.

    Without this check transformers retries for about a minute before its own, less specific error.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or _in_hub_cache(name):
        return
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=5).close()
    except OSError as exc:
        raise KTOPipelineError(
            f"{flag} {name}: this looks like a hub id, but the Hugging Face Hub ({endpoint.hostname}) cannot be "
            f"reached ({exc.strerror or exc}) and the model is not in the local cache. On a machine with network, "
            f"`hf download {name} --local-dir DIR` (huggingface_hub's command line), copy DIR here and pass {flag} DIR."
        ) from None


def _adapter_dir(name: str) -> Path | None:
    """The directory if `name` is a saved PEFT adapter (adapter_config.json), else None."""
    path = Path(name).expanduser()
    return path if (path / "adapter_config.json").exists() else None


def _gguf_kwargs(name: str) -> tuple[str, dict[str, str]]:
    """(directory, {"gguf_file": file name}) for a .gguf path, as transformers wants them."""
    path = Path(name).expanduser().resolve()
    return str(path.parent), {"gguf_file": path.name}


def load_tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False, flag: str = "--model"):
    from transformers import AutoTokenizer

    check_model_path(name, flag)
    adapter = _adapter_dir(name)
    if adapter is not None and not (adapter / "tokenizer_config.json").exists():
        name = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    source, extra = _gguf_kwargs(name) if is_gguf(name) else (name, {})
    path = Path(name).expanduser()
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if path.is_dir() and not any((path / f).exists() for f in tokenizer_files):
        # asked before loading: some transformers versions make a tokenizer of a few tokens from the config alone
        raise KTOPipelineError(
            f"{flag} {name}: the directory has no tokenizer ({', '.join(tokenizer_files)}). Save the tokenizer "
            "beside the model (`tokenizer.save_pretrained(DIR)`)."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code, **extra
        )
    except Exception as exc:
        raise KTOPipelineError(f"{flag} {name}: could not load its tokenizer ({type(exc).__name__}: {exc})") from exc
    if is_gguf(name):
        _set_gguf_special_tokens(tokenizer, name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as trl does; padding is masked out anyway
    return tokenizer


GGUF_SPECIAL_TOKENS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


def _set_gguf_special_tokens(tokenizer, path: str) -> None:
    """The special tokens a .gguf file names (`tokenizer.ggml.<kind>_token_id`) set on its tokenizer: transformers 4
    converts some (SmolLM2's) with the beginning token as end and padding token too."""
    from gguf import GGUFReader

    fields = GGUFReader(str(Path(path).expanduser()), "r").fields
    for kind, attribute in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{kind}_token_id")
        if field is not None:
            token = tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))
            if token is not None and getattr(tokenizer, attribute) != token:
                setattr(tokenizer, attribute, token)


def _auto_class(name: str, revision: str | None, trust_remote_code: bool):
    """transformers' auto class for a checkpoint (`auto_class`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except Exception:
        return AutoModelForCausalLM  # its own error names the problem
    return auto_class(config)


def auto_class(config):
    """transformers' auto class for a model config: a vision-language model (its config has a vision part) is built
    with its image-text head, any other as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """A .gguf file as a plain transformers model.

    transformers dequantizes the tensors but flags the model as quantized, and such a model refuses
    `save_pretrained`; the same weights in a fresh model of the same class (its config without the
    quantization entry) train, save and load like any other.
    """
    from transformers import AutoModelForCausalLM

    source, extra = _gguf_kwargs(str(path))
    loaded = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype)


def load_model(
    name: str,
    dtype: torch.dtype,
    revision: str | None = None,
    trust_remote_code: bool = False,
    flag: str = "--model",
    quantization=None,
):
    """The model `name` in `dtype`; with `quantization` (`quantization.Quantization`) its linear layers quantized by
    bitsandbytes as they load (on the current accelerator where there is one), the rest in `dtype`."""
    check_model_path(name, flag)
    check_quantizable(name, flag, quantization)
    quantized = {}
    if quantization is not None:
        quantized = dict(quantization_config=quantization.transformers_config(), device_map=_kbit_device_map())
    try:
        if not quantized and is_gguf(name):
            return load_gguf_model(name, dtype)
        if not quantized and _adapter_dir(name) is not None:
            # A saved LoRA model (e.g. from a first KTO round): its base with the adapter merged in is the model.
            from peft import AutoPeftModelForCausalLM

            peft_model = AutoPeftModelForCausalLM.from_pretrained(
                name, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code
            )
            merged = peft_model.merge_and_unload()
            merged.requires_grad_(True)  # peft froze the base; a merged model trains like any other
            return merged
        model = _auto_class(name, revision, trust_remote_code).from_pretrained(
            name, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code, **quantized
        )
    except Exception as exc:
        raise KTOPipelineError(f"{flag} {name}: could not load the model ({type(exc).__name__}: {exc})") from exc
    if quantization is not None:
        one_product_in_eval_and_training(model)
    return model


def _kbit_device_map() -> dict[str, int | str] | None:
    """Where bitsandbytes quantizes the weights as they load: this process's accelerator (trl's
    `get_kbit_device_map`), the CPU without one."""
    if torch.cuda.is_available():
        from accelerate import PartialState

        return {"": PartialState().local_process_index}
    return None


# ------------------------------------------------------------------------------------------ probes


def text_config(model):
    """The config of a causal LM's text part (multimodal configs nest it)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def load_balancing_coef(model, asked: float | None) -> float:
    """A mixture-of-experts model's load-balancing weight, as trl's: `asked` (--router-aux-loss-coef), else its
    config's; 0 for a model that returns no router logits."""
    config = text_config(model)
    if not hasattr(config, "output_router_logits"):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) if asked is None else asked)


def checkpointing(model) -> bool:
    """Whether the model recomputes its layers in the backward (gradient checkpointing)."""
    on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; older: the next
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


COMPILED_LAYERS = "_kto_compiled_layers"  # set on a `decoder_body` whose layers were compiled (--torch-compile)
STATIC_LAYERS = "_kto_static_layers"  # set on one whose compiled layers take a few static shapes (a graph each)


def keeps_keys_values(model) -> bool:
    """Whether training's first forward keeps its keys/values for the KL completions' forward (else they run with
    their prompts again, in the layout's shape, without gradients). Not where compiled layers take static shapes (the
    KL completions alone would take shapes of their own, a graph each). Under gradient checkpointing, only where the
    layers take the cache along into their checkpoints (`_can_checkpoint_with_cache`, set by
    `scoring.attention.enable_checkpointing` where transformers has it; the cache is closed before the backward
    recomputes them, `scoring.keys_values.close_keys_values`) and the cache is small (`small_keys_values`): there
    checkpointing was asked for memory, and the cache holds every layer's keys/values until the KL forward. Compiled
    layers keep them in a `scoring.keys_values.KeptKeysValues`."""
    body = decoder_body(model)
    if getattr(body, STATIC_LAYERS, False):
        return False
    if not checkpointing(model):
        return True
    layers = getattr(body, "layers", None) or []
    taken_along = len(layers) > 0 and all(getattr(layer, "_can_checkpoint_with_cache", False) for layer in layers)
    return taken_along and small_keys_values(model)


def small_keys_values(model) -> bool:
    """Whether a token's keys and values (2 x key/value heads x head size) are at most half its hidden size, which a
    checkpointed layer keeps of each token (its input): grouped-query attention's few key/value heads. There the
    cache adds at most half of what checkpointing keeps, and costs less than the alternative's forward of the whole
    layout, without gradients, at the KL forward (simulated, estimate-memory, max_length 2048: Qwen2-1.5B's peak
    0.07-1.0 GiB lower at batch 8 and 64; Llama-3-8B's, at exactly half, 0.2 GiB lower at batch 8 and 4-8% higher at
    64; Llama-2-7B's, with as many key/value heads as heads, 5% to 80% higher)."""
    config = text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not heads or not hidden:
        return False
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * kv_heads * head_dim <= hidden / 2


def sliding_window(model) -> int | None:
    """The attention window of a model whose layers all use one (Mistral-style), else None."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def lm_head_settings(model) -> tuple[float, float | None]:
    """(logit_scale, softcap) a model applies to its logits, read from its config."""
    config = text_config(model)
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None):
        scale = 1.0 / config.logits_scaling  # Granite divides its logits
    softcap = getattr(config, "final_logit_softcapping", None)
    return (1.0 if scale is None else float(scale)), softcap


def backbone_of(model):
    """The transformer body (everything before the LM head) of a causal LM."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:  # a prefix naming no attribute (Llama 4's text model: `language_model`)
        body = getattr(model, "model", None)
    if not isinstance(body, torch.nn.Module) or body is model:
        raise ValueError(f"{type(model).__name__} exposes no backbone (`base_model`); cannot score it in chunks.")
    return body


def backbone_or_none(model):
    """`backbone_of(model)`, or None where the model exposes none."""
    try:
        return backbone_of(model)
    except ValueError:
        return None


def scorable(model):
    """The causal LM whose backbone and head we call: a PEFT model is scored through its base model, whose
    layers carry the adapters."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def language_model(body):
    """A vision-language model's language model within its `body` (`language_model`; Idefics3's `text_model`), or
    None for a text model's."""
    for name in ("language_model", "text_model"):
        language = getattr(body, name, None)
        if isinstance(language, torch.nn.Module):
            return language
    return None


def decoder_body(model):
    """The module whose `layers` are `model`'s decoder layers: a causal LM's backbone, a vision-language model's
    language model, a PEFT model's through the model it wraps. Its layers are what --torch-compile compiles (marking
    this module with COMPILED_LAYERS and STATIC_LAYERS) and what bf16 casts once a step."""
    body = backbone_of(scorable(model))
    language = language_model(body)
    return body if language is None else language


def _is_dropout_rate(name: str, value) -> bool:
    """A dropout probability a layer reads at call time (`attention_dropout`, `residual_dropout`, `resid_pdrop`)."""
    named = "dropout" in name or name.endswith("pdrop")
    return named and isinstance(value, float | int) and not isinstance(value, bool) and value > 0


# the dropout rates `disable_dropout` zeroed on a config: id(config) -> (a weak reference to it, {name: rate})
_ZEROED_CONFIG_RATES: dict[int, tuple[weakref.ref, dict[str, float]]] = {}


def _configs(model) -> list:
    """Every config of `model`'s modules and the configs inside them (a vision-language model's text_config), once."""
    found, pending = [], [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or not hasattr(config, "to_dict") or any(config is c for c in found):
            continue
        found.append(config)
        pending += [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return found


def disable_dropout(model) -> list[str]:
    """Every form of dropout off, for training against a reference computed without it (KTO's and DPO's log-prob
    differences). trl's `disable_dropout_in_model` zeroes the `nn.Dropout` modules; layers that call
    `nn.functional.dropout` with a rate kept as an attribute (`self.residual_dropout`), or hand the attention kernel a
    rate read from the module or its config (`config.attention_dropout`) in training, would still drop, so those
    rates are zeroed too: on the modules, and on every config (its own rates as loaded come back when the model is
    saved: `dropout_restored`). Returns the names zeroed besides the modules."""
    zeroed: set[str] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if not name.startswith("_") and _is_dropout_rate(name, value):
                setattr(module, name, 0.0)
                zeroed.add(name)
    for config in _configs(model):
        rates = {name: value for name, value in vars(config).items() if _is_dropout_rate(name, value)}
        for name in rates:
            setattr(config, name, 0.0)
            zeroed.add(f"config.{name}")
        if rates:
            _ZEROED_CONFIG_RATES[id(config)] = (weakref.ref(config), rates)
    return sorted(zeroed)


@contextmanager
def dropout_restored(model):
    """The dropout rates of `model`'s configs as they were loaded, within: a saved model keeps its own config."""
    restored = []
    for config in _configs(model):
        ref, rates = _ZEROED_CONFIG_RATES.get(id(config), (None, None))
        if ref is not None and ref() is config:
            restored.append((config, {name: getattr(config, name) for name in rates}))
            for name, rate in rates.items():
                setattr(config, name, rate)
    try:
        yield
    finally:
        for config, values in restored:
            for name, value in values.items():
                setattr(config, name, value)
