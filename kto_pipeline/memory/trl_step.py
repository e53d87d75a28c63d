"""trl.KTOTrainer's step, modelled for `estimate-memory --against-trl` (online: a reference model beside the policy).

This package does not import trl, so that step is modelled here, after trl 1.16's `KTOTrainer._compute_loss` and
its fused LM head (`trl/trainer/utils.py:add_fused_lm_head`, `trl/kernels/chunked_logprob.py`);
benchmarks/bench_memory.py and tests/test_estimate_memory.py hold the model to the real trl run under the same
simulation.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any

from kto_pipeline.memory.simulation import (
    StepMemory,
    StepSettings,
    breakdown,
    build_model,
    cpu_accelerator,
    fake_mode,
    init_optimizer_state,
    memory_tracker,
    pad_token_id,
)

# ------------------------------------------------------------------------------------------ trl's step (model)
#
# trl 1.16's KTOTrainer._compute_loss, per micro-batch (trl/trainer/kto_trainer.py):
#   1. the KL sequences (prompt_i + completion_{i-1}) through the policy, without gradients;
#   2. the sequences through the policy, with gradients;
#   3. online: the KL sequences, then the sequences, through the reference model, without gradients
#      (gradient checkpointing off for these, `disable_gradient_checkpointing`);
#   4. the loss, backward (Trainer.training_step), clipping, AdamW (`adamw_torch_fused`), zero_grad.
# Every forward takes a padded batch (DataCollatorForUnpairedPreference: right padding to the longest row) and
# projects hidden states through its fused LM head (`add_fused_lm_head`), which never builds (B, T, V) logits: on
# a CUDA device (Triton) only the positions whose label is not -100 go through `ChunkedLogProbFunction`, in
# tiles of 4096 tokens x 32768 vocabulary entries written into one reused buffer in the compute dtype; its
# backward accumulates float32 gradients of the hidden states and of the head's weight.

_TRL_TOKEN_CHUNK, _TRL_VOCAB_CHUNK = 4096, 32768


def addmm_fp32(acc, a, b) -> None:
    """acc += a @ b accumulated in float32 without a float32 copy of `a` and `b` (cuBLAS's out_dtype, as trl on
    CUDA; fake tensors take it on any device). Real CPU tensors: the float32 copies."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    if a.dtype in (torch.bfloat16, torch.float16) and (isinstance(acc, FakeTensor) or acc.device.type == "cuda"):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


