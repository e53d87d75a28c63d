"""The learning-rate schedules of `--lr-scheduler-type`: transformers' `get_scheduler` at its defaults (what trl's
trainers use), the same factor at every step and the same `LambdaLR` state (tests/test_train.py holds each against
transformers' own, step by step).

Not imported from transformers: `transformers.optimization` imports `trainer_utils`, which imports peft wherever it
is installed, and peft imports bitsandbytes, which compiles at import: 2-4 s of CPU in every training process,
LoRA or not."""

from __future__ import annotations

import math
from functools import partial

from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup_steps: int) -> float:
    return float(step) / float(max(1, warmup_steps))


def _constant(_=None):
    return 1


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _progress(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    return float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init  # LambdaLR multiplies by lr_init
    remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0 / math.sqrt((step + (timescale - num_warmup_steps)) / timescale)


def schedule(name: str, optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    """The schedule `name` (one of config.fields.SCHEDULERS) over `total_steps` after `warmup_steps`."""
    steps = dict(num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    if name == "constant":
        factor = _constant
    elif name == "constant_with_warmup":
        factor = partial(_constant_with_warmup, num_warmup_steps=warmup_steps)
    elif name == "linear":
        factor = partial(_linear, **steps)
    elif name == "cosine":
        factor = partial(_cosine, **steps, num_cycles=0.5)
    elif name == "cosine_with_restarts":
        factor = partial(_cosine_with_restarts, **steps, num_cycles=1)
    elif name == "polynomial":
        lr_init, lr_end = optimizer.defaults["lr"], 1e-7
        if not lr_init > lr_end:
            raise ValueError(f"lr_end ({lr_end}) must be smaller than initial lr ({lr_init})")
        factor = partial(_polynomial, **steps, lr_end=lr_end, power=1.0, lr_init=lr_init)
    elif name == "inverse_sqrt":
        factor = partial(_inverse_sqrt, num_warmup_steps=warmup_steps, timescale=warmup_steps or 10_000)
    else:
        raise ValueError(f"unknown learning-rate schedule {name!r}")
    return LambdaLR(optimizer, factor)
