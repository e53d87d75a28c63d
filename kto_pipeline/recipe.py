"""Recipes (`--config FILE.yaml` on every command) and the command-line options built from the config dataclasses.

A command's options come from its config dataclass: `--field-name`, with the field's type, default, help
and --help panel (bool fields are `--x/--no-x`), so each is written once, in kto_pipeline/config/. A
recipe is a YAML mapping of those option names (`learning_rate` or `learning-rate`) to values. A flag typed
on the command line overrides the recipe, which overrides the dataclass default. The options a command
requires may come from either, so click does not enforce them: `resolve` does, once the recipe is read
(`--help` still marks them required).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand
from typer.models import ArgumentInfo, ParameterInfo

from kto_pipeline.config import PANELS, PrecomputeConfig, TrainConfig, base_type, parse_value
from kto_pipeline.config.fields import LISTED, trl_names
from kto_pipeline.errors import KTOPipelineError

CONFIG_HELP = (
    "A YAML recipe of this command's options: keys are the flag names (output_dir or output-dir), or trl's names "
    "(model_name_or_path, dataset_name, ...). Flags given on the command line override it."
)
# trl's names for options of ours, as its TrlParser reads a `trl kto` / `trl dpo` YAML (ScriptArguments, ModelConfig,
# KTOConfig / DPOConfig), declared beside each field (`described(trl=...)`); the names both share (learning_rate,
# beta, lora_r, ...) need none
TRL_NAMES = trl_names(PrecomputeConfig, TrainConfig)
# trl's keys with no counterpart here: read, and said to have no effect (a trl YAML runs as it is)
TRL_UNUSED = {
    "dataset_test_split": "held-out rows are a cache of their own: precompute --split test, then train --eval-cache",
    "eval_strategy": "train evaluates on --eval-cache every --eval-steps",
    "save_strategy": "train saves every --save-steps",
    "logging_strategy": "train logs every --logging-steps",
    "logging_first_step": "train logs from --logging-steps",
    "attn_implementation": "the attention kernel is --attention-kernel",
    "remove_unused_columns": "no dataset columns reach training",
    "precompute_ref_log_probs": "the reference is always precomputed here",
    "gradient_checkpointing_kwargs": "checkpointing is non-reentrant here",
    "lora_task_type": "LoRA adapters are for causal LMs (CAUSAL_LM) here",
    "torch_compile_backend": "the decoder layers compile with inductor (--torch-compile, --torch-compile-mode)",
}
# how a value the command line holds got there (click's ParameterSource, by name: typer may carry its own click):
# these mean the user gave it, so it overrides the recipe
TYPED = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")
_CTX, _CONFIG = "ctx", "config_file"  # the command's own parameters: click's context, and --config


@dataclass(frozen=True)
class Option:
    """One option (or argument) of a command, as a recipe may set it."""

    name: str
    type: Any  # the value's type: float, int | None, ...
    required: bool = False  # no default: the command line or the recipe must give it
    argument: bool = False  # a positional argument (CACHE_DIR) rather than a --flag
    grid: bool = False  # sweep: one value or several (comma-separated on the command line, a list in a recipe)
    joined: bool = False  # a str holding a comma-separated list (report_to): a recipe may give a YAML list
    formerly: str | None = None  # the option's name in earlier releases (still read from recipes)

    @property
    def flag(self) -> str:
        return self.name.upper() if self.argument else "--" + self.name.replace("_", "-")


class RecipeCommand(TyperCommand):
    """A command built by `options`: its required options may come from --config, so click leaves them optional
    (`resolve` checks them), but --help shows them required."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        required = set(getattr(self.callback, "recipe_required", ()))
        marked = [p for p in self.params if p.name in required and not p.required]
        for param in marked:
            param.required = True
        try:
            super().format_help(ctx, formatter)
        finally:
            for param in marked:
                param.required = False


