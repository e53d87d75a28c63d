"""What every stage's config is made of: typed fields with their help text and --help panel, how a value is
read from text, and the mixin that prints and saves a config."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

from kto_pipeline.errors import KTOPipelineError, check_option, flag
from kto_pipeline.runtime import COMPILE_MODES
from kto_pipeline.scoring import ATTENTION_KERNELS

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
SAMPLING = ("random", "sequential")
REPORT_TO = ("none", "tensorboard", "wandb")


# The command line's --help panels. Each field names its panel; a command shows its panels in this order.
MODEL = "Model"
MODELS = "Models"
MODEL_AND_DATA = "Model and data"
DATA = "Data"
PROMPTS = "Prompts"
REFERENCE_PASS = "Reference pass"
OPTIMISATION = "Optimisation"
DECODING = "Decoding"
ROUNDS = "Rounds: completions to label"
LORA = "LoRA"
EVALUATION = "Evaluation"
CHECKPOINTS = "Checkpoints"
OUTPUT = "Output"
LOGGING = "Logging"
PROCESSES = "More than one process"
PANELS = (
    MODEL,
    MODELS,
    MODEL_AND_DATA,
    DATA,
    PROMPTS,
    REFERENCE_PASS,
    OPTIMISATION,
    DECODING,
    ROUNDS,
    LORA,
    EVALUATION,
    CHECKPOINTS,
    OUTPUT,
    LOGGING,
    PROCESSES,
)


# A field's roles (`described(role=...)`): what it is to the tools that read a config, declared once beside it.
SET_BY_SWEEP = "set by sweep"  # sweep sets it itself, run by run (no grid of it)
NO_EFFECT = "no effect"  # changes nothing in a run's results: sweep counts a finished run with another value as done
FIXED_ON_RESUME = "fixed on resume"  # fixes what a checkpoint's step and data position mean: --resume refuses another
NOTED_ON_RESUME = "noted on resume"  # changes what the steps after a checkpoint do: --resume says where it differs
LISTED = "listed"  # a str holding a comma-separated list itself: a recipe may give a YAML list, a sweep no grid of it
ROLES = (SET_BY_SWEEP, NO_EFFECT, FIXED_ON_RESUME, NOTED_ON_RESUME, LISTED)


def described(
    text: str,
    *,
    panel: str,
    formerly: str | None = None,
    role: tuple[str, ...] = (),
    trl: str | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """A field's help text and --help panel; `formerly`: the name it had in earlier releases, still read from
    recipes (on the command line click names the new flag: "No such option: --seed Did you mean --kl-seed?");
    `role`: its roles (`ROLES`); `trl`: trl's name for it where trl's differs (`model_name_or_path`), read from a
    trl recipe and, on the command line, taken as ours (`cli.trl_spellings`)."""
    assert set(role) <= set(ROLES), role
    metadata = {"help": text, "panel": panel, "formerly": formerly, "role": frozenset(role), "trl": trl}
    return {"metadata": metadata, **kw}


def trl_names(*classes: type) -> dict[str, str]:
    """{trl's name: ours} of the fields of `classes` whose trl name differs."""
    return {f.metadata["trl"]: f.name for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("trl")}


def fields_with(cls: type, role: str) -> tuple[str, ...]:
    """The names of `cls`'s fields that have `role`, in their order."""
    return tuple(f.name for f in dataclasses.fields(cls) if role in f.metadata.get("role", ()))


def has_role(cls: type, name: str, role: str) -> bool:
    """Whether `cls`'s field `name` has `role`."""
    return name in fields_with(cls, role)


check = check_option


# ------------------------------------------------------------------------------------------ typed values


def base_type(value_type: Any) -> tuple[type, bool]:
    """(the type, whether None is allowed) of a field annotation such as `int | None`."""
    if typing.get_origin(value_type) in (UnionType, typing.Union):
        args = typing.get_args(value_type)
        return next(a for a in args if a is not NoneType), NoneType in args
    return value_type, False


def parse_value(value_type: Any, text: str, name: str) -> Any:
    """One command-line value (`text`, of field `name`) as its type: the one parser of sweep grids and recipes."""
    base, optional = base_type(value_type)
    text = text.strip()
    if text.lower() in ("none", "null", "") and optional:
        return None
    try:
        if base is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
        if base in (int, float):
            return base(text)
    except ValueError:
        raise KTOPipelineError(f"{flag(name)}: cannot read {text!r} as {base.__name__}") from None
    return text


class ConfigMixin:
    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        width = max(len(f.name) for f in dataclasses.fields(self))
        return "\n".join(f"  {f.name:<{width}}  {getattr(self, f.name)}" for f in dataclasses.fields(self))


def check_compile_mode(mode: str, torch_compile: bool | None) -> None:
    check(mode in COMPILE_MODES, "torch_compile_mode", f"must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    check(
        mode == "default" or torch_compile is not False,
        "torch_compile_mode",
        f"{mode} compiles the layers: drop --no-torch-compile, or leave the mode at default",
    )


def check_kernel(kernel: str) -> None:
    check(
        kernel in ATTENTION_KERNELS,
        "attention_kernel",
        f"must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}",
    )


def field_help(cls: type, name: str) -> str:
    """The help text of a config field (used by the CLI)."""
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def field_panel(cls: type, name: str) -> str:
    """The --help panel of a config field (used by the CLI)."""
    return next(f.metadata["panel"] for f in dataclasses.fields(cls) if f.name == name)
