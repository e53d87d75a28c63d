"""docs/cli.md, generated from the commands as the CLI builds them (their options come from the config dataclasses:
one name, type, default and help text per flag). `make docs` writes it; a test fails when the committed file
differs from what this module renders.

    python -m kto_pipeline.cli_docs > docs/cli.md
"""

from __future__ import annotations

from typing import Any

from kto_pipeline.config import base_type

HEADER = """# Command-line reference

Generated from the config dataclasses by `make docs` (`python -m kto_pipeline.cli_docs > docs/cli.md`); do not edit
by hand. Every command also takes `--config FILE.yaml`, a recipe of its options (the command line overrides the
recipe, which overrides the defaults). As with trl's parser, an option may be spelled with underscores
(`--max_length 512`, `--no_bf16`). The same settings are the fields of `PrecomputeConfig`, `TrainConfig` and
`GenerateConfig` in the Python API.
"""


def _type_name(spec: Any) -> str:
    if spec is None:
        return "text"
    base, optional = base_type(spec.type)
    name = {bool: "flag", int: "integer", float: "number", str: "text"}[base]
    if spec.grid and not spec.joined:
        name = f"{name} list"
    return name + (" or none" if optional and base is not bool else "")


def _default(param: Any, required: bool) -> str:
    if required:
        return "required"
    if param.default is None:
        return "-"
    if isinstance(param.default, bool):
        flag = param.opts[0] if param.default else (param.secondary_opts or param.opts)[0]
        return f"`{flag}`"
    return f"`{param.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole reference as Markdown."""
    import typer

    from kto_pipeline.cli import app

    group = typer.main.get_command(app)
    out = [HEADER]
    for name, command in group.commands.items():
        specs = {s.name: s for s in getattr(command.callback, "recipe_specs", ())}
        required = set(getattr(command.callback, "recipe_required", ()))
        out.append(f"\n## `kto-pipeline {name}`\n\n{_cell(command.help or '')}\n")
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        if arguments:
            out.append("Arguments: " + ", ".join(f"`{p.name.upper()}`" for p in arguments) + ".\n")
        panels: dict[str, list[str]] = {}
        for param in command.params:
            if param.param_type_name == "argument":
                text = _cell(param.help or "") if hasattr(param, "help") else ""
                panels.setdefault("Arguments", []).append(f"| `{param.name.upper()}` | text | required | {text} |")
                continue
            flag = "/".join([param.opts[0], *param.secondary_opts])
            spec = specs.get(param.name)
            row = (
                f"| `{flag}` | {_type_name(spec)} | {_default(param, param.name in required)} "
                f"| {_cell(param.help or '')} |"
            )
            panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(row)
        for panel, rows in panels.items():
            out.append(f"\n### {panel}\n\n| option | type | default | meaning |\n| --- | --- | --- | --- |")
            out.extend(rows)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