def options(
    config_class: type | None = None,
    *,
    grid: bool = False,
    exclude: tuple[str, ...] = (),
    shares_recipe_with: type | None = None,
    recipe_names: dict[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn `func` into a typer command (register it with `app.command(cls=RecipeCommand)`) that also takes --config.

    The parameters of `func` annotated with typer.Option / typer.Argument are its own options. With a
    `config_class`, every other field of that dataclass (but `exclude`) becomes an option too, in the
    order of its panel, and `func`'s one unannotated parameter receives the dataclass built from them; with
    `grid=True` (sweep) it receives {field: "comma-separated values" or None} instead.

    `shares_recipe_with`: the config of the command that reads the same recipe (precompute and train read one
    trl-style YAML): its options' keys, and trl's names for them, are ignored here. `recipe_names`: more names a
    recipe may use for this command's options (precompute reads `cache` as its --output).
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func, eval_str=True)
        own: list[Option] = []
        params: list[inspect.Parameter] = []
        receiver = None
        for p in signature.parameters.values():
            info = _typer_info(p.annotation)
            if info is None:
                receiver = p.name
                continue
            required = p.default is inspect.Parameter.empty
            value_type = typing.get_args(p.annotation)[0]
            own.append(Option(p.name, value_type, required, argument=isinstance(info, ArgumentInfo)))
            params.append(_parameter(p.name, value_type, None if required else p.default, info, required))
        generated: list[Option] = []
        fields: list[dataclasses.Field] = []
        if config_class is not None:
            assert receiver is not None, f"{func.__name__} needs a parameter for the {config_class.__name__}"
            hints = typing.get_type_hints(config_class)
            fields = [f for f in dataclasses.fields(config_class) if f.name not in (*exclude, *signature.parameters)]
            for f in sorted(fields, key=lambda f: PANELS.index(f.metadata["panel"])):
                option, param = _field_option(f, hints[f.name], grid)
                generated.append(option)
                params.append(param)
        specs = own + generated
        assert not {_CTX, _CONFIG} & {s.name for s in specs}
        names = {s.name for s in specs}
        aliases = {k: v for k, v in {**TRL_NAMES, **(recipe_names or {})}.items() if v in names}
        ignored: dict[str, str] = {}  # the other command's keys -> its name (`PrecomputeConfig` -> precompute)
        if shares_recipe_with is not None:
            theirs = {f.name for f in dataclasses.fields(shares_recipe_with)} - names
            formerly = {s.formerly for s in specs if s.formerly}  # (precompute's `seed`: its KL seed, as before)
            keys = (theirs | {k for k, v in TRL_NAMES.items() if v in theirs}) - set(aliases) - formerly
            other = shares_recipe_with.__name__.removesuffix("Config").lower()
            ignored = dict.fromkeys(sorted(keys), other)

        def command(**values: Any) -> Any:
            ctx, path = values.pop(_CTX), values.pop(_CONFIG)
            settings = resolve(ctx, specs, values, path, aliases, ignored)
            kwargs = {s.name: settings[s.name] for s in own}
            if config_class is not None:  # in the fields' order (a sweep names its runs in that order)
                rest = {f.name: settings[f.name] for f in fields}
                kwargs[receiver] = rest if grid else config_class(**rest)
            return func(**kwargs)

        command.__name__, command.__qualname__ = func.__name__, func.__qualname__
        command.__doc__, command.__module__ = func.__doc__, func.__module__
        command.__annotations__ = {}
        command.__signature__ = inspect.Signature(
            [
                inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
                *params,
                inspect.Parameter(
                    _CONFIG,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[str | None, typer.Option("--config", metavar="FILE", help=CONFIG_HELP)],
                ),
            ]
        )
        command.recipe_required = tuple(s.name for s in specs if s.required)
        command.recipe_specs = tuple(specs)  # for docs/cli.md (cli_docs.py)
        return command

    return decorate


def _typer_info(annotation: Any) -> ParameterInfo | None:
    if typing.get_origin(annotation) is not Annotated:
        return None
    return next((a for a in annotation.__metadata__ if isinstance(a, ParameterInfo)), None)


def _parameter(name: str, value_type: Any, default: Any, info: ParameterInfo, required: bool) -> inspect.Parameter:
    # a required option may come from the recipe: optional for click, checked by `resolve`
    annotation = Annotated[value_type | None if required else value_type, info]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _field_option(f: dataclasses.Field, value_type: Any, grid: bool) -> tuple[Option, inspect.Parameter]:
    flag = "--" + f.name.replace("_", "-")
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    help_text, panel = f.metadata["help"], f.metadata["panel"]
    joined = LISTED in f.metadata.get("role", ())
    if grid:
        assert not required, f.name
        several = "One value: its commas are literal." if joined else "Comma-separated values: a run each."
        info = typer.Option(flag, help=f"{help_text} {several}", rich_help_panel=panel)
        option = Option(f.name, value_type, grid=True, joined=joined)
        return option, _parameter(f.name, str | None, None, info, False)
    decl = f"{flag}/--no-{flag[2:]}" if base_type(value_type)[0] is bool else flag
    formerly = f.metadata.get("formerly")
    info = typer.Option(decl, help=help_text, rich_help_panel=panel)
    option = Option(f.name, value_type, required, joined=joined, formerly=formerly)
    return option, _parameter(f.name, value_type, None if required else f.default, info, required)


# ------------------------------------------------------------------------------------------ reading a recipe


def resolve(
    ctx: typer.Context,
    specs: list[Option],
    values: dict[str, Any],
    path: str | None,
    aliases: dict[str, str] | None = None,
    ignored: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Each option's value: typed on the command line, else from the recipe at `path`, else the default."""
    recipe = read_recipe(path, specs, aliases, ignored) if path is not None else {}
    settings = {}
    for spec in specs:
        source = ctx.get_parameter_source(spec.name)
        typed = source is not None and source.name in TYPED
        settings[spec.name] = recipe[spec.name] if spec.name in recipe and not typed else values[spec.name]
    missing = [s.flag for s in specs if s.required and settings[s.name] is None]
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        verb = "is" if len(missing) == 1 else "are"
        raise KTOPipelineError(f"{names} {verb} required (on the command line or in --config {path or 'FILE'})")
    return settings


def read_recipe(
    path: str | Path, specs: list[Option], aliases: dict[str, str] | None = None, ignored: dict[str, str] | None = None
) -> dict[str, Any]:
    """The recipe's values by option name, each checked against its option's type. `aliases`: other names of this
    command's options (trl's); `ignored`: keys another command reads from the same recipe -> that command's name (an
    unknown key's suggestion comes from both commands' keys)."""
    import yaml

    where = f"--config {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise KTOPipelineError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise KTOPipelineError(f"{where}: is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KTOPipelineError(f"{where}: cannot read it ({exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
        raise KTOPipelineError(f"{where}: not valid YAML{at}: {problem}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise KTOPipelineError(
            f"{where}: must be a mapping of option names to values (`beta: 0.1`), got {_shown(data)}"
        )
    by_name = {s.name: s for s in specs}
    formerly = {s.formerly: s.name for s in specs if s.formerly}  # a recipe of an earlier release keeps working
    recipe: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    aliases, ignored = aliases or {}, ignored or {}
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else None
        if name in ignored:
            continue
        if name in TRL_UNUSED and name not in by_name:
            print(f"note: {where}: {key} (trl's) has no effect here: {TRL_UNUSED[name]}", file=sys.stderr)
            continue
        name = formerly.get(name, name)
        name = aliases.get(name, name)
        if name not in by_name:
            known = dict.fromkeys([*by_name, *aliases], "") | {k: f" ({c})" for k, c in ignored.items()}
            raise KTOPipelineError(f"{where}: unknown key {key!r}{_suggestion(key, known)}")
        if name in recipe:
            raise KTOPipelineError(
                f"{where}: {keys[name]!r} and {key!r} are the same option ({by_name[name].flag}); give it once"
            )
        keys[name] = key
        spec, at = by_name[name], f"{where}: {key}"
        recipe[name] = _grid_text(spec, value, at) if spec.grid else _typed(spec, value, at)
    return recipe


def _suggestion(key: Any, names: dict[str, str]) -> str:
    """The nearest of `names` (a key -> what follows it in the suggestion: the command that reads it, where another
    command reads the same recipe)."""
    if not isinstance(key, str):
        return " (keys are option names)"
    candidates = {(n.replace("_", "-") if "-" in key else n): n for n in names}
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if not close:
        return " (not an option of this command: see its --help)"
    return f" (did you mean {close[0]!r}{names[candidates[close[0]]]}?)"


def _expected(spec: Option) -> str:
    base = base_type(spec.type)[0]
    text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[base]
    if spec.joined:
        text += " or a list of strings"
    if base_type(spec.type)[1]:
        text += " or null"
    if spec.grid and not spec.joined:
        text += " (or a list of them)"
    return text


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def _typed(spec: Option, value: Any, where: str) -> Any:
    """A recipe value as the option's type: ints are YAML integers, floats any number or numeric string
    (YAML reads `1e-6` as a string), bools true/false, and a comma-list option may be a YAML list."""
    if typing.get_origin(spec.type) is list:  # a command's several arguments (report's paths)
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value
        raise KTOPipelineError(f"{where}: expected a string or a list of strings, got {_shown(value)}")
    base = base_type(spec.type)[0]
    if value is None and base_type(spec.type)[1]:
        return None
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if base is str and isinstance(value, str):
        return value
    if base is str and spec.joined and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    hint = " (put it in quotes)" if base is str and isinstance(value, int | float) else ""
    raise KTOPipelineError(f"{where}: expected {_expected(spec)}, got {_shown(value)}{hint}")


def _grid_text(spec: Option, value: Any, where: str) -> str:
    """A sweep's value (one, or a list) as the command line's comma-separated text."""
    if spec.joined:  # its commas are literal: always one value
        return _typed(spec, value, where)
    texts = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str) and base_type(spec.type)[0] is not str:  # the command line's form: "0.05,0.1"
            for part in item.split(","):
                try:
                    parse_value(spec.type, part, spec.name)
                except KTOPipelineError:
                    raise KTOPipelineError(f"{where}: expected {_expected(spec)}, got {part.strip()!r}") from None
                texts.append(part.strip())
        else:
            texts.append(_text(_typed(spec, item, where)))
    return ",".join(texts)


def _text(value: Any) -> str:
    """One value as the command line writes it (what config.parse_value reads back)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)
