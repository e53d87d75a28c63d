"""The log-prob head: log_softmax(hidden @ W.T)[target] of every scored token, without `(batch, seq, vocab)` logits.

A model's own forward projects every position through the LM head, so a batch of 8 x 1024 tokens with a 150k
vocabulary holds 1.2 G logits (4.9 GB in float32) just to read one value per position. Both stages instead keep only
the hidden states of completion positions (`logprobs.py`) and project them through the head here, in chunks of rows.
The backward pass recomputes each chunk's logits rather than storing them (as Liger-Kernel's chunked losses do), so
memory is O(chunk x vocab) in both directions at the cost of one extra matmul per chunk. Where all of a batch's logits
are small (at most `KEEP_LOGITS_BYTES`, e.g. SmolLM2's 49k vocabulary at batch 8 on the CPU), the forward keeps them
for the backward instead: the same values without the second matmul.

With `--torch-compile` each chunk's softmax statistics and its logits' gradient are compiled regions
(`softmax_stats`, `logits_grad`: a few fused kernels a chunk in place of a dozen ops), in both stages alike, with the
chunk's rows dynamic; the chunk loop and the matmuls stay eager, so the number of rows never specialises a graph. The
in-place steps and their reused buffers are the eager path's: compiled, a chunk's backward allocates its logits'
gradient.
"""

from __future__ import annotations

import torch

from kto_pipeline.models import lm_head_settings
from kto_pipeline.runtime.compiled import compiled_region
from kto_pipeline.runtime.engines.base import Engine
from kto_pipeline.scoring.products import in_row_blocks, linear, row_block

# A chunk is as many scored tokens as make this many bytes of float32 logits (Qwen2's 152k vocabulary: 220 tokens;
# SmolLM2's 49k: 682), so that the head's transients stay small beside the activations whatever the vocabulary.
CHUNK_LOGITS_BYTES = 128 << 20
DEFAULT_CHUNK_SIZE = None  # rows per chunk: from CHUNK_LOGITS_BYTES
# Float32 logits of up to this many bytes are kept from the forward for the backward rather than recomputed
# (one matmul of the head saved per step; the backward reads the same values it would have recomputed).
KEEP_LOGITS_BYTES = 256 << 20


