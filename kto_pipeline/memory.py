"""Peak accelerator memory of one training step, simulated on a machine without an accelerator.

`kto-pipeline estimate-memory` answers "does this fit on my GPU?" in seconds, for a model of which only the
config is known (no weights are read). It runs one real training step of the model's architecture, in which
only the shapes exist:

- the model is built on the meta device and materialized as fake tensors (`FakeTensorMode`): every parameter,
  activation, gradient and optimizer state has its real shape and dtype, and none takes memory;
- the step runs outside the fake mode, through the code `train` runs (`Collator` -> `PolicyScorer` ->
  `kto_forward`, `accelerator.backward`, clipping, fused AdamW; FSDP2 through `sharding.shard_model`). An op
  that touches a fake tensor runs under the fake mode; an op on real tensors runs for real. So the
  data-dependent host work (the packed layout, the masks' indices, `nonzero`) is computed from real token
  lists, and the model's math on fake tensors: the shapes are those of the real step;
- torch's memory tracker (`torch.distributed._tools.MemTracker`, `FSDPMemTracker` on a fake process group
  for FSDP2) counts every storage alive at each op, by category (parameters, gradients, optimizer state,
  activations, temporaries), and keeps the peak.

The CPU stands in for the accelerator (fake CUDA tensors need a CUDA build of torch): dtypes and shapes are
the GPU's, and the code's device decisions are the GPU's (attention on the dense mask, never tree by tree).
What is not simulated: the CUDA caching allocator's rounding and fragmentation (reserved > allocated), the
CUDA context, cuBLAS/NCCL workspaces and kernels' internal scratch. The tracker counts allocated tensors,
what `torch.cuda.max_memory_allocated` reports.

With `--against-trl` it also simulates trl.KTOTrainer's step (online: a reference model beside the policy)
on the same rows. This package does not import trl, so that step is modelled here, after trl 1.16's
`KTOTrainer._compute_loss` and its fused LM head (`trl/trainer/utils.py:add_fused_lm_head`,
`trl/kernels/chunked_logprob.py`); benchmarks/bench_memory.py and tests/test_estimate_memory.py hold the
model to the real trl run under the same simulation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kto_pipeline.config import DATA, LORA, MODEL, OPTIMISATION, OUTPUT, _check, _ConfigMixin, _help
from kto_pipeline.errors import KTOPipelineError

LENGTHS = ("full", "kto-mix")
KTO_MIX_ROWS = 14549  # rows of the kto-mix train split (its card)
GIB = 1 << 30
# the breakdown's categories, from the tracker's (MemTracker's and FSDPMemTracker's reference types)
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
_CATEGORY_OF = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "temporaries",
    "Reduce Scatter": "temporaries",
    "Other": "temporaries",
    "Inputs": "temporaries",
}
# With FSDP2's CPUOffloadPolicy these live in host memory: they do not count towards the device's peak.
_OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


@dataclass
class MemoryEstimateConfig(_ConfigMixin):
    """`kto-pipeline estimate-memory`: the peak accelerator memory per device of one `train` step. The flags
    that shape memory are named as `train`'s."""

    model: str = field(
        **_help("Model: a local directory with config.json, or a hub id (only its config is read).", panel=MODEL)
    )
    per_device_train_batch_size: int = field(default=8, **_help("Rows per forward pass and device.", panel=DATA))
    max_length: int = field(default=1024, **_help("Tokens of prompt + completion per row, at most.", panel=DATA))
    lengths: str = field(
        default="full",
        **_help(
            "Row lengths: full (every row and KL row at --max-length, a quarter of it prompt: the largest batch a "
            "run can meet) or kto-mix (the largest batch of an epoch of kto-mix-14k-like lengths, seeded).",
            panel=DATA,
        ),
    )
    bf16: bool = field(
        default=True, **_help("bf16 autocast over float32 weights (else float32 throughout).", panel=OPTIMISATION)
    )
    gradient_checkpointing: bool = field(
        default=False, **_help("Recompute activations in the backward pass.", panel=OPTIMISATION)
    )
    fsdp_world_size: int = field(
        default=1, **_help("Shard with FSDP2 over this many devices (1: no sharding).", panel=OPTIMISATION)
    )
    cpu_offload: bool = field(
        default=False,
        **_help(
            "With --fsdp-world-size > 1: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer "
            "state in host memory).",
            panel=OPTIMISATION,
        ),
    )
    lora_r: int | None = field(
        default=None,
        **_help("Train LoRA adapters of this rank (all linear layers) instead of all weights.", panel=LORA),
    )
    against_trl: bool = field(
        default=False,
        **_help(
            "Also simulate trl.KTOTrainer online (a reference model beside the policy) on the same rows.", panel=OUTPUT
        ),
    )
    json: bool = field(default=False, **_help("Print one JSON line instead of a table.", panel=OUTPUT))

    def __post_init__(self) -> None:
        _check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be at least 1")
        _check(self.max_length >= 8, "max_length", f"must be at least 8, got {self.max_length}")
        _check(self.lengths in LENGTHS, "lengths", f"must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        _check(self.fsdp_world_size >= 1, "fsdp_world_size", "must be at least 1")
        _check(not self.cpu_offload or self.fsdp_world_size > 1, "cpu_offload", "needs --fsdp-world-size > 1")
        _check(self.lora_r is None or self.lora_r >= 1, "lora_r", "must be >= 1")
        _check(
            self.lora_r is None or self.fsdp_world_size == 1,
            "lora_r",
            "is simulated on one device only; drop --fsdp-world-size",
        )
        _check(
            not (self.against_trl and self.fsdp_world_size > 1),
            "against_trl",
            "compares on one device only; drop --fsdp-world-size",
        )


@dataclass(frozen=True)
class StepSettings:
    """What shapes a step's memory besides the model and the rows."""

    bf16: bool = True
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    fsdp_world_size: int = 1
    cpu_offload: bool = False
    device_type: str = "cuda"  # whose device decisions the code takes (attention tree by tree only on "cpu")
    optimizer: str = "adamw"  # train's fused AdamW, or "bnb-adamw8bit" (bitsandbytes' 8-bit AdamW: a what-if)


@dataclass
class StepMemory:
    """The peak of one step on one device, and what was alive at that moment (bytes)."""

    peak_bytes: int
    breakdown: dict[str, int]  # CATEGORIES -> bytes at the peak
    before_step_bytes: int  # alive when the step starts: parameters, optimizer state (and LoRA's frozen base)
    tokens_with_grad: int  # tokens the forward with gradients ran (padding included)
    tokens_executed: int  # every token any forward ran (padding, the KL and reference forwards included)
    top: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # largest live tensors at the peak

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ inputs


def load_model_config(name: str):
    """The transformers config of `--model` (a directory with config.json, or a hub id): no weights are read."""
    from transformers import AutoConfig

    from kto_pipeline.models import check_model_path

    check_model_path(name, "--model")
    if os.path.isdir(os.path.expanduser(name)) and not os.path.exists(
        os.path.join(os.path.expanduser(name), "config.json")
    ):
        raise KTOPipelineError(
            f"--model {name}: a LoRA adapter directory; pass the base model it was trained from "
            "(its adapter_config.json names it) with --lora-r"
        )
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(name))
    except Exception as exc:
        raise KTOPipelineError(f"--model {name}: could not read its config ({type(exc).__name__}: {exc})") from exc