@contextmanager
def _uncounted():
    """Ops in the block run without the memory tracker (a dispatch mode; fake tensors stay fake): trl's Triton
    kernels fold a logits tile into running statistics, or turn it into its gradient, in registers, allocating
    nothing, while the same maths in torch makes tile-sized temporaries that a GPU never holds."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _trl_fused_function():
    import torch

    class _TrlFusedLogProbs(torch.autograd.Function):
        """Per-token log-probs (and entropy, mean logit) of `hidden @ weight.T` as trl's `ChunkedLogProbFunction`
        computes them on a CUDA device, with its allocations: seven (N,) float32 statistics, one reused
        (min(N, 4096), 32768) tile in the compute dtype, each token chunk and weight slice cast to it; saved for the
        backward: hidden, weight, targets, log Z, entropy; the backward's float32 accumulators of the hidden
        states' and the weight's gradients, and its own tile. The folds, Triton kernels in trl, run uncounted."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, with_stats, dtype):
            # (factories from `hidden`: in the simulation they are fake like it)
            n, vocab, f32 = hidden.shape[0], weight.shape[0], torch.float32
            running_max = hidden.new_full((n,), float("-inf"), dtype=f32)
            sum_exp, x_sum_exp, sq_sum_exp, z_sum = (hidden.new_zeros(n, dtype=f32) for _ in range(4))
            max_before_target = hidden.new_full((n,), float("-inf"), dtype=f32)
            target_logit = hidden.new_zeros(n, dtype=f32)
            buffer = hidden.new_empty((min(n, _TRL_TOKEN_CHUNK), _TRL_VOCAB_CHUNK), dtype=dtype)
            for t0 in range(0, n, _TRL_TOKEN_CHUNK):
                t1 = min(t0 + _TRL_TOKEN_CHUNK, n)
                chunk = hidden[t0:t1].to(dtype)
                for v0 in range(0, vocab, _TRL_VOCAB_CHUNK):
                    v1 = min(v0 + _TRL_VOCAB_CHUNK, vocab)
                    tile = buffer[: t1 - t0, : v1 - v0]
                    torch.mm(chunk, weight[v0:v1].to(dtype).t(), out=tile)
                    with _uncounted():  # online logsumexp: trl's `_forward_kernel`
                        rows = slice(t0, t1)
                        z = tile.float()
                        z_sum[rows] += z.sum(-1)
                        new_max = torch.maximum(running_max[rows], z.amax(-1))
                        e = torch.exp(z - new_max[:, None])
                        rescale = torch.exp(running_max[rows] - new_max)
                        sum_exp[rows] = sum_exp[rows] * rescale + e.sum(-1)
                        x_sum_exp[rows] = x_sum_exp[rows] * rescale + (e * z).sum(-1)
                        running_max[rows] = new_max
                        local = targets[rows] - v0
                        inside = (local >= 0) & (local < v1 - v0)
                        picked = z.gather(-1, local.clamp(0, v1 - v0 - 1)[:, None]).squeeze(-1)
                        target_logit[rows] = torch.where(inside, picked, target_logit[rows])
                        del z, e
            log_z = running_max + torch.log(sum_exp)
            logps = target_logit - log_z
            entropy = log_z - x_sum_exp / sum_exp if with_stats else None
            mean_logits = z_sum / vocab if with_stats else None
            del sq_sum_exp, max_before_target  # allocated by trl whether asked for or not
            ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
            ctx.dtype = dtype
            if mean_logits is not None:
                ctx.mark_non_differentiable(mean_logits)
            return logps, entropy, mean_logits

        @staticmethod
        def backward(ctx, grad_logps, _grad_entropy, _grad_mean):
            hidden, weight, targets, log_z, _ = ctx.saved_tensors
            n, vocab, dtype = hidden.shape[0], weight.shape[0], ctx.dtype
            need_h, need_w = ctx.needs_input_grad[:2]
            grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_h else None
            grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if need_w else None
            buffer = hidden.new_empty((min(n, _TRL_TOKEN_CHUNK), _TRL_VOCAB_CHUNK), dtype=dtype)
            g = grad_logps.float().contiguous()
            for t0 in range(0, n, _TRL_TOKEN_CHUNK):
                t1 = min(t0 + _TRL_TOKEN_CHUNK, n)
                chunk = hidden[t0:t1].to(dtype)
                for v0 in range(0, vocab, _TRL_VOCAB_CHUNK):
                    v1 = min(v0 + _TRL_VOCAB_CHUNK, vocab)
                    w_chunk = weight[v0:v1].to(dtype)
                    tile = buffer[: t1 - t0, : v1 - v0]
                    torch.mm(chunk, w_chunk.t(), out=tile)
                    with _uncounted():  # d logp[t] / d z = onehot(t) - softmax(z), in the tile: `_backward_kernel`
                        rows = slice(t0, t1)
                        grad = torch.exp(tile.float() - log_z[rows, None]).mul_(-g[rows, None])
                        local = targets[rows] - v0
                        inside = ((local >= 0) & (local < v1 - v0)).float()
                        grad.scatter_add_(-1, local.clamp(0, v1 - v0 - 1)[:, None], (g[rows] * inside)[:, None])
                        tile.copy_(grad)
                        del grad
                    if grad_hidden is not None:
                        addmm_fp32(grad_hidden[t0:t1], tile, w_chunk)
                    if grad_weight is not None:
                        addmm_fp32(grad_weight[v0:v1], tile.t(), chunk)
            return (
                None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None,
                None,
                None,
            )

    return _TrlFusedLogProbs


def _trl_head(model, input_ids, attention_mask, completion_mask, with_stats: bool, images=None):
    """trl's `_fused_forward` with `fused_lm_head=True` on a CUDA device: the backbone, then the fused head over
    the positions whose label is not -100 (compact), scattered back to (B, T-1). Returns the (B,) sums. `images`
    (a vision-language model): the batch's image tensors, which trl hands every forward (the model merges them)."""
    import torch

    from kto_pipeline.models import backbone_of

    labels = input_ids.masked_fill(completion_mask == 0, -100)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a peft model: its LoRA layers)
    hidden = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **(images or {}))
    hidden = hidden.last_hidden_state[:, :-1]
    labels = labels[:, 1:]
    mask = labels != -100
    head = model.get_output_embeddings()
    # the compute dtype: autocast's where it is on (read before the Function, as trl's forward reads it)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
    out = _trl_fused_function().apply(hidden[mask], head.weight, labels[mask], with_stats, dtype)
    logps = out[0].new_zeros(mask.shape).masked_scatter(mask, out[0])
    if with_stats:  # trl scatters the metric outputs back too
        for x in out[1:]:
            x.new_zeros(mask.shape).masked_scatter(mask, x)
    return logps.sum(-1)


