"""One micro-batch's step, as `train` runs it and `estimate-memory` simulates it (`kto_pipeline/memory`), so that
what the simulation measures is what train runs: the policy scores the batch through `PolicyScorer` (the module
DDP and FSDP wrap), the loss family's forward pass adds a mixture-of-experts model's load-balancing loss
(`forward`), then the engine's backward, clipping and the optimizer's step (`update`). What train does around
them (metrics, logging, the schedule) is train's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kto_pipeline.objectives.items import LAYOUT_KEY, batch_images, batch_layout
from kto_pipeline.scoring.logprobs import PolicyScores, score_layout, score_policy, score_sequences
from kto_pipeline.scoring.packing import AttentionCosts


def forward(objective, accelerator, scorer, batch: dict[str, torch.Tensor], settings, aux_coef: float, real=None):
    """The loss family's forward pass and loss over `batch` under its `settings` (`objective.settings`), with
    gradients (`objective.forward`'s `StepOut`); a mixture-of-experts model's load-balancing loss weighted by
    `aux_coef` is added to it, as the model's own loss adds it (and as trl logs it); 0: none asked. `real`: the
    batch's real items (`objectives.items.real_rows`)."""
    out = objective.forward(
        accelerator, scorer, batch, settings, with_stats=True, output_router_logits=aux_coef != 0, real=real
    )
    if out.scored.completions.aux_loss is not None:  # keep the experts' load balanced
        out.loss = out.loss + aux_coef * out.scored.completions.aux_loss
    return out


def update(
    engine, scorer, optimizer, loss: torch.Tensor, max_grad_norm: float, before_update: Callable[[], None] | None = None
) -> torch.Tensor | None:
    """The backward of `loss`; where the gradients sync (an optimizer step's last micro-batch), `before_update`,
    then the gradients clipped to `max_grad_norm` (> 0), their norm returned (kept on the device: reading it waits
    for the device); then the optimizer's step (accelerate's wrapper skips it between syncs)."""
    engine.backward(loss)
    grad_norm = None
    if engine.accelerator.sync_gradients:
        if before_update is not None:
            before_update()
        if max_grad_norm > 0:
            grad_norm = engine.clip_grad_norm(scorer, max_grad_norm)
    engine.step(optimizer)
    return grad_norm


class PolicyScorer(torch.nn.Module):
    """Wraps the causal LM so that scoring goes through `forward` (and thus through DDP/FSDP wrappers)."""

    def __init__(self, model, attention: AttentionCosts):
        super().__init__()
        self.model = model
        self.attention = attention  # how packed batches attend (the run's plan)
        # FSDP's transformer-based auto wrap looks for the layer classes here
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, batch, with_kl: bool = True, with_stats: bool = True, output_router_logits: bool = False):
        """The scores of the batch's sequences (with grad) and, with `with_kl` where the batch holds KL
        completions (laid out apart: `packed_batch(split_last=True)`, or `kl_` padded sequences), theirs without
        grad: `PolicyScores`. A packed batch without KL completions runs as one forward over its trees, each
        prompt once."""
        layout, images = batch_layout(batch), batch_images(batch)
        routed = {"output_router_logits": output_router_logits}
        if layout is not None and LAYOUT_KEY + "split" not in batch:  # every continuation with grad
            scores = score_layout(self.model, layout, self.attention, with_stats=with_stats, images=images, **routed)
            return PolicyScores(scores, None, layout.input_ids.numel(), kl_on_cached_prompt=False)
        if layout is not None:
            return score_policy(
                self.model, layout, self.attention, with_kl, with_stats=with_stats, images=images, **routed
            )
        completions = score_sequences(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            with_stats=with_stats,
            output_router_logits=output_router_logits,
            images=images,
            kernel=self.attention.kernel,
        )
        kl, executed = None, batch["input_ids"].numel()
        if with_kl and "kl_input_ids" in batch:
            with torch.no_grad():
                kl = score_sequences(
                    self.model,
                    batch["kl_input_ids"],
                    batch["kl_attention_mask"],
                    batch["kl_completion_mask"],
                    with_stats=False,
                    images=images,
                    kernel=self.attention.kernel,
                )
            executed += batch["kl_input_ids"].numel()
        return PolicyScores(completions, kl, executed, kl_on_cached_prompt=False)