def synthetic_rows(
    batch_size: int, max_length: int, lengths: str, vocab_size: int, seed: int = 0
) -> list[dict[str, Any]]:
    """One micro-batch of cache rows (what `CacheRows` yields) with random token ids.

    `full`: every prompt + completion fills `max_length`, a quarter of it prompt, and every KL completion (another
    row's completion) fills it too: the largest batch a run can meet.
    `kto-mix`: the largest batch (most prompt + completion tokens at `max_length`) of one shuffled epoch of a
    dataset like trl-lib/kto-mix-14k: a run's peak is its largest batch's. kto-mix is argilla's dpo-mix-7k
    unpaired (Capybara, Orca and UltraFeedback chats); its card gives 53.4 MB of text for 14,549 rows, about
    3.7 kB a row, so about 900 tokens of prompt + completion at ~4 bytes a token; its length histogram is not at
    hand here. So: 14,549 rows, prompt + completion log-normal with median 600 tokens and sigma 0.8 (mean ~830, a
    long tail of multi-turn Capybara prompts), the prompt a Beta(2, 3) share of it (mean 40%), truncated at
    `max_length` as precompute truncates (the completion's end is cut; rows whose prompt reaches `max_length`
    are dropped).

    KL partners: each row takes the previous row's completion (trl's rotation within a batch; precompute fixes
    partners over the whole dataset, which gives the same length distribution)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if lengths == "full":
        prompt = max(max_length // 4, 1)
        shapes = [(prompt, max_length - prompt)] * batch_size
    else:
        total = np.maximum(rng.lognormal(math.log(600), 0.8, KTO_MIX_ROWS), 16).astype(np.int64)
        prompt = np.maximum((total * rng.beta(2, 3, KTO_MIX_ROWS)).astype(np.int64), 1)
        keep = prompt < max_length
        prompt, completion = prompt[keep], np.maximum(np.minimum(total - prompt, max_length - prompt)[keep], 1)
        order = rng.permutation(len(prompt))[: len(prompt) // batch_size * batch_size].reshape(-1, batch_size)
        biggest = order[np.argmax((prompt + completion)[order].sum(1))]
        shapes = [(int(prompt[i]), int(completion[i])) for i in biggest]
    rows = []
    for i, (p, c) in enumerate(shapes):
        rows.append(
            {
                "example_id": i,
                "prompt_ids": rng.integers(0, vocab_size, p).tolist(),
                "completion_ids": rng.integers(0, vocab_size, c).tolist(),
                "label": i % 2 == 0,
                "ref_logp": -100.0,
                "ref_kl_logp": -100.0,
            }
        )
    for i, row in enumerate(rows):
        partner = rows[i - 1]["completion_ids"] if len(rows) > 1 else row["completion_ids"]
        if lengths == "full":  # fill the row: the partner's completion, repeated if short
            room = max_length - len(row["prompt_ids"])
            partner = (partner * (room // len(partner) + 1))[:room]
        row["kl_completion_ids"] = partner[: max_length - len(row["prompt_ids"])]
    return rows


# ------------------------------------------------------------------------------------------ trackers


class _NoHook:
    def remove(self) -> None:
        pass


class _PeakOnly:
    """MemTracker keeps a peak per module too, walking every module it has seen at every op (O(ops x modules):
    a minute for a 24-layer step). Only the step's peak is needed: this keeps that, and nothing else.

    With `offload`, the categories FSDP2's CPUOffloadPolicy keeps in host memory do not count towards it.
    With `attribute_at` (bytes, from a first run of the same deterministic step), the live tensors are listed
    when the peak is reached: which module's which op made each, its shape and dtype."""

    offload: bool = False
    attribute_at: int | None = None

    def _device_total(self, snap: dict) -> int:
        total = snap["Total"]
        if self.offload:
            total -= sum(v for k, v in snap.items() if k != "Total" and str(k.value) in _OFFLOADED)
        return total

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            total = self._device_total(snap)
            if self._peak_mem.get(dev, -1) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)
                if self.attribute_at is not None and self.top is None and total >= self.attribute_at:
                    self.top = self._live_tensors()

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # frozen parameters (a reference model, LoRA's base) get no gradient, and refuse a gradient hook
        for p in module.parameters():
            if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs) -> None:
        # A module called again in the forward keeps its first call's stats: MemTracker would refuse a root
        # module's second call (an iteration, it assumes), but trl calls its policy twice a step (KL, then
        # completions). The peak does not depend on per-module stats.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t) -> None:
        super()._track(reftype, t)
        if self.attribute_at is None:
            return
        from torch.distributed._tools.common_utils import get_untyped_storages

        for st in get_untyped_storages(t):
            if st not in self._labels:
                parents = self._mod_tracker.parents
                module = max(parents, key=lambda p: p.count(".")) if parents else "-"
                self._labels[st] = (module, str(getattr(self, "_op", "-")), tuple(t.shape), str(t.dtype))

    def _live_tensors(self) -> list[dict[str, Any]]:
        groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for st, (winfo, _) in self._WINFO.items():
            if self.offload and str(winfo.reftype.value) in _OFFLOADED:
                continue
            module, op, shape, dtype = self._labels.get(st, ("-", "-", "-", "-"))
            key = (str(winfo.reftype.value), module_kind(module), op, str(shape), dtype)
            groups[key][0] += winfo.mem_consumed
            groups[key][1] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
        return [
            {"category": c, "module": m, "op": o, "shape": s, "dtype": d, "bytes": b, "count": n}
            for (c, m, o, s, d), (b, n) in rows[:20]
        ]


