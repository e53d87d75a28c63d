"""Stage 2: train the policy alone against a reference cache.

`train()` locks the output directory (`lock.py`), then `_train()` reads top to bottom: open and check
the cache -> load the policy (never a reference model) -> data loader over the memory-mapped cache ->
optimizer and schedule -> the loop -> the final model. accelerate is used as a library (`prepare`,
`accumulate`, `backward`, `gather`), so the loop is the whole algorithm: nothing happens in callbacks.

Per forward pass, with trl.KTOTrainer's numbers:
  1. score the completions with grad: the micro-batch's prompts and completions packed side by side in
     a few rows, almost no padding (`packing.py`), their keys/values kept;
  2. score the KL completions (prompt_i + completion of partner) without grad, all in one unpadded row, on
     prompt_i's cached keys/values: z0 = clamp(mean over the global batch of (policy_kl_logp - ref_kl_logp), min=0);
  3. `kto_loss` against the cached reference log-probs.
Models whose attention takes no packed layout run padded batches instead, grouped by length.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from kto_pipeline import __version__
from kto_pipeline.cache import CacheTable, open_cache, tokenizer_hash
from kto_pipeline.checkpoint import (
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    save_model,
    skip_model_weights_in_accelerate_state,
)
from kto_pipeline.config import TrainConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.lock import holds_files, main_process_lock
from kto_pipeline.logprobs import PolicyScores, pad_sequences, score_policy, score_sequences
from kto_pipeline.loss import kto_loss
from kto_pipeline.model_card import write_model_card
from kto_pipeline.models import load_model, load_tokenizer
from kto_pipeline.packing import AttentionCosts, Layout, attention_costs, layout_trees, pack_rows, packing_unsupported

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"


# ------------------------------------------------------------------------------------------- data


class CacheRows(Dataset):
    """Rows of a memory-mapped cache, truncated to a train-time `max_length`.

    Truncating at L < the cached max length gives exactly what precomputing at L would have: the
    first L - len(prompt) completion tokens, and as reference log-prob the sum of their cached
    per-token values (a causal model's log-prob of a token does not depend on what follows it).
    Rows whose prompt reaches L are dropped, as precompute would drop them.
    """

    def __init__(self, cache: CacheTable, max_length: int):
        self.table = cache.table
        self.max_length = max_length
        self.truncate = max_length < cache.manifest["settings"]["max_length"]
        prompt_lens = pc.list_value_length(self.table.column("prompt_ids")).to_numpy()
        self.indices = np.flatnonzero(prompt_lens < max_length)
        self.labels = self.table.column("label").to_numpy(zero_copy_only=False)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> np.ndarray:
        """Tokens of each row's prompt + completion (truncated at max_length): for grouping by length."""
        take = self.table.select(["prompt_ids", "completion_ids"]).take(self.indices)
        total = sum(pc.list_value_length(take.column(c)).to_numpy().astype(np.int64) for c in take.column_names)
        return np.minimum(total, self.max_length)

    def prompt_groups(self) -> dict[int, int]:
        """example_id -> a number shared by every row with the same prompt (for pairwise metrics)."""
        groups: dict[tuple[int, ...], int] = {}
        out = {}
        rows = self.table.select(["example_id", "prompt_ids"]).take(self.indices)
        for example_id, prompt in zip(
            rows.column("example_id").to_pylist(), rows.column("prompt_ids").to_pylist(), strict=True
        ):
            out[example_id] = groups.setdefault(tuple(prompt), len(groups))
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.table.slice(int(self.indices[i]), 1).to_pylist()[0]
        if self.truncate:
            room = self.max_length - len(row["prompt_ids"])
            for ids, logps, total in (
                ("completion_ids", "ref_token_logps", "ref_logp"),
                ("kl_completion_ids", "ref_kl_token_logps", "ref_kl_logp"),
            ):
                if len(row[ids]) > room:
                    row[ids] = row[ids][:room]
                    row[logps] = row[logps][:room]
                    row[total] = float(np.sum(np.asarray(row[logps], dtype=np.float32), dtype=np.float32))
        return row


class EpochSampler(Sampler[int]):
    """Seeded shuffle that changes each epoch (or dataset order): reproducible from (seed, epoch).

    The epoch is set with `use_epoch`, not `set_epoch`: accelerate calls `set_epoch` with its own count of
    iterations of a loader, which restarts at 0 for the fresh loader of a resumed run.

    With `lengths` (the padded path), each run of `group` shuffled rows is sorted longest first, so that a
    batch holds rows of similar lengths and little padding (transformers' `group_by_length`).
    """

    def __init__(self, n: int, seed: int, shuffle: bool, lengths: np.ndarray | None = None, group: int = 0):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.lengths, self.group = lengths, group

    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)  # 8 bytes a row, not a list
        if self.lengths is not None and self.group > 1:
            for start in range(0, self.n, self.group):
                chunk = order[start : start + self.group]
                order[start : start + self.group] = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
        return (int(i) for i in order)


