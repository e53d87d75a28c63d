"""What the memory simulation runs on: fake tensors, torch's memory trackers, the model and the rows.

The model is built on the meta device and materialized as fake tensors (`FakeTensorMode`): every parameter,
activation, gradient and optimizer state has its real shape and dtype, and none takes memory. torch's memory
tracker (`MemTracker`, `FSDPMemTracker` on a fake process group for FSDP2) counts every storage alive at each op,
by category, and keeps the peak.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kto_pipeline.cache import completion_room
from kto_pipeline.errors import KTOPipelineError

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
    freeze_vision_tower: bool = True  # a vision-language model's tower: frozen (train's default) or trained (trl's)


@dataclass
class StepMemory:
    """The peak of one step on one device, and what was alive at that moment (bytes)."""

    peak_bytes: int
    breakdown: dict[str, int]  # CATEGORIES -> bytes at the peak
    before_step_bytes: int  # alive when the step starts: parameters, optimizer state (and LoRA's frozen base)
    tokens_with_grad: int  # tokens the forward with gradients ran (padding included)
    tokens_executed: int  # every token any forward ran (padding, the KL and reference forwards included)
    top: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # largest live tensors at the peak
    kl_forward: str = ""  # how the step ran the KL completions (trainer_state.json's `kl_forward`; ours only)

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


def pad_token_id(model_config) -> int:
    """The padding id of a model config (a vision-language model's: its text part's), 0 where it names none."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    found = getattr(text, "pad_token_id", None)
    return 0 if found is None else found


@dataclass(frozen=True)
class ImageShape:
    """What one picture is to a vision-language model: `tokens` image tokens (of id `token_id`) in the prompt, and a
    `size` x `size` RGB input to its vision tower."""

    token_id: int
    tokens: int
    size: int


def image_shape(model_config) -> ImageShape | None:
    """The picture of a vision-language model's config (None for a text model): LLaVA's one token per patch (the
    CLS feature dropped by the default strategy), Idefics3's patches after its pixel shuffle."""
    vision = getattr(model_config, "vision_config", None)
    if vision is None:
        return None
    size, patch = vision.image_size, vision.patch_size
    kind = getattr(model_config, "model_type", "")
    if kind == "llava":
        full = getattr(model_config, "vision_feature_select_strategy", "default") == "full"
        return ImageShape(model_config.image_token_index, (size // patch) ** 2 + int(full), size)
    if kind == "idefics3":
        return ImageShape(model_config.image_token_id, (size // patch) ** 2 // model_config.scale_factor**2, size)
    raise KTOPipelineError(
        f"--model: a {kind or type(model_config).__name__} vision-language model; the memory simulation models the "
        "pictures of LLaVA and Idefics3 only."
    )


def synthetic_rows(
    batch_size: int, max_length: int, lengths: str, vocab_size: int, seed: int = 0, image: ImageShape | None = None
) -> list[dict[str, Any]]:
    """One micro-batch of cache rows (what a cache's rows read as) with random token ids.

    `image` (a vision-language model): each prompt starts with one picture's image tokens, within `max_length`,
    and each row carries its picture's tensor (`pixels`, zeros of the vision tower's input shape).

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
    if image is not None:  # the text part of each prompt, then the image tokens put before it
        text = synthetic_rows(batch_size, max_length - image.tokens, lengths, vocab_size, seed)
        import torch

        for row in text:
            for key in ("prompt_ids", "completion_ids", "kl_completion_ids"):  # no stray image token in the text
                row[key] = [0 if t == image.token_id else t for t in row[key]]
            row["prompt_ids"] = [image.token_id] * image.tokens + row["prompt_ids"]
            row["pixels"] = {"pixel_values": torch.zeros(1, 3, image.size, image.size)}
        return text
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
        room = completion_room(row["prompt_ids"], max_length)
        if lengths == "full":  # fill the row: the partner's completion, repeated if short
            partner = partner * (room // len(partner) + 1)
        row["kl_completion_ids"] = partner[:room]
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


def memory_tracker(fsdp_root=None, optimizer=None, offload: bool = False, attribute_at: int | None = None):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    base = MemTracker if fsdp_root is None else FSDPMemTracker
    cls = type("PeakTracker", (_PeakOnly, base), {})
    tracker = cls() if fsdp_root is None else cls(fsdp_root, optimizer)
    tracker.offload, tracker.attribute_at, tracker.top = offload, attribute_at, None
    tracker._labels = WeakIdKeyDictionary()
    return tracker


def breakdown(snap: dict, offload: bool) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name == "Total" or (offload and name in _OFFLOADED):
            continue
        out[_CATEGORY_OF[str(name)]] += value
    return out


# ------------------------------------------------------------------------------------------ the model


def step_attention(model, device_type: str):
    """How the simulated step's packed rows attend: as the policy's would on `device_type` (`choose_kernel`: on a GPU,
    FlexAttention under a block mask), whatever device the simulation's tensors are on."""
    from kto_pipeline.scoring.attention import attention_costs, choose_kernel

    return attention_costs(model, choose_kernel(model, "auto", device_type)[0])


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

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.models import auto_class
    from kto_pipeline.stages.train.policy import ready_to_train

    config = type(model_config).from_dict(model_config.to_dict())  # a copy: the model may change it
    train_config = TrainConfig(
        cache="-",
        output_dir="-",
        lora_r=settings.lora_r,
        gradient_checkpointing=settings.gradient_checkpointing,
        freeze_vision_tower=settings.freeze_vision_tower,
    )

    def prepare(model):
        return ready_to_train(model, train_config)

    if fake is None:
        torch.manual_seed(seed)
        return prepare(auto_class(config).from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    # On the meta device first, LoRA's adapters included (peft moves each adapter to its base layer's device, which
    # a fake parameter refuses: `_apply(): Couldn't swap`), then every tensor materialized fake at once.
    with torch.device("meta"):
        model = prepare(auto_class(config).from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    with fake:
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty materializes tied weights one by one
    return model


def init_optimizer_state(model, optimizer, fake) -> None:
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
def offload_unpinned():
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


def cpu_accelerator(mixed_precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(mixed_precision=mixed_precision, cpu=True)