def module_kind(fqn: str) -> str:
    """`model.model.layers.7.mlp.down_proj` -> `model.model.layers.*.mlp.down_proj` (layers grouped)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _tracker(fsdp_root=None, optimizer=None, offload: bool = False, attribute_at: int | None = None):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    base = MemTracker if fsdp_root is None else FSDPMemTracker
    cls = type("PeakTracker", (_PeakOnly, base), {})
    tracker = cls() if fsdp_root is None else cls(fsdp_root, optimizer)
    tracker.offload, tracker.attribute_at, tracker.top = offload, attribute_at, None
    tracker._labels = WeakIdKeyDictionary()
    return tracker


def _breakdown(snap: dict, offload: bool) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name == "Total" or (offload and name in _OFFLOADED):
            continue
        out[_CATEGORY_OF[str(name)]] += value
    return out


# ------------------------------------------------------------------------------------------ the model


@contextmanager
def device_decisions(device_type: str):
    """Within the block, the scoring decides as it would on `device_type`: on a GPU attention runs on the dense
    mask (`attention.tree_blocks_on` says no), whatever device the simulation's tensors are on."""
    from kto_pipeline.scoring import attention

    original = attention.tree_blocks_on
    if device_type != "cpu":
        attention.tree_blocks_on = lambda model, device: original(model, device_type)
    try:
        yield
    finally:
        attention.tree_blocks_on = original