LAYOUT_KEY = "layout_"  # batch keys of a packed layout's tensors


@dataclass
class Collator:
    """Rows -> one micro-batch. `packed`: the rows' `(prompt, [completion, KL completion])` trees side by side in
    rows (`packing.pack_rows`), prompts and completions first and the KL completions
    after them (`layout_trees(split_last=True)`); else padded sequences, completions and KL completions apart."""

    pad_id: int
    packed: bool = True
    attention: AttentionCosts | None = None  # `packing.attention_costs` of the model: how wide packed rows should be

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        if self.packed:
            trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
            sizes = [len(p) + len(c) for p, (c, _) in trees]  # the KL completions run apart, in one unpadded row
            layout = layout_trees(trees, pack_rows(sizes, None, self.attention), self.pad_id, split_last=True)
            batch.update({LAYOUT_KEY + k: v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)})
            batch[LAYOUT_KEY + "split"] = torch.tensor(layout.split)
        else:
            prompt_lens = [len(r["prompt_ids"]) for r in rows]
            for prefix, key in (("", "completion_ids"), ("kl_", "kl_completion_ids")):
                padded = pad_sequences([r["prompt_ids"] + r[key] for r in rows], prompt_lens, self.pad_id)
                names = (f"{prefix}input_ids", f"{prefix}attention_mask", f"{prefix}completion_mask")
                batch.update(zip(names, padded, strict=True))
        needed = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) + len(r["kl_completion_ids"]) for r in rows)
        return {
            **batch,
            "label": torch.tensor([r["label"] for r in rows], dtype=torch.bool),
            "ref_logp": torch.tensor([r["ref_logp"] for r in rows], dtype=torch.float32),
            "ref_kl_logp": torch.tensor([r["ref_kl_logp"] for r in rows], dtype=torch.float32),
            "example_id": torch.tensor([r["example_id"] for r in rows], dtype=torch.long),
            "tokens_needed": torch.tensor(needed),  # each prompt once, no padding
        }


def batch_layout(batch: dict[str, torch.Tensor]) -> Layout | None:
    """The packed layout a `Collator(packed=True)` batch carries (None for a padded batch)."""
    if LAYOUT_KEY + "input_ids" not in batch:
        return None
    fields = {k.removeprefix(LAYOUT_KEY): v for k, v in batch.items() if k.startswith(LAYOUT_KEY)}
    fields["split"] = int(fields["split"])
    return Layout(**fields, num_trees=len(batch["label"]), branches=2)


class PolicyScorer(torch.nn.Module):
    """Wraps the causal LM so that scoring goes through `forward` (and thus through DDP/FSDP wrappers)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # FSDP's transformer-based auto wrap looks for the layer classes here
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, batch, with_kl: bool = True, with_stats: bool = True, output_router_logits: bool = False):
        """Completion scores (with grad) and, with `with_kl`, KL completion scores (no grad): `PolicyScores`."""
        layout = batch_layout(batch)
        if layout is not None:
            return score_policy(
                self.model, layout, with_kl, with_stats=with_stats, output_router_logits=output_router_logits
            )
        completions = score_sequences(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            with_stats=with_stats,
            output_router_logits=output_router_logits,
        )
        kl, executed = None, batch["input_ids"].numel()
        if with_kl:
            with torch.no_grad():
                kl = score_sequences(
                    self.model,
                    batch["kl_input_ids"],
                    batch["kl_attention_mask"],
                    batch["kl_completion_mask"],
                    with_stats=False,
                )
            executed += batch["kl_input_ids"].numel()
        return PolicyScores(completions, kl, executed, kl_on_cached_prompt=False)


# -------------------------------------------------------------------------------------- checks


def imbalance_warning(num_desirable: int, num_undesirable: int, desirable_weight: float, undesirable_weight: float):
    """trl's advice (KTO paper eq. 8): desirable_weight * n_D / (undesirable_weight * n_U) in [1, 4/3]."""
    n_d, n_u = max(num_desirable, 1), max(num_undesirable, 1)
    if n_d == n_u:
        return None
    d_lo = round(n_u * undesirable_weight / n_d, 2)
    d_hi = round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo = round(n_d * desirable_weight / n_u / 1.33, 2)
    u_hi = round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (
        f"the data has {num_desirable} desirable and {num_undesirable} undesirable rows, and the weights are "
        f"outside the recommended 1:1 to 4:3 range. Use EITHER --desirable-weight in [{d_lo}, {d_hi}] OR "
        f"--undesirable-weight in [{u_lo}, {u_hi}] (not both)."
    )


