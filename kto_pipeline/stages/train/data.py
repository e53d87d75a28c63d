"""Stage 2's data: the cache opened and checked against the run (complete, its files, the loss family's needs, the
length to train at; sha256 with --verify), and the loaders that read each process's part of every global batch from
it, packed where the model takes a packed layout, else padded and grouped by length."""

from __future__ import annotations

from torch.utils.data import DataLoader

from kto_pipeline.cache import CacheTable, Manifest, open_cache
from kto_pipeline.config import TrainConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.objectives import Objective
from kto_pipeline.runtime.launch import print0
from kto_pipeline.scoring.plan import Plan
from kto_pipeline.stages.train.batches import EpochSampler


def open_checked_cache(config: TrainConfig, objective: Objective) -> tuple[CacheTable, int]:
    """The cache (cheap checks always: complete, files, sizes, row counts, schema; sha256 with --verify) and the
    max length to train at."""
    cache = _open_for(config, objective, "--cache", config.cache)
    cached_max = cache.manifest.max_length
    max_length = config.max_length or cached_max
    if max_length > cached_max:
        raise KTOPipelineError(
            f"--max-length {max_length} is above the cache's max length {cached_max}: the reference log-probs "
            f"of longer sequences were never computed. Use --max-length <= {cached_max}, or precompute a new "
            f"cache with --max-length {max_length}."
        )
    return cache, max_length


def _open_for(config: TrainConfig, objective: Objective, flag: str, path: str) -> CacheTable:
    """The cache at `path`, refused where it lacks what the loss family trains on (a pair loss's pairs, KTO's KL
    completions)."""
    cache = open_cache(path, verify=config.verify)
    why = objective.requires(cache.manifest, config.loss_type, flag, path)
    if why:
        raise KTOPipelineError(why)
    return cache


def loaders(
    config: TrainConfig,
    objective: Objective,
    loss,
    cache,
    max_length: int,
    accelerator,
    tokenizer,
    plan: Plan,
):
    """(sampler, train loader, eval loader or None). Each process reads a disjoint part of every global batch from
    the memory-mapped cache. `loss`: the family's settings (`objective.settings`); `plan`: packed or padded, and
    how packed rows attend."""
    items, unit = objective.dataset(cache, max_length), objective.unit
    if len(items) < config.per_device_train_batch_size * accelerator.num_processes:
        raise KTOPipelineError(
            f"the cache has {len(items)} {unit} at max length {max_length}, fewer than one batch "
            f"({config.per_device_train_batch_size} x {accelerator.num_processes} processes). Lower "
            "--per-device-train-batch-size or use more data."
        )
    warning = objective.data_warning(items, loss)
    if warning:
        print0(accelerator, f"warning: {warning}")
    # Micro-batches are packed (no padding) where the model's attention takes a packed layout; otherwise padded,
    # and the shuffled items grouped by length (runs of 50 global batches sorted longest first) to pad less.
    shuffle = config.train_sampling_strategy == "random"
    global_batch = config.per_device_train_batch_size * accelerator.num_processes
    if plan.padded_because is None:
        sampler = EpochSampler(len(items), config.seed, shuffle)
    else:
        sampler = EpochSampler(len(items), config.seed, shuffle, lengths=items.lengths(), group=50 * global_batch)
        print0(accelerator, f"note: {plan.padded_because}: batches are padded, {unit} grouped by length")
    collator = objective.collator(tokenizer.pad_token_id, plan.padded_because is None, plan.attention, loss)
    # On a GPU the batches are collated into pinned host memory and copied without waiting (the accelerator's
    # `non_blocking`, `Engine.make_accelerator`), as transformers' Trainer pins its batches (dataloader_pin_memory),
    # by a loader process that collates the next ones while the device runs this step (--dataloader-num-workers)
    workers = config.dataloader_num_workers
    workers = (0 if accelerator.device.type == "cpu" else 1) if workers is None else workers
    collating = dict(collate_fn=collator, pin_memory=accelerator.device.type == "cuda", num_workers=workers)
    collating |= dict(persistent_workers=True, prefetch_factor=2) if workers else {}
    loader = DataLoader(items, batch_size=config.per_device_train_batch_size, sampler=sampler, **collating)
    eval_items = _open_eval_cache(config, objective, cache.manifest, max_length)
    if eval_items is None:
        return sampler, loader, None
    return sampler, loader, DataLoader(eval_items, batch_size=config.per_device_eval_batch_size, **collating)


def _open_eval_cache(config: TrainConfig, objective: Objective, manifest: Manifest, max_length: int):
    if config.eval_cache is None:
        return None
    eval_cache = _open_for(config, objective, "--eval-cache", config.eval_cache)
    if eval_cache.manifest.tokenizer_hash != manifest.tokenizer_hash:
        raise KTOPipelineError(
            f"--eval-cache {config.eval_cache} was made with another tokenizer than --cache {config.cache}. "
            "Precompute the eval split with the same reference model."
        )
    items = objective.dataset(eval_cache, min(max_length, eval_cache.manifest.max_length))
    if len(items) == 0:
        raise KTOPipelineError(
            f"--eval-cache {config.eval_cache}: no row fits --max-length {max_length} (every prompt is at least "
            "that long). Raise --max-length, or precompute the eval set with shorter prompts."
        )
    return items