def fake_mode():
    """A FakeTensorMode that takes real tensors as inputs (the layouts, the padded batches) and indexes fake
    tensors with real boolean masks: `hidden[mask]`'s shape depends on the mask's values, which a fake mask
    does not have (`nonzero` raises DynamicOutputShapeException); a real one does, so its indices are computed
    for real, as they would be on the device."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    class RealMasksFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index.Tensor:
                target, indices = args[0], list(args[1])
                real_masks = [
                    i for i in indices if i is not None and not isinstance(i, FakeTensor) and i.dtype == torch.bool
                ]
                if real_masks:
                    expanded = []
                    for i in indices:
                        if i is not None and not isinstance(i, FakeTensor) and i.dtype == torch.bool:
                            expanded.extend(i.nonzero(as_tuple=True))
                        else:
                            expanded.append(i)
                    args = (target, expanded, *args[2:])
            return super().__torch_dispatch__(func, types, args, kwargs)

    return RealMasksFakeMode(allow_non_fake_inputs=True)


def build_model(model_config, settings: StepSettings, fake, seed: int = 0):
    """The policy as `train` prepares it (float32 weights, no dropout, no KV cache; gradient checkpointing and
    LoRA as asked), on fake tensors under `fake` (a FakeTensorMode), or real seeded weights with `fake=None`."""
    import torch
    from transformers import AutoModelForCausalLM

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.scoring.attention import checkpointing_kwargs
    from kto_pipeline.stages.train.stage import _add_lora, _disable_dropout

    config = type(model_config).from_dict(model_config.to_dict())  # a copy: the model may change it
    lora = None
    if settings.lora_r is not None:
        lora = TrainConfig(
            cache="-", output_dir="-", lora_r=settings.lora_r, gradient_checkpointing=settings.gradient_checkpointing
        )

    def prepare(model):  # as train._load_policy, in its order
        model.config.use_cache = False
        _disable_dropout(model)
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(model))
        return model if lora is None else _add_lora(model, lora)

    if fake is None:
        torch.manual_seed(seed)
        return prepare(AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    # On the meta device first, LoRA's adapters included (peft moves each adapter to its base layer's device, which
    # a fake parameter refuses: `_apply(): Couldn't swap`), then every tensor materialized fake at once.
    with torch.device("meta"):
        model = prepare(AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    with fake:
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty materializes tied weights one by one
    return model


def _init_optimizer_state(model, optimizer, fake) -> None:
    """AdamW creates its moments at its first step: take one with zero gradients, so that the step measured is a
    steady one (moments alive from its start), as every step after the first."""
    import torch

    with fake if fake is not None else torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


@contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` that communicates nothing (torch's "fake" backend): this process plays
    rank 0 of FSDP2, each collective's output has its real shape."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise KTOPipelineError("estimate-memory with --fsdp-world-size runs in a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _offload_unpinned():
    """FSDP2's CPUOffloadPolicy pins its host copies; fake tensors cannot be pinned (NYI: aten._pin_memory).
    Pinned or not, they are host memory, which the device's peak leaves out."""
    import functools

    import torch.distributed.fsdp as fsdp

    original = fsdp.CPUOffloadPolicy
    fsdp.CPUOffloadPolicy = functools.partial(original, pin_memory=False)
    try:
        yield
    finally:
        fsdp.CPUOffloadPolicy = original