def _check_output_dir(out: Path, overwrite: bool) -> None:
    # (a file at --output-dir is refused by the lock, taken before this check)
    if out.is_dir() and holds_files(out) and not overwrite:  # our own lock file does not count
        raise KTOPipelineError(
            f"--output-dir {out} is not empty. Choose a new directory, or pass --overwrite-output-dir to write into it."
        )


# -------------------------------------------------------------------------------------- metrics


class MetricLog:
    """Per-forward-pass metric values, averaged over the forward passes of each logging interval (as trl)."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, value: float) -> None:
        self.values[name].append(value)

    def flush(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self.values.items() if v}
        self.values.clear()
        return out


def batch_metrics(accelerator, loss, z0, labels, logps, rewards, scores) -> dict[str, float]:
    """TRL's metrics for one forward pass, summed across processes before dividing."""
    labels = labels.bool()
    token_labels = labels[scores.sequence]  # each scored token's row label
    mean_logits = scores.mean_logits.detach()

    def total(x: torch.Tensor) -> float:
        return accelerator.gather(x.detach().float().reshape(1)).sum().item()

    n_chosen, n_rejected = total(labels.sum()), total((~labels).sum())
    out = {"loss": accelerator.gather(loss.detach().reshape(1)).mean().item(), "kl": z0.item()}
    for name, sel, n in (("chosen", labels, n_chosen), ("rejected", ~labels, n_rejected)):
        if n > 0:
            out[f"rewards/{name}"] = total(rewards[sel].sum()) / n
            out[f"logps/{name}"] = total(logps.detach()[sel].sum()) / n
            tokens = token_labels if name == "chosen" else ~token_labels
            n_tok = total(tokens.sum())
            if n_tok > 0:
                out[f"logits/{name}"] = total(mean_logits[tokens].sum()) / n_tok
    if n_chosen > 0 and n_rejected > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    n_tok = total(torch.tensor(scores.entropy.numel(), device=labels.device))
    out["entropy"] = total(scores.entropy.sum()) / max(n_tok, 1)
    return out


# -------------------------------------------------------------------------------------- stage 2


@dataclass
class TrainResult:
    output_dir: Path
    global_step: int
    metrics: list[dict[str, float]]
    step_seconds: list[float]  # wall time of each optimizer step of this run (benchmarks, profiling)


def kto_forward(accelerator, scorer, batch, config: TrainConfig, with_stats: bool, output_router_logits: bool = False):
    """One KTO forward pass, shared by training and evaluation: the completions scored (policy, with grad),
    z0 from the KL completions (policy, no grad, averaged over the global batch before the clamp), `kto_loss`.

    Returns (z0, scored: PolicyScores, loss, losses, rewards)."""
    with_kl = config.loss_type == "kto"
    scored = scorer(batch, with_kl, with_stats, output_router_logits)
    z0 = torch.zeros((), device=accelerator.device)
    if with_kl:
        z0 = accelerator.gather((scored.kl.logps - batch["ref_kl_logp"]).mean().detach().reshape(1)).mean().clamp(min=0)
    loss, losses, rewards = kto_loss(
        scored.completions.logps,
        batch["ref_logp"],
        batch["label"],
        z0,
        beta=config.beta,
        loss_type=config.loss_type,
        desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
    )
    return z0, scored, loss, losses, rewards


def pair_accuracy(reward: torch.Tensor, label: torch.Tensor, group: torch.Tensor) -> tuple[float, int]:
    """(fraction, count) of (desirable, undesirable) row pairs sharing a prompt in which the desirable row has the
    higher reward: DPO's `rewards/accuracies` on paired data, blind to a shift of all rewards. (nan, 0) without pairs.

    reward, label, group: (N,); group numbers the prompts.
    """
    same = group[:, None] == group[None, :]  # (N, N); eval sets are small
    pairs = same & label[:, None] & ~label[None, :]  # [i, j]: i desirable, j undesirable, same prompt
    count = int(pairs.sum())
    if count == 0:
        return float("nan"), 0
    wins = (reward[:, None] > reward[None, :]) & pairs
    return wins.sum().item() / count, count


