"""Tiny random models of the decoder families users train, built from their transformers configs (nothing
downloaded): 4 layers with the family's real layer pattern (sliding and full windows, chunked attention, conv,
linear-attention and Mamba layers, experts), windows and chunks of 8 tokens, shorter than the test rows, and the char
tokenizer of `kto_pipeline.demo.tiny`."""

from __future__ import annotations

from pathlib import Path

LAYERS = 4
WINDOW = 8  # sliding windows and attention chunks: shorter than every test row
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4)
SIZES |= dict(num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
MIXED = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

# family -> (config class name, model class name, the family's own settings)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4, decoder_sparse_step=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(sliding_window=WINDOW, layer_types=MIXED, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=WINDOW, layer_types=MIXED)),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4)
        | dict(num_experts_per_tok=2),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=WINDOW, layer_types=MIXED)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 1, 1, 0])),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
        | dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        | dict(num_key_value_heads=4),  # (multi-head latent attention: as many key/value heads as query heads)
    ),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"] * 2)),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(MOE, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4)
        | dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
        | dict(shared_expert_intermediate_size=16),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8),
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0], interleave_moe_layer_step=2)
        | dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
    ),
}
# families whose attention transformers runs only eagerly (or in flash/flex kernels): soft-capping, sinks
EAGER = {"gemma2": "eager", "gpt_oss": "eager"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next", "llama4_text")
STATEFUL_FAMILIES = ("lfm2", "qwen3_next", "falcon_h1")


def build_family(family: str, tokenizer, seed: int = 0, **overrides):
    """A float32 tiny random model of `family` (see FAMILIES), its vocabulary `tokenizer`'s."""
    import torch
    import transformers

    config_name, model_name, own = FAMILIES[family]
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    settings = SIZES | ids | own | overrides
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **settings)
    config._attn_implementation = EAGER.get(family, "sdpa")
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).float().eval()


def save_family(family: str, directory: Path, **overrides) -> Path:
    """`build_family` saved with the char tokenizer at `directory` (a model directory both stages take)."""
    from kto_pipeline.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    build_family(family, tokenizer, **overrides).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