def _accelerator(mixed_precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(mixed_precision=mixed_precision, cpu=True)


# ------------------------------------------------------------------------------------------ our step


def simulate_ours(
    model_config, rows: list[dict[str, Any]], settings: StepSettings, fake=True, attribute: bool = False
) -> StepMemory:
    """Peak memory of one `train` step on `rows`: the step `train_step` runs (forward, backward, clipping,
    AdamW), on fake tensors (`fake=True`) or real ones (`fake=False`, the CPU check). `attribute`: also list
    the largest tensors alive at the peak (runs the step twice)."""
    if settings.fsdp_world_size > 1:
        with fake_process_group(settings.fsdp_world_size):
            return _simulate_ours(model_config, rows, settings, fake, attribute)
    return _simulate_ours(model_config, rows, settings, fake, attribute)


def _simulate_ours(model_config, rows, settings: StepSettings, fake: bool, attribute: bool) -> StepMemory:
    first = _run_ours(model_config, rows, settings, fake, None)
    if not attribute:
        return first
    second = _run_ours(model_config, rows, settings, fake, first.peak_bytes)
    assert second.peak_bytes == first.peak_bytes, "the simulated step is deterministic"
    return second


def _run_ours(model_config, rows, settings: StepSettings, fake: bool, attribute_at: int | None) -> StepMemory:
    import torch

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.scoring.attention import attention_costs
    from kto_pipeline.sharding import Engine, autocast_forward, clip_grad_norm, shard_model
    from kto_pipeline.stages.train.batches import Collator, PolicyScorer
    from kto_pipeline.stages.train.kto_step import kto_forward

    mode = fake_mode() if fake else None
    config = TrainConfig(cache="-", output_dir="-", bf16=settings.bf16, per_device_train_batch_size=max(len(rows), 2))
    precision = "bf16" if settings.bf16 else "no"
    with device_decisions(settings.device_type):
        model = build_model(model_config, settings, mode)
        scorer = PolicyScorer(model)
        accelerator = _accelerator(precision)
        sharded = settings.fsdp_world_size > 1
        if sharded:  # as train.setup: shard, autocast the root, then the optimizer over the shards
            engine = Engine("fsdp2", settings.fsdp_world_size, offload_params=settings.cpu_offload)
            with _offload_unpinned():
                shard_model(scorer, model, engine, torch.device("cpu"))
            autocast_forward(scorer, precision)
            optimizer = _make_optimizer(settings, config, model)
        else:
            optimizer = _make_optimizer(settings, config, model)
            scorer, optimizer = accelerator.prepare(scorer, optimizer, device_placement=[False, False])
        _init_optimizer_state(model, optimizer, mode)
        pad_id = model_config.pad_token_id if model_config.pad_token_id is not None else 0
        batch = Collator(pad_id, True, attention_costs(model, torch.device(settings.device_type)))(rows)
        tracker = _tracker(scorer if sharded else None, optimizer, settings.cpu_offload, attribute_at)
        if not sharded:
            tracker.track_external(model, optimizer)
        with tracker:
            before = tracker._device_total(tracker.get_tracker_snapshot()[torch.device("cpu")])
            z0, scored, loss, _, _ = kto_forward(accelerator, scorer, batch, config, with_stats=True)
            tokens_with_grad, tokens_executed = _layout_tokens(batch), scored.tokens_executed
            del z0, scored
            accelerator.backward(loss)
            del loss
            if sharded:
                clip_grad_norm(scorer.parameters(), config.max_grad_norm)
            else:
                accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    dev = torch.device("cpu")
    return StepMemory(
        peak_bytes=tracker._peak_mem[dev],
        breakdown=_breakdown(tracker._peak_mem_snap[dev], settings.cpu_offload),
        before_step_bytes=before,
        tokens_with_grad=tokens_with_grad,
        tokens_executed=tokens_executed,
        top=tracker.top or [],
    )


def _make_optimizer(settings: StepSettings, config, model):
    """train's optimizer (fused AdamW), or bitsandbytes' AdamW8bit over the same parameter groups (built outside
    the fake mode: its quantization map is a real table; its moments are made from the fake parameters)."""
    from kto_pipeline.stages.train.stage import _optimizer

    if settings.optimizer == "adamw":
        return _optimizer(config, model)
    import bitsandbytes as bnb

    groups = _optimizer(config, model).param_groups
    return bnb.optim.AdamW8bit(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=config.learning_rate
    )


def _layout_tokens(batch) -> int:
    """Tokens of the forward with gradients: the layout's columns before the split, padding included."""
    return int(batch["layout_input_ids"].shape[0] * int(batch["layout_split"]))


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


def _addmm_fp32(acc, a, b) -> None:
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
                        _addmm_fp32(grad_hidden[t0:t1], tile, w_chunk)
                    if grad_weight is not None:
                        _addmm_fp32(grad_weight[v0:v1], tile.t(), chunk)
            return (
                None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None,
                None,
                None,
            )

    return _TrlFusedLogProbs


def _trl_head(model, input_ids, attention_mask, completion_mask, with_stats: bool):
    """trl's `_fused_forward` with `fused_lm_head=True` on a CUDA device: the backbone, then the fused head over
    the positions whose label is not -100 (compact), scattered back to (B, T-1). Returns the (B,) sums."""
    import torch

    from kto_pipeline.scoring.logprobs import backbone_of

    labels = input_ids.masked_fill(completion_mask == 0, -100)
    hidden = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
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
    reference model beside the policy; else `precompute_ref_log_probs=True` (reference log-probs in the batch)."""
    import torch

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.loss import kto_loss
    from kto_pipeline.scoring.logprobs import pad_sequences
    from kto_pipeline.stages.train.stage import _optimizer

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
    accelerator = _accelerator(precision)
    optimizer = _optimizer(config, policy)
    policy, optimizer = accelerator.prepare(policy, optimizer, device_placement=[False, False])
    if reference is not None:
        reference = accelerator.prepare_model(reference, evaluation_mode=True, device_placement=False)
    _init_optimizer_state(policy, optimizer, mode)
    pad_id = model_config.pad_token_id if model_config.pad_token_id is not None else 0
    prompts = [len(r["prompt_ids"]) for r in rows]
    ids, attn, comp = pad_sequences([r["prompt_ids"] + r["completion_ids"] for r in rows], prompts, pad_id)
    kl_ids, kl_attn, kl_comp = pad_sequences([r["prompt_ids"] + r["kl_completion_ids"] for r in rows], prompts, pad_id)
    labels = torch.tensor([r["label"] for r in rows])
    ref_logps = torch.tensor([r["ref_logp"] for r in rows])
    tracker = _tracker()
    tracker.track_external(policy, optimizer)
    if reference is not None:
        tracker.track_external(reference)

    def forward(model, ids, attn, comp, with_stats):
        with accelerator.autocast():
            return _trl_head(model, ids, attn, comp, with_stats)

    with device_decisions(settings.device_type), tracker:
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
        breakdown=_breakdown(tracker._peak_mem_snap[dev], False),
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


# ------------------------------------------------------------------------------------------ the floor


def floor_bytes(model_config, settings: StepSettings, tokens: int, fake: bool = True) -> dict[str, int]:
    """What any trainer of this model must hold at its peak: the trained weights' float32 copies, their
    gradients and AdamW's two moments (16 bytes a trained parameter; LoRA: the frozen base's 4 bytes a parameter
    plus 16 a trained one; FSDP2: a 1/world share of each), plus the activations a backward needs for `tokens`
    tokens with gradients.

    The activations are measured, not modelled: the bare backbone's forward (causal, one unpadded sequence, no
    LM head), with the step's autocast and checkpointing, on 256 and on 512 tokens. What it keeps grows by a
    per-token slope; what it keeps whatever the length (autocast's bf16 copies of the weights, which the backward
    reads) is the intercept. The floor takes intercept + slope x `tokens`."""
    import torch

    from kto_pipeline.scoring.logprobs import backbone_of

    mode = fake_mode() if fake else None
    model = build_model(model_config, dataclasses.replace(settings, fsdp_world_size=1), mode)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    world = settings.fsdp_world_size
    kept = {}
    for n in (256, 512):
        tracker = _tracker()
        tracker.track_external(model)
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            out = backbone_of(model)(input_ids=torch.zeros((1, n), dtype=torch.long), use_cache=False)
            kept[n] = _breakdown(tracker.get_tracker_snapshot()[torch.device("cpu")], False)["activations"]
        del out
    slope = (kept[512] - kept[256]) / 256
    intercept = kept[256] - slope * 256
    return {
        "parameters": (trained + frozen) * 4 // world,
        "gradients": trained * 4 // world,
        "optimizer": trained * 8 // world,
        "activations": int(intercept / world + slope * tokens),
    }


# ------------------------------------------------------------------------------------------ the command


def estimate(config: MemoryEstimateConfig) -> dict[str, Any]:
    """The answer of `estimate-memory`: our step's peak and breakdown, the floor, and trl online's peak."""
    model_config = load_model_config(config.model)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    rows = synthetic_rows(config.per_device_train_batch_size, config.max_length, config.lengths, text.vocab_size)
    settings = StepSettings(
        bf16=config.bf16,
        gradient_checkpointing=config.gradient_checkpointing,
        lora_r=config.lora_r,
        fsdp_world_size=config.fsdp_world_size,
        cpu_offload=config.cpu_offload,
    )
    ours = simulate_ours(model_config, rows, settings)
    needed = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    floor = floor_bytes(model_config, settings, needed)
    if config.cpu_offload:  # the device holds no sharded weights, gradients or moments
        floor.update(parameters=0, gradients=0, optimizer=0)
    result: dict[str, Any] = {
        "model": config.model,
        "settings": {k: v for k, v in config.to_dict().items() if k not in ("model", "json", "against_trl")},
        "peak_bytes": ours.peak_bytes,
        "breakdown": ours.breakdown,
        "floor_bytes": sum(floor.values()),
        "floor": floor,
        "tokens_needed": needed,
        "tokens_with_grad": ours.tokens_with_grad,
        "trl_online_peak_bytes": None,
    }
    if config.against_trl:
        trl = simulate_trl(model_config, rows, settings, online=True)
        result["trl_online_peak_bytes"] = trl.peak_bytes
        result["trl_online_breakdown"] = trl.breakdown
    return result


def describe(result: dict[str, Any]) -> str:
    """The table `estimate-memory` prints."""

    def gib(x: int) -> str:
        return f"{x / GIB:8.2f} GiB"

    s = result["settings"]
    lines = [
        f"{result['model']}: one training step, {s['per_device_train_batch_size']} rows x {s['max_length']} tokens "
        f"({s['lengths']}), {'bf16 autocast' if s['bf16'] else 'float32'}"
        + (", gradient checkpointing" if s["gradient_checkpointing"] else "")
        + (f", LoRA r={s['lora_r']}" if s["lora_r"] else "")
        + (f", FSDP2 x{s['fsdp_world_size']}" if s["fsdp_world_size"] > 1 else "")
        + (" + CPU offload" if s["cpu_offload"] else ""),
        f"  peak per device   {gib(result['peak_bytes'])}   (simulated; allocated tensors, no allocator slack)",
    ]
    for name in CATEGORIES:
        lines.append(f"    {name:<15} {gib(result['breakdown'][name])}")
    lines.append(f"  floor             {gib(result['floor_bytes'])}   (weights, grads, AdamW, needed activations)")
    if result.get("trl_online_peak_bytes") is not None:
        ratio = result["peak_bytes"] / result["trl_online_peak_bytes"]
        lines.append(f"  trl online        {gib(result['trl_online_peak_bytes'])}   (ours / trl = {ratio:.2f})")
    return "\n".join(lines)


def run(config: MemoryEstimateConfig) -> None:
    import warnings

    with warnings.catch_warnings():  # fake tensors' own (data_ptr of a FakeTensor, ...): not the user's concern
        warnings.simplefilter("ignore")
        result = estimate(config)
    print(json.dumps(result) if config.json else describe(result))


# ------------------------------------------------------------------------------------------ the real CPU check


def measure_cpu_step(spec: dict[str, Any]) -> dict[str, int]:
    """One real `train` step on the CPU (float32, real seeded weights), in this process: the resident set's high
    water mark over the step, as the check of the simulation (run it in a fresh process started with
    MALLOC_MMAP_THRESHOLD_=65536, see `cpu_check`). `spec`: {"config": model config dict, "rows": rows}.

    Returns {"rss_before": resident bytes after the model and the optimizer's moments exist,
    "rss_peak": the high water mark during the step (the kernel's VmHWM, reset just before it),
    "baseline": resident bytes before the model was built}."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(1)  # per-thread scratch of the CPU kernels would blur the comparison
    config_dict = dict(spec["config"])
    model_config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    settings = StepSettings(bf16=False, device_type="cpu")
    # everything the step imports, before the baseline: the model's class (built on the meta device: no
    # memory), accelerate's state, the stages
    import kto_pipeline.stages.train.stage  # noqa: F401

    with torch.device("meta"):
        build_model(model_config, settings, None)
    _accelerator("no")
    baseline = _rss("VmRSS")
    out = _run_real(model_config, spec["rows"], settings)
    out["baseline"] = baseline
    return out


def _run_real(model_config, rows, settings: StepSettings) -> dict[str, int]:
    import gc

    import torch

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.scoring.attention import attention_costs
    from kto_pipeline.stages.train.batches import Collator, PolicyScorer
    from kto_pipeline.stages.train.kto_step import kto_forward
    from kto_pipeline.stages.train.stage import _optimizer

    config = TrainConfig(cache="-", output_dir="-", bf16=False, per_device_train_batch_size=max(len(rows), 2))
    model = build_model(model_config, settings, None)
    accelerator = _accelerator("no")
    optimizer = _optimizer(config, model)
    scorer, optimizer = accelerator.prepare(PolicyScorer(model), optimizer, device_placement=[False, False])
    _init_optimizer_state(model, optimizer, None)
    batch = Collator(model_config.pad_token_id or 0, True, attention_costs(model, torch.device("cpu")))(rows)
    gc.collect()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the high water mark (Linux >= 4.0)
        f.write("5")
    z0, scored, loss, _, _ = kto_forward(accelerator, scorer, batch, config, with_stats=True)
    del z0, scored
    accelerator.backward(loss)
    del loss
    accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return {"rss_before": before, "rss_peak": _rss("VmHWM")}


def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def cpu_check(model_config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The simulation against a real CPU step of the same model (float32, attention as the CPU runs it) and rows.

    Real: `measure_cpu_step` in a fresh process, glibc told to map every allocation above 64 KiB on its own
    (MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at once and the high water mark is
    the step's live tensors plus the process's own pages. Compared: what the step adds to what was resident
    before it (gradients, activations, temporaries: the part the simulation has to get right; parameters and
    moments are counted, not simulated), and the whole peak above the process's baseline (before the model).
    Simulated: the same step on fake tensors (`simulate_ours`, device_type "cpu") and on real tensors under the
    same tracker (the tracker's accounting of real allocations)."""
    import subprocess

    settings = StepSettings(bf16=False, device_type="cpu")
    spec = {"config": model_config.to_dict(), "rows": rows}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "kto_pipeline.memory", "measure-cpu-step"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the real CPU step failed:\n{proc.stderr[-3000:]}")
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    fake = simulate_ours(model_config, rows, settings, fake=True)
    tracked_real = simulate_ours(model_config, rows, settings, fake=False)
    return {
        "real_step_bytes": real["rss_peak"] - real["rss_before"],
        "real_total_bytes": real["rss_peak"] - real["baseline"],
        "simulated_step_bytes": fake.peak_bytes - fake.before_step_bytes,
        "simulated_total_bytes": fake.peak_bytes,
        "tracked_real_step_bytes": tracked_real.peak_bytes - tracked_real.before_step_bytes,
        "tracked_real_total_bytes": tracked_real.peak_bytes,
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["measure-cpu-step"]:
        print(json.dumps(measure_cpu_step(json.loads(sys.stdin.read()))))
    else:
        raise SystemExit("usage: python -m kto_pipeline.memory measure-cpu-step < spec.json")