@torch.no_grad()
def evaluate(accelerator, scorer, loader, config: TrainConfig, groups: dict[int, int]) -> dict[str, float]:
    """Metrics over the whole eval set, TRL's names with an `eval_` prefix, plus `eval_reward_accuracy`:
    the fraction of rows whose implicit reward has the sign of its label (desirable > 0 > undesirable),
    and, where prompts have both a desirable and an undesirable row (paired data), `eval_pair_accuracy`:
    how often the desirable answer's reward beats the undesirable one's (see `pair_accuracy`).

    Per-row values are gathered across processes (dropping the rows accelerate repeats to even out the
    last batch), so the result does not depend on the number of processes or the eval batch size;
    only z0 is per batch, as in training.
    """
    was_training = scorer.training
    scorer.eval()
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    kls = []
    for batch in loader:
        z0, scored, _, losses, rewards = kto_forward(accelerator, scorer, batch, config, with_stats=False)
        kls.append(z0.item())
        logps = scored.completions.logps
        for name, value in (("loss", losses), ("reward", rewards), ("logp", logps), ("label", batch["label"])):
            parts[name].append(accelerator.gather_for_metrics(value.detach().float()))
        parts["example_id"].append(accelerator.gather_for_metrics(batch["example_id"]))
    scorer.train(was_training)
    loss, reward, logp = (torch.cat(parts[k]) for k in ("loss", "reward", "logp"))
    label = torch.cat(parts["label"]).bool()
    out = {"eval_loss": loss.mean().item(), "eval_kl": sum(kls) / max(len(kls), 1)}
    for name, sel in (("chosen", label), ("rejected", ~label)):
        if sel.any():
            out[f"eval_rewards/{name}"] = reward[sel].mean().item()
            out[f"eval_logps/{name}"] = logp[sel].mean().item()
    if label.any() and (~label).any():
        out["eval_rewards/margins"] = out["eval_rewards/chosen"] - out["eval_rewards/rejected"]
    out["eval_reward_accuracy"] = torch.where(label, reward > 0, reward < 0).float().mean().item()
    out["eval_rows"] = int(label.numel())
    group = torch.tensor([groups[int(i)] for i in torch.cat(parts["example_id"]).tolist()])
    accuracy, pairs = pair_accuracy(reward.cpu(), label.cpu(), group)
    if pairs:
        out["eval_pair_accuracy"], out["eval_pairs"] = accuracy, pairs
    return out


def _open_eval_cache(config: TrainConfig, manifest: dict, max_length: int) -> CacheRows | None:
    if config.eval_cache is None:
        return None
    eval_cache = open_cache(config.eval_cache, verify=config.verify)
    if eval_cache.manifest["tokenizer"]["hash"] != manifest["tokenizer"]["hash"]:
        raise KTOPipelineError(
            f"--eval-cache {config.eval_cache} was made with another tokenizer than --cache {config.cache}. "
            "Precompute the eval split with the same reference model."
        )
    rows = CacheRows(eval_cache, min(max_length, eval_cache.manifest["settings"]["max_length"]))
    if len(rows) == 0:
        raise KTOPipelineError(
            f"--eval-cache {config.eval_cache}: no row fits --max-length {max_length} (every prompt is at least "
            "that long). Raise --max-length, or precompute the eval set with shorter prompts."
        )
    return rows


def _trackers(config: TrainConfig) -> list[str]:
    return [t.strip() for t in config.report_to.split(",") if t.strip() not in ("", "none")]