def simulate_trl(
    model_config, rows: list[dict[str, Any]], settings: StepSettings, online: bool, fake: bool = True
) -> StepMemory:
    """Peak memory of one trl.KTOTrainer step on `rows` (this module's model of it: see above). `online`: a
    reference model beside the policy; else `precompute_ref_log_probs=True` (reference log-probs in the batch).
    Rows with `pixels` (a vision-language model, which trl trains online only): every forward (the policy's, its KL
    forward, the reference's two) gets the batch's pictures, as trl's vision collator hands them."""
    import torch

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.objectives.loss import kto_loss
    from kto_pipeline.scoring.logprobs import pad_sequences
    from kto_pipeline.stages.train.policy import make_optimizer

    mode = fake_mode() if fake else None
    precision = "bf16" if settings.bf16 else "no"
    config = TrainConfig(cache="-", output_dir="-", bf16=settings.bf16)
    policy = build_model(model_config, settings, mode)
    reference = None
    if online:
        reference = build_model(
            model_config, dataclasses.replace(settings, lora_r=None, gradient_checkpointing=False), mode
        )
        reference.requires_grad_(False).eval()
    accelerator = cpu_accelerator(precision)
    optimizer = make_optimizer(config, policy)
    policy, optimizer = accelerator.prepare(policy, optimizer, device_placement=[False, False])
    if reference is not None:
        reference = accelerator.prepare_model(reference, evaluation_mode=True, device_placement=False)
    init_optimizer_state(policy, optimizer, mode)
    pad_id = pad_token_id(model_config)
    prompts = [len(r["prompt_ids"]) for r in rows]
    ids, attn, comp = pad_sequences([r["prompt_ids"] + r["completion_ids"] for r in rows], prompts, pad_id)
    kl_ids, kl_attn, kl_comp = pad_sequences([r["prompt_ids"] + r["kl_completion_ids"] for r in rows], prompts, pad_id)
    labels = torch.tensor([r["label"] for r in rows])
    images = None
    if "pixels" in rows[0]:
        from kto_pipeline.scoring.logprobs import join_images

        images = join_images([r["pixels"] for r in rows])
    ref_logps = torch.tensor([r["ref_logp"] for r in rows])
    tracker = memory_tracker()
    tracker.track_external(policy, optimizer)
    if reference is not None:
        tracker.track_external(reference)

    def forward(model, ids, attn, comp, with_stats):
        with accelerator.autocast():
            return _trl_head(model, ids, attn, comp, with_stats, images)

    with tracker:
        before = tracker._device_total(tracker.get_tracker_snapshot()[torch.device("cpu")])
        with torch.no_grad():
            kl_logps = forward(policy, kl_ids, kl_attn, kl_comp, False)
        logps = forward(policy, ids, attn, comp, True)
        if reference is not None:
            with torch.no_grad(), _no_checkpointing(policy):
                ref_kl = forward(reference, kl_ids, kl_attn, kl_comp, False)
                ref_logps = forward(reference, ids, attn, comp, False)
        else:
            ref_kl = torch.tensor([r["ref_kl_logp"] for r in rows])
        z0 = (kl_logps - ref_kl).mean().detach().clamp(min=0)
        loss, _, _ = kto_loss(logps, ref_logps, labels, z0, beta=config.beta)
        del kl_logps, logps, ref_kl, ref_logps, z0
        accelerator.backward(loss)
        del loss
        accelerator.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    dev = torch.device("cpu")
    executed = ids.numel() + kl_ids.numel()
    return StepMemory(
        peak_bytes=tracker._peak_mem[dev],
        breakdown=breakdown(tracker._peak_mem_snap[dev], False),
        before_step_bytes=before,
        tokens_with_grad=ids.numel(),
        tokens_executed=executed * (2 if online else 1),
    )


@contextmanager
def _no_checkpointing(model):
    """trl runs the reference forwards with gradient checkpointing off (`disable_gradient_checkpointing`)."""
    from kto_pipeline.models import checkpointing

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = checkpointing(base)
    if on:
        base.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if on:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
