"""Per-token log-probs of completion tokens, without ever building `(batch, seq, vocab)` logits.

Both stages score sequences with the functions in this module: the reference pass (stage 1, under
`inference_mode`) and the policy (stage 2, with gradients). Using one function is what makes the
invariant "policy == reference  =>  rewards == 0" hold exactly.

The trade-off: a model's own forward projects every position through the LM head, so a batch of
8 x 1024 tokens with a 150k vocabulary holds 1.2 G logits (4.9 GB in float32) just to read one
value per position. Instead we run the backbone, keep only the hidden states of completion
positions, and project them through the LM head in chunks of rows. The backward pass recomputes
each chunk's logits rather than storing them (as Liger-Kernel's chunked losses do), so memory is
O(chunk x vocab) in both directions at the cost of one extra matmul per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 1024


def _chunk_logits(
    hidden: torch.Tensor,  # (n, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    logit_scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logits of one chunk, plus tanh(raw / softcap) when soft-capping (needed for the backward)."""
    logits = F.linear(hidden, weight, bias).float()  # (n, V)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = softcap * tanh
    return logits, tanh


class _ChunkedTokenLogps(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[target], chunked over rows, with a recomputing backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, logit_scale, softcap, with_stats):
        n = hidden.shape[0]
        logps = hidden.new_empty(n, dtype=torch.float32)
        mean_logits = hidden.new_zeros(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        lses = hidden.new_empty(n, dtype=torch.float32)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits, _ = _chunk_logits(hidden[start:end], weight, bias, logit_scale, softcap)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            logps[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse
            lses[start:end] = lse
            if with_stats:  # metrics only; skipped by the reference pass and the KL forward
                mean_logits[start:end] = logits.mean(-1)
                # entropy = -sum(p * log p), log p = logits - lse computed in the logits' own buffer
                log_p = logits.sub_(lse[:, None])
                entropy[start:end] = -log_p.exp().mul_(log_p).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lses)
        ctx.chunk_size, ctx.logit_scale, ctx.softcap = chunk_size, logit_scale, softcap
        ctx.mark_non_differentiable(mean_logits, entropy)
        return logps, mean_logits, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_mean_logits, _grad_entropy):
        hidden, weight, bias, targets, lses = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if (need_b and bias is not None) else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            g = grad_logps[start:end].float()  # (n,)
            logits, tanh = _chunk_logits(h, weight, bias, ctx.logit_scale, ctx.softcap)
            # d logp[t] / d logits = onehot(t) - softmax(logits), built in place in the logits' buffer
            dlogits = logits.sub_(lses[start:end, None]).exp_().mul_(-g[:, None])
            dlogits.scatter_add_(-1, targets[start:end, None], g[:, None])
            if tanh is not None:
                dlogits = dlogits * (1 - tanh * tanh)
            if ctx.logit_scale != 1.0:
                dlogits = dlogits * ctx.logit_scale
            dlogits = dlogits.to(h.dtype)
            if need_h:
                grad_hidden[start:end] = dlogits @ weight
            if need_w:
                grad_weight += (dlogits.t() @ h).float()
            if grad_bias is not None:
                grad_bias += dlogits.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of each target token under an LM head, computed `chunk_size` rows at a time.

    Args:
        hidden: (N, H) hidden states, one row per scored position.
        weight: (V, H) LM head weight.
        targets: (N,) int64 token ids to score.
        bias: (V,) optional LM head bias.
        logit_scale: logits are multiplied by this (Cohere-style `logit_scale`).
        softcap: if set, logits become `softcap * tanh(logits / softcap)` (Gemma-2 style).

    Returns:
        logps (N,) float32, differentiable w.r.t. hidden, weight and bias;
        mean_logits (N,) float32, the mean logit over the vocabulary (TRL's `logits/*` metrics);
        entropy (N,) float32 of the next-token distribution. The last two carry no gradient, and are
        zeros with `with_stats=False` (which saves two passes over each chunk's logits).
    """
    # Under autocast the custom Function would see mixed dtypes; cast explicitly to what autocast would use.
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedTokenLogps.apply(
            hidden.to(dtype),
            weight.to(dtype),
            None if bias is None else bias.to(dtype),
            targets,
            chunk_size,
            float(logit_scale),
            softcap,
            with_stats,
        )


@dataclass
class SequenceScores:
    """Scores of a padded batch of sequences; positions outside the completion are 0."""

    token_logps: torch.Tensor  # (B, T-1) log-prob of token t+1 at position t, 0 outside the completion
    logps: torch.Tensor  # (B,) sum over completion tokens: the sequence log-prob KTO uses
    mean_logits: torch.Tensor  # (B, T-1) no grad
    entropy: torch.Tensor  # (B, T-1) no grad
    mask: torch.Tensor  # (B, T-1) bool, True at scored positions
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss, when router logits were requested


def pad_sequences(
    seqs: list[list[int]], prompt_lens: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, completion_mask), each (B, T): what `score_sequences` takes.
    Both stages batch with it, so the reference and the policy see identical inputs."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    comp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        comp[i, p : len(s)] = 1
    return ids, attn, comp


def lm_head_settings(model) -> tuple[float, float | None]:
    """(logit_scale, softcap) a model applies to its logits, read from its config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
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
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__} exposes no backbone (`base_model`); cannot score it in chunks.")
    return body


def score_sequences(
    model,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor,  # (B, T)
    completion_mask: torch.Tensor,  # (B, T), 1 on completion tokens
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_stats: bool = True,
    output_router_logits: bool = False,
) -> SequenceScores:
    """Run the backbone once and score the completion tokens through the LM head in chunks.

    `with_stats=False` skips the metric-only mean logits and entropy (left as zeros).
    `output_router_logits=True` (mixture-of-experts models) also returns the load-balancing loss.
    A PEFT model is scored through its base model, whose layers carry the adapters."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    extra = {"output_router_logits": True} if output_router_logits else {}
    outputs = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    hidden = outputs.last_hidden_state[:, :-1]  # (B, T-1, H): position t predicts token t+1
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].bool()
    head = model.get_output_embeddings()
    logit_scale, softcap = lm_head_settings(model)
    logps, mean_logits, entropy = chunked_token_logps(
        hidden[mask], head.weight, targets[mask], head.bias, chunk_size, logit_scale, softcap, with_stats
    )
    # masked_scatter keeps the result connected to the graph even if no position is scored.
    token_logps = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
    aux_loss = None
    if output_router_logits:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        config = model.config.get_text_config()
        num_experts = getattr(config, "num_local_experts", None) or config.num_experts
        aux_loss = load_balancing_loss_func(
            outputs.router_logits, num_experts, config.num_experts_per_tok, attention_mask
        )
    return SequenceScores(
        token_logps=token_logps,
        logps=token_logps.sum(-1),
        mean_logits=mean_logits.new_zeros(mask.shape).masked_scatter(mask, mean_logits),
        entropy=entropy.new_zeros(mask.shape).masked_scatter(mask, entropy),
        mask=mask,
        aux_loss=aux_loss,
    )
