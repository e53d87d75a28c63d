"""Held-out evaluation against a reference cache: how often does the implicit reward
beta * (policy logp - ref logp) have the sign of the row's label (desirable > 0 > undesirable)?"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from kto_pipeline.cache import open_cache
from kto_pipeline.logprobs import score_sequences
from kto_pipeline.train import CacheRows, Collator


@torch.inference_mode()
def reward_accuracy(model, cache_dir: str | Path, beta: float, pad_id: int, batch_size: int = 16) -> dict[str, float]:
    """Implicit-reward statistics of `model` over every row of a cache (no gradient)."""
    cache = open_cache(cache_dir)
    rows = CacheRows(cache, cache.manifest["settings"]["max_length"])
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rewards, labels = [], []
    for batch in DataLoader(rows, batch_size=batch_size, collate_fn=Collator(pad_id)):
        scores = score_sequences(
            model,
            batch["input_ids"].to(device),
            batch["attention_mask"].to(device),
            batch["completion_mask"].to(device),
        )
        rewards.append(beta * (scores.logps.float().cpu() - batch["ref_logp"]))
        labels.append(batch["label"])
    model.train(was_training)
    r, y = torch.cat(rewards), torch.cat(labels)
    correct = torch.where(y, r > 0, r < 0)
    return {
        "reward_accuracy": correct.float().mean().item(),
        "rewards/chosen": r[y].mean().item() if y.any() else float("nan"),
        "rewards/rejected": r[~y].mean().item() if (~y).any() else float("nan"),
        "rows": len(r),
    }