def _chunk_logits(
    hidden: torch.Tensor,  # (n, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    logit_scale: float,
    softcap: float | None,
    buffer: torch.Tensor,  # (>= n, V) float32, reused from chunk to chunk
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logits of one chunk, in `buffer`, plus tanh(raw / softcap) when soft-capping (needed for the
    backward).

    Float32 matmuls write into `buffer`: a fresh (n, V) block per chunk is page-faulted and zeroed by the
    kernel on every allocation, which cost about a fifth of the head's time on the CPU. Lower-precision logits
    (bf16 autocast) are cast into it, the value `.float()` gives, without a fresh float32 block per chunk."""
    logits = buffer[: hidden.shape[0]]
    if hidden.dtype == torch.float32:
        if bias is None:
            torch.mm(hidden, weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden, weight.t(), out=logits)
    else:
        logits.copy_(linear(hidden, weight, bias))  # (n, V) in bf16, then float32; a CPU's in blocks of rows
    if logit_scale != 1.0:
        logits.mul_(logit_scale)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = torch.mul(tanh, softcap, out=logits)
    return logits, tanh


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    return hidden.new_empty(min(chunk_size, hidden.shape[0]), weight.shape[0], dtype=torch.float32)


class _ChunkedTokenLogps(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[target], chunked over rows. The backward recomputes each chunk's
    logits, or reads them from the forward where all of them fit in KEEP_LOGITS_BYTES.

    `weight` comes as the model holds it and is cast to `hidden`'s dtype here, in the forward and again in the
    backward: under autocast a bf16 copy of the head (1.1 GiB for Qwen2-7B) lives only while the head runs, not
    from the forward to the backward, and its gradient comes back in the weight's own dtype, float32,
    accumulated chunk by chunk and vocabulary slice by slice: no (vocab, hidden) transient but the weight's cast."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, chunk_size, logit_scale, softcap, with_stats, keep_logits, compiled
    ):
        n, (stats_fn, ctx.logits_grad_fn) = hidden.shape[0], compiled or (None, None)
        saved_weight, weight = weight, weight.to(hidden.dtype)
        logps = hidden.new_empty(n, dtype=torch.float32)
        mean_logits = hidden.new_zeros(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        lses = hidden.new_empty(n, dtype=torch.float32)
        buffer = None if (keep_logits and stats_fn is not None) else _logits_buffer(hidden, weight, chunk_size)
        exps = torch.empty_like(buffer) if with_stats and stats_fn is None else None
        kept = hidden.new_empty(n, weight.shape[0], dtype=torch.float32) if keep_logits else None
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            out = buffer if kept is None else kept[start:end]
            logits, _ = _chunk_logits(hidden[start:end], weight, bias, logit_scale, softcap, out)
            if stats_fn is not None:  # compiled (--torch-compile): the same values, fused
                logps[start:end], lses[start:end], mean, ent = stats_fn(logits, targets[start:end], with_stats)
                if with_stats:
                    mean_logits[start:end], entropy[start:end] = mean, ent
                continue
            target_logits = logits.gather(-1, targets[start:end, None]).squeeze(-1)
            if with_stats:  # metrics only; skipped by the reference pass and the KL forward
                mean_logits[start:end] = logits.mean(-1)
            # logsumexp's own steps (max, shift, exp, sum, log), in the chunk's buffer (in place unless kept)
            top = logits.amax(-1, keepdim=True)
            shifted = torch.sub(logits, top, out=buffer[: end - start])
            e = torch.exp(shifted, out=exps[: end - start]) if with_stats else shifted.exp_()
            sum_exp = e.sum(-1)
            lse = sum_exp.log() + top.squeeze(-1)
            logps[start:end] = target_logits - lse
            lses[start:end] = lse
            if with_stats:
                # entropy = -sum(p * log p), p = e / sum_exp, log p = shifted - log(sum_exp)
                entropy[start:end] = sum_exp.log() - e.mul_(shifted).sum(-1) / sum_exp
        ctx.save_for_backward(hidden, saved_weight, bias, targets, lses)
        ctx.chunk_size, ctx.logit_scale, ctx.softcap, ctx.kept = chunk_size, logit_scale, softcap, kept
        ctx.mark_non_differentiable(mean_logits, entropy)
        return logps, mean_logits, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_mean_logits, _grad_entropy):
        hidden, saved_weight, bias, targets, lses = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        weight = saved_weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if (need_b and bias is not None) else None
        kept, ctx.kept = ctx.kept, None
        buffer = _logits_buffer(hidden, weight, ctx.chunk_size) if kept is None else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            g = grad_logps[start:end].float()  # (n,)
            if kept is None:
                logits, tanh = _chunk_logits(h, weight, bias, ctx.logit_scale, ctx.softcap, buffer)
            else:
                logits, tanh = kept[start:end], None
            if ctx.logits_grad_fn is not None:  # compiled (--torch-compile)
                dlogits = ctx.logits_grad_fn(logits, lses[start:end], g, targets[start:end])
            else:  # d logp[t] / d logits = onehot(t) - softmax(logits), built in place in the logits' buffer
                dlogits = logits.sub_(lses[start:end, None]).exp_().mul_(-g[:, None])
                dlogits.scatter_add_(-1, targets[start:end, None], g[:, None])
            if tanh is not None:
                dlogits = dlogits * (1 - tanh * tanh)
            if ctx.logit_scale != 1.0:
                dlogits = dlogits * ctx.logit_scale
            dlogits = dlogits.to(h.dtype)
            if need_h:
                torch.mm(dlogits, weight, out=grad_hidden[start:end])
            if need_w:
                if grad_weight.dtype == dlogits.dtype:
                    grad_weight.addmm_(dlogits.t(), h)
                else:  # bf16 products added into float32, a slice of the vocabulary at a time (small transients)
                    step = max(1, CHUNK_LOGITS_BYTES // (h.element_size() * h.shape[1]))
                    for v in range(0, grad_weight.shape[0], step):
                        grad_weight[v : v + step].add_(dlogits[:, v : v + step].t() @ h)
            if grad_bias is not None:
                grad_bias += dlogits.float().sum(0)
        del weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(saved_weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    with_stats: bool = True,
    compiled: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of each target token under an LM head, computed `chunk_size` rows at a time (default: as many as
    make CHUNK_LOGITS_BYTES of float32 logits).

    Args:
        hidden: (N, H) hidden states, one row per scored position.
        weight: (V, H) LM head weight.
        targets: (N,) int64 token ids to score.
        bias: (V,) optional LM head bias.
        logit_scale: logits are multiplied by this (Cohere-style `logit_scale`).
        softcap: if set, logits become `softcap * tanh(logits / softcap)` (Gemma-2 style).
        compiled: (`softmax_stats`, `logits_grad`) compiled (`--torch-compile`), run on each chunk's logits in place
            of the eager steps.

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
    if chunk_size is None:
        chunk_size = max(16, CHUNK_LOGITS_BYTES // (4 * weight.shape[0]))
        if in_row_blocks(hidden.device, dtype):  # whole blocks of the rows a CPU's half-precision product takes
            block = row_block(dtype, device_type)
            chunk_size = max(block, chunk_size - chunk_size % block)
    # keep the logits for the backward when there will be one and they are small (soft-capped logits would need
    # their tanh kept too: those recompute)
    keep_logits = (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        and softcap is None
        and hidden.shape[0] * weight.shape[0] * 4 <= KEEP_LOGITS_BYTES
    )
    with torch.autocast(device_type, enabled=False):
        return _ChunkedTokenLogps.apply(
            hidden.to(dtype),
            weight,  # cast inside (see _ChunkedTokenLogps)
            None if bias is None else bias.to(dtype),
            targets,
            chunk_size,
            float(logit_scale),
            softcap,
            with_stats,
            keep_logits,
            compiled,
        )


def softmax_stats(logits: torch.Tensor, targets: torch.Tensor, with_stats: bool):
    """(log-prob of each target, logsumexp, mean logit, entropy) of a chunk's float32 logits (n, V): the compiled
    form of the forward's steps (the last two None without `with_stats`)."""
    top = logits.amax(-1, keepdim=True)
    shifted = logits - top
    e = shifted.exp()
    sum_exp = e.sum(-1)
    lse = sum_exp.log() + top.squeeze(-1)
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_stats:
        return logps, lse, None, None
    return logps, lse, logits.mean(-1), sum_exp.log() - (e * shifted).sum(-1) / sum_exp


def logits_grad(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """d (sum g * logp[t]) / d logits = g * (onehot(t) - softmax(logits)): the compiled form of the backward's steps."""
    dlogits = (logits - lse[:, None]).exp() * -g[:, None]
    return dlogits.scatter_add(-1, targets[:, None], g[:, None])


def head_logps(model, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int | None, with_stats: bool):
    """(logps, mean_logits, entropy) of `targets` (N,) predicted from `hidden` (N, H) through `model`'s LM head."""
    head = model.get_output_embeddings()
    logit_scale, softcap = lm_head_settings(model)
    regions = (softmax_stats, logits_grad)
    compiled = tuple(compiled_region(model, fn) for fn in regions)
    compiled = None if compiled == regions else compiled  # not compiled: the eager, in-place steps

    def run(hidden, targets):
        settings = (chunk_size, logit_scale, softcap, with_stats, compiled)
        return chunked_token_logps(hidden, head.weight, targets, head.bias, *settings)

    if not Engine.gathers_in_forward(head):
        return run(hidden, targets)
    # Sharded head (DeepSpeed ZeRO-3, or an FSDP2 unit of its own): each process holds a slice of its weight,
    # gathered only around the head module's own forward and backward (its hooks). Run the chunked scoring as that
    # forward, so the weight is whole in both.
    head.forward = run
    try:
        return head(hidden, targets)
    finally:
        del head.forward