def _resolve_precision(config: TrainConfig) -> str:
    if config.fp16:
        if not torch.cuda.is_available():
            raise KTOPipelineError("--fp16 needs a CUDA GPU; on CPU use --bf16 or full precision (--no-bf16).")
        return "fp16"
    bf16 = config.bf16 if config.bf16 is not None else (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return "bf16" if bf16 else "no"


def train(config: TrainConfig) -> TrainResult:
    """Train a policy on a reference cache; writes metrics, checkpoints and the final model to `output_dir`.

    The output directory's lock is taken before any work starts and held until the run ends: a second `train`
    into the same directory refuses at once, naming this one. Only the main process holds it."""
    with main_process_lock(config.output_dir, "train", label="--output-dir"):
        return _train(config)


def _train(config: TrainConfig) -> TrainResult:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import gather_object, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    out = Path(config.output_dir)
    resume_dir = resolve_resume(out, config.resume, config.resume_from)
    if resume_dir is None or resume_dir.parent.resolve() != out.resolve():
        _check_output_dir(out, config.overwrite_output_dir)  # a checkpoint of this same dir may continue it

    # --- the cache: cheap checks always (complete, files, sizes, row counts, schema); sha256 with --verify
    cache = open_cache(config.cache, verify=config.verify)
    manifest = cache.manifest
    cached_max = manifest["settings"]["max_length"]
    max_length = config.max_length or cached_max
    if max_length > cached_max:
        raise KTOPipelineError(
            f"--max-length {max_length} is above the cache's max length {cached_max}: the reference log-probs "
            f"of longer sequences were never computed. Use --max-length <= {cached_max}, or precompute a new "
            f"cache with --max-length {max_length}."
        )
    model_name = config.model or manifest["reference_model"]["name_or_path"]
    revision = None if config.model else manifest["reference_model"].get("revision")

    # accelerate keeps one global state per process; reset it (not the process group) so that several runs
    # in one process (a sweep through the Python API) may each choose their own precision.
    trackers = _trackers(config)
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(
        mixed_precision=_resolve_precision(config),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        log_with=trackers or None,
        project_dir=str(out / "tensorboard"),
    )
    skip_model_weights_in_accelerate_state(accelerator)
    set_seed(config.seed)
    if accelerator.is_main_process:
        print(f"kto-pipeline train {__version__}\n{config.describe()}", flush=True)

    # --- the policy (and only the policy), with the cache's tokenizer
    tokenizer = load_tokenizer(model_name, revision, config.trust_remote_code)
    if tokenizer_hash(tokenizer) != manifest["tokenizer"]["hash"]:
        raise KTOPipelineError(
            f"the tokenizer of --model {model_name} differs from the one the cache was made with "
            f"({manifest['tokenizer']['name_or_path']}): vocabulary, special tokens or chat template. Token ids "
            "would not mean the same thing. Train a model that shares the cache's tokenizer, or precompute a "
            "new cache with this model."
        )
    model = load_model(model_name, torch.float32, revision, config.trust_remote_code)
    model.config.use_cache = False
    _disable_dropout(model)  # the base model's; LoRA's own dropout (--lora-dropout) is added after
    aux_coef = _router_aux_coef(model, config)
    if config.gradient_checkpointing:
        # recompute each layer's activations in the backward instead of keeping them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_r is not None:
        model = _add_lora(model, config)

    # --- data: each process reads a disjoint part of every global batch from the memory-mapped cache
    rows = CacheRows(cache, max_length)
    if len(rows) < config.per_device_train_batch_size * accelerator.num_processes:
        raise KTOPipelineError(
            f"the cache has {len(rows)} rows at max length {max_length}, fewer than one batch "
            f"({config.per_device_train_batch_size} x {accelerator.num_processes} processes). Lower "
            "--per-device-train-batch-size or use more data."
        )
    n_desirable = int(rows.labels.sum())
    warning = imbalance_warning(
        n_desirable, len(rows) - n_desirable, config.desirable_weight, config.undesirable_weight
    )
    if warning and accelerator.is_main_process:
        logger.warning(warning)
        print(f"warning: {warning}", flush=True)
    # Micro-batches are packed (no padding) where the model's attention takes a packed layout; otherwise padded,
    # and the shuffled rows grouped by length (runs of 50 global batches sorted longest first) to pad less.
    unpacked_because = packing_unsupported(model)
    shuffle = config.train_sampling_strategy == "random"
    global_batch = config.per_device_train_batch_size * accelerator.num_processes
    if unpacked_because is None:
        sampler = EpochSampler(len(rows), config.seed, shuffle)
    else:
        sampler = EpochSampler(len(rows), config.seed, shuffle, lengths=rows.lengths(), group=50 * global_batch)
        if accelerator.is_main_process:
            print(f"note: {unpacked_because}: batches are padded, rows grouped by length", flush=True)
    collator = Collator(tokenizer.pad_token_id, unpacked_because is None, attention_costs(model, accelerator.device))
    loader = DataLoader(rows, batch_size=config.per_device_train_batch_size, sampler=sampler, collate_fn=collator)

    eval_rows = _open_eval_cache(config, manifest, max_length)
    eval_loader = None
    eval_groups = eval_rows.prompt_groups() if eval_rows is not None else {}
    if eval_rows is not None:
        eval_loader = DataLoader(eval_rows, batch_size=config.per_device_eval_batch_size, collate_fn=collator)

    # --- optimizer and schedule: transformers.Trainer's default, AdamW with its fused kernel (`adamw_torch_fused`,
    # the update trl runs), no decay on biases and norm weights. One kernel for all parameters: on SmolLM2-135M
    # on the CPU a step takes 0.11 s against 0.54 s for the multi-tensor one.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        fused=True,
    )
    scorer = PolicyScorer(model)
    scorer, optimizer, loader = accelerator.prepare(scorer, optimizer, loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare_data_loader(eval_loader)
    steps_per_epoch = max(math.ceil(len(loader) / config.gradient_accumulation_steps), 1)
    total_steps = _planned_steps(config.max_steps, config.num_train_epochs, steps_per_epoch)
    warmup_steps = math.ceil(config.warmup_ratio * total_steps)
    scheduler = get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
    )
    # Stepped by hand once per optimizer step (not handed to accelerate), but saved with its state.
    accelerator.register_for_checkpointing(scheduler)

    # --- where to start: from scratch, or from a checkpoint (weights, optimizer, scheduler, RNG, data position)
    log = MetricLog()
    history: list[dict[str, float]] = []
    global_step, epoch, skip_batches, fractional_epoch = 0, 0, 0, 0.0
    if resume_dir is not None:
        state = load_checkpoint(accelerator, scorer, resume_dir)
        _check_resume_compatible(state.get("run_config", {}), config, resume_dir)
        global_step, epoch, skip_batches = state["global_step"], state["epoch_index"], state["batches_in_epoch"]
        fractional_epoch, history = state["epoch"], state["log_history"]
        log.values.update(state.get("pending_metrics", {}))
        if global_step > total_steps:
            raise KTOPipelineError(
                f"cannot resume from {resume_dir}: it is at step {global_step}, past this run's {total_steps} steps. "
                "Raise --max-steps (or --num-train-epochs), or pick an earlier checkpoint with --resume-from."
            )
        if (
            global_step == total_steps
            and resume_dir.parent.resolve() == out.resolve()
            and _finished_at(out) == total_steps
        ):
            if accelerator.is_main_process:
                print(
                    f"nothing to do: {out} already finished its {total_steps} steps ({resume_dir.name} is its last "
                    "checkpoint). To train on, raise --max-steps (or --num-train-epochs) and --resume again.",
                    flush=True,
                )
            return TrainResult(output_dir=out, global_step=global_step, metrics=history, step_seconds=[])
        if accelerator.is_main_process:
            print(f"resuming from {resume_dir} at step {global_step}", flush=True)
        saved = state.get("run_config", {})
        was_total = state.get("max_steps") or _planned_steps(
            saved.get("max_steps", -1), saved.get("num_train_epochs", 1.0), steps_per_epoch
        )
        if was_total != total_steps and global_step < total_steps:
            # The optimizer's saved rate came from the old total's schedule (0 at the end of a linear decay):
            # recompute this step's rate on the new schedule, as a run planned with the new total would have it.
            was_rate = optimizer.param_groups[0]["lr"]
            scheduler.last_epoch -= 1
            scheduler.step()
            if accelerator.is_main_process:
                print(
                    f"note: the run now has {total_steps} steps (its checkpoint's run had {was_total}): the "
                    f"{config.lr_scheduler_type} learning-rate schedule{' and its warmup' if warmup_steps else ''} "
                    f"now spans {total_steps} steps, so step {global_step + 1} trains at "
                    f"{scheduler.get_last_lr()[0]:.3g} (the old schedule's next rate: {was_rate:.3g}).",
                    flush=True,
                )
    if accelerator.is_main_process:  # outputs are created only once every check has passed
        out.mkdir(parents=True, exist_ok=True)
        if resume_dir is None:  # a fresh run in a reused dir: stale checkpoints must not mix with its own
            for stale in [*out.glob("checkpoint-*"), *out.glob(".checkpoint-*.tmp")]:
                shutil.rmtree(stale)
        # the run counts as finished (sweep's marker) only once it ends, a resumed or extended run included
        (out / "trainer_state.json").unlink(missing_ok=True)
        config.save(out / RUN_CONFIG_FILE)
        (out / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in history))
    if trackers:
        hparams = {k: (v if isinstance(v, int | float | str | bool) else str(v)) for k, v in config.to_dict().items()}
        accelerator.init_trackers("kto-pipeline", config=hparams)

    def emit(record: dict[str, float]) -> None:
        """One metrics record: to metrics.jsonl (main process) and to the trackers."""
        history.append(record)
        if accelerator.is_main_process:
            with open(out / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
        if trackers:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    # --- the loop
    grad_norm = None
    bar = tqdm(
        total=total_steps, initial=global_step, desc="train", unit="step", disable=not accelerator.is_local_main_process
    )
    started = step_started = time.perf_counter()
    step_seconds: list[float] = []
    # work counters of this run, this process: tokens the forwards ran vs the tokens the rows need (P + C + K)
    tokens_executed = tokens_needed = rows_seen = 0
    kl_on_cached_prompt = False
    scorer.train()
    while global_step < total_steps:
        sampler.use_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip_batches) if skip_batches else loader
        for micro_step, batch in enumerate(batches, start=skip_batches):
            with accelerator.accumulate(scorer):
                z0, scored, loss, _, rewards = kto_forward(
                    accelerator, scorer, batch, config, with_stats=True, output_router_logits=aux_coef != 0
                )
                scores = scored.completions
                tokens_executed += scored.tokens_executed
                tokens_needed += int(batch["tokens_needed"])
                rows_seen += len(batch["label"])
                kl_on_cached_prompt = scored.kl_on_cached_prompt
                if scores.aux_loss is not None:  # MoE: keep the experts' load balanced, as the model's own loss does
                    loss = loss + aux_coef * scores.aux_loss
                    log.add("aux_loss", accelerator.gather(scores.aux_loss.detach().reshape(1)).mean().item())
                # every process must take the same branch, or the others would wait forever in a collective
                if not torch.isfinite(accelerator.gather(loss.detach().reshape(1))).all():
                    ids = sorted(gather_object(batch["example_id"].tolist()))
                    raise KTOPipelineError(
                        f"non-finite loss at step {global_step + 1}, batch example ids {ids}. Lower "
                        "--learning-rate or check these rows; the last checkpoint is intact."
                    )
                for name, value in batch_metrics(
                    accelerator, loss, z0, batch["label"], scores.logps, rewards, scores
                ).items():
                    log.add(name, value)
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    grad_norm = float(accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm))
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step used (what trl logs)
            scheduler.step()
            global_step += 1
            now = time.perf_counter()
            step_seconds.append(now - step_started)
            step_started = now
            bar.update(1)
            elapsed = max(now - started, 1e-9)
            bar.set_postfix_str(
                f"{rows_seen * accelerator.num_processes / elapsed:.1f} rows/s, "
                f"{tokens_needed * accelerator.num_processes / elapsed:.0f} tokens/s"
            )
            fractional_epoch = epoch + (micro_step + 1) / len(loader)
            if global_step % config.logging_steps == 0 or global_step == total_steps:
                record = log.flush()
                record.update(
                    {
                        "learning_rate": learning_rate,
                        **({"grad_norm": grad_norm} if grad_norm is not None else {}),
                        "epoch": round(fractional_epoch, 4),
                        "step": global_step,
                    }
                )
                emit(record)
            last_step = global_step >= total_steps
            if eval_loader is not None and (last_step or (config.eval_steps and global_step % config.eval_steps == 0)):
                emit(
                    {
                        **evaluate(accelerator, scorer, eval_loader, config, eval_groups),
                        "epoch": round(fractional_epoch, 4),
                        "step": global_step,
                    }
                )
            # every N steps and at the last one (as transformers' Trainer), so that a finished run can be extended
            if config.save_steps and (global_step % config.save_steps == 0 or last_step):
                epoch_done = micro_step + 1 == len(loader)
                state = {
                    "global_step": global_step,
                    "max_steps": total_steps,  # the schedule's total: a resume with another total says so
                    "epoch": fractional_epoch,
                    "epoch_index": epoch + 1 if epoch_done else epoch,
                    "batches_in_epoch": 0 if epoch_done else micro_step + 1,
                    "log_history": history,
                    "pending_metrics": dict(log.values),
                }
                save_checkpoint(
                    accelerator, scorer, tokenizer, out, global_step, state, config.to_dict(), config.save_total_limit
                )
            if last_step:
                break
        skip_batches = 0
        epoch += 1
    bar.close()

    accelerator.wait_for_everyone()
    if trackers:
        accelerator.end_training()
    save_model(accelerator, scorer, tokenizer, out, config.to_dict())
    if config.merge and accelerator.is_main_process:
        merged = accelerator.unwrap_model(scorer).model.merge_and_unload()
        merged.save_pretrained(out / "merged")
        tokenizer.save_pretrained(out / "merged")
    executed, needed = (sum(gather_object([x])) for x in (tokens_executed, tokens_needed))
    state = {
        "global_step": global_step,
        "epoch": fractional_epoch,
        "log_history": history,
        "train_seconds": round(time.perf_counter() - started, 3),
        # this run's work (since a resume, if resumed): forward tokens run vs each prompt once, no padding
        "tokens_executed": executed,
        "tokens_needed": needed,
        "token_efficiency": round(needed / max(executed, 1), 4),
        "packing": "packed" if unpacked_because is None else f"padded ({unpacked_because})",
        "kl_forward": (
            "on the prompts' cached keys/values"
            if kl_on_cached_prompt
            else "with the prompts run again"
            if config.loss_type == "kto"
            else "none (loss without KL)"
        ),
    }
    if accelerator.is_main_process:
        (out / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        card = dict(
            chat_template=tokenizer.chat_template is not None,
            num_processes=accelerator.num_processes,
            precision=accelerator.mixed_precision,
        )
        write_model_card(out, config.to_dict(), manifest, history, adapter=config.lora_r is not None, **card)
        if config.merge:
            write_model_card(out / "merged", config.to_dict(), manifest, history, adapter=False, **card)
        print(
            f"train finished: {global_step} steps in {state['train_seconds']:.1f} s; model and its card "
            f"(README.md) in {out.resolve()}\n"
            f"  efficiency   {state['token_efficiency']:.1%}: {needed} tokens needed (each prompt once, no padding) "
            f"/ {executed} run in forwards; batches {state['packing']}, KL forward {state['kl_forward']}",
            flush=True,
        )
    accelerator.wait_for_everyone()
    return TrainResult(output_dir=out, global_step=global_step, metrics=history, step_seconds=step_seconds)


def _planned_steps(max_steps: int, num_train_epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of a run: --max-steps if > 0, else --num-train-epochs passes (at least 1 step)."""
    return max_steps if max_steps > 0 else max(math.ceil(num_train_epochs * steps_per_epoch), 1)


def _finished_at(out: Path) -> int | None:
    """The step at which the run in `out` finished (its trainer_state.json), or None if it has not."""
    try:
        return json.loads((out / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# settings that fix what a checkpoint's step and data position mean; resuming with others would be wrong
RESUME_INVARIANTS = (
    "cache",
    "model",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "seed",
    "train_sampling_strategy",
    "lora_r",
    "lora_target_modules",
)


def _check_resume_compatible(saved: dict, config: TrainConfig, path: Path) -> None:
    diff = [
        f"--{k.replace('_', '-')}: checkpoint {saved[k]!r}, now {getattr(config, k)!r}"
        for k in RESUME_INVARIANTS
        if k in saved and saved[k] != getattr(config, k)
    ]
    if diff:
        raise KTOPipelineError(
            f"cannot resume from {path}: it was trained with other settings:\n  - "
            + "\n  - ".join(diff)
            + "\nResume with the original settings, or start a new run."
        )


def _router_aux_coef(model, config: TrainConfig) -> float:
    """The MoE load-balancing weight (as trl): the flag's, else the model config's; 0 when not a MoE model."""
    text_config = model.config.get_text_config()
    is_moe = hasattr(text_config, "output_router_logits")
    if config.router_aux_loss_coef and not is_moe:
        raise KTOPipelineError(
            f"--router-aux-loss-coef {config.router_aux_loss_coef}: {type(model).__name__} is not a "
            "mixture-of-experts model that returns router logits, so there is no load-balancing loss to weight."
        )
    if not is_moe:
        return 0.0
    coef = config.router_aux_loss_coef
    return float(getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef)


def _add_lora(model, config: TrainConfig):
    """Wrap the policy with fresh PEFT LoRA adapters (B = 0, so the policy starts equal to the reference)."""
    from peft import LoraConfig, get_peft_model

    targets = config.lora_target_modules
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if config.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a grad path
    return model


def _disable_dropout(model) -> None:
    """KTO compares log-probs with the reference's, which were computed without dropout (as trl does)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
