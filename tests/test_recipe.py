"""Recipes (`--config FILE.yaml`) and the command-line options generated from the config dataclasses."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import typer
from helpers import cli_args, read_metrics, run_cli

from kto_pipeline import GenerateConfig, PrecomputeConfig, TrainConfig
from kto_pipeline.cli import app
from kto_pipeline.config.fields import LISTED
from kto_pipeline.sweep import FIXED_FIELDS, expand_grid

CONFIGS = {"precompute": PrecomputeConfig, "train": TrainConfig, "generate": GenerateConfig}


def commands() -> dict:
    return typer.main.get_command(app).commands


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def write(tmp_path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_clean_error(code, err, *fragments):
    assert code == 1, err
    assert "Traceback" not in err and err.startswith("error: ") and err.strip().count("\n") == 0, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def captured(monkeypatch):
    """Stand-ins for the API calls, so that a command only builds its config: {command: what it was called with}."""
    from kto_pipeline import generate, report, sweep
    from kto_pipeline.demo import run as demo
    from kto_pipeline.stages.precompute import stage as precompute
    from kto_pipeline.stages.train import stage as train

    calls = {}

    def stand_in(module, name, command, value=lambda *args, **kw: args[0] if len(args) == 1 else args):
        def record(*args, **kw):
            calls[command] = value(*args, **kw)
            return ""

        monkeypatch.setattr(module, name, record)

    # the CLI imports each command's function from its module when the command runs
    stand_in(precompute, "precompute", "precompute")
    stand_in(train, "train", "train")
    stand_in(generate, "generate_samples", "generate")
    stand_in(generate, "preview", "preview")
    stand_in(sweep, "sweep", "sweep", lambda cache, out, values, keep: (cache, out, values, keep))
    stand_in(report, "write_report", "report")
    stand_in(demo, "run_tiny_demo", "demo")
    return calls


# ------------------------------------------------------------------------------ options from the dataclasses


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_field_is_an_option_with_its_name_type_default_help_and_panel(command):
    """The dataclasses are the single source of the options: nothing is written a second time in cli.py."""
    cls = CONFIGS[command]
    cmd = commands()[command]
    params = {p.name: p for p in cmd.params}
    assert set(params) == {f.name for f in dataclasses.fields(cls)} | {"config_file"}
    required = set(cmd.callback.recipe_required)
    for f in dataclasses.fields(cls):
        param = params[f.name]
        assert param.opts == [flag(f.name)], f.name
        is_bool = str(f.type).startswith("bool")
        assert param.secondary_opts == ([flag(f.name).replace("--", "--no-")] if is_bool else []), f.name
        assert param.help == f.metadata["help"] and param.rich_help_panel == f.metadata["panel"], f.name
        if f.default is dataclasses.MISSING:
            # required, but it may come from --config: click leaves it to the command, --help shows it required
            assert f.name in required and param.default is None and not param.required, f.name
        else:
            assert f.name not in required and param.default == f.default, f.name
    assert required == {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}


def test_sweep_takes_every_train_field_but_the_fixed_ones_as_values():
    params = {p.name: p for p in commands()["sweep"].params}
    swept = [f for f in dataclasses.fields(TrainConfig) if f.name not in FIXED_FIELDS]
    assert set(params) == {f.name for f in swept} | {"cache", "output_dir", "keep", "config_file"}
    for f in swept:
        param = params[f.name]
        assert param.opts == [flag(f.name)] and param.rich_help_panel == f.metadata["panel"], f.name
        several = "Comma-separated values: a run each."
        if LISTED in f.metadata["role"]:
            several = "One value: its commas are literal."
        assert param.default is None and param.help == f"{f.metadata['help']} {several}", f.name


def test_help_groups_the_options_in_panels(monkeypatch, capsys):
    # a wide console, set where typer builds it: COLUMNS may not reach rich, which holds the os.environ of its import
    # time, and datasets.map(num_proc > 1) replaces os.environ with a copy (an earlier test in the suite runs one)
    monkeypatch.setattr("typer.rich_utils.MAX_WIDTH", 200)
    code, out, _ = run_cli(monkeypatch, capsys, "train", "--help")
    assert code == 0
    panels_of_train = ("Model and data", "Optimisation", "LoRA", "Evaluation", "Checkpoints", "Logging")
    for title in (*panels_of_train, "More than one process"):
        assert re.search(rf"╭─ {title} ─", out), title
    assert "--config" in out and "--learning-rate" in out and "[default: 1e-06]" in out
    assert re.search(r"\* +--cache .*\[required\]", out)  # required, even though a recipe may give it
    panels = [p.rich_help_panel for p in commands()["train"].params if p.name != "config_file"]
    assert len(set(panels)) == 7 and max(panels.count(p) for p in set(panels)) < len(panels) / 2
    for command in ("precompute", "generate", "sweep", "inspect", "report", "demo"):
        code, out, _ = run_cli(monkeypatch, capsys, command, "--help")
        assert code == 0 and "--config" in out, command


# ------------------------------------------------------------------------------------------ the same run from a recipe


def test_precompute_from_a_recipe_equals_the_same_flags(tmp_path, monkeypatch, capsys, tiny_model_dir, unpaired_file):
    args = ["--max-length", "64", "--kl-seed", "3", "--batch-size", "4", "--shard-size", "10", "--num-proc", "1"]
    flags = cli_args(model=tiny_model_dir, dataset=unpaired_file, output=tmp_path / "a")
    code, out_flags, err = run_cli(monkeypatch, capsys, "precompute", *flags, *args)
    assert code == 0, err
    recipe = write(
        tmp_path,
        f"model: {tiny_model_dir}\ndataset: {unpaired_file}\noutput: {tmp_path / 'b'}\n"
        "max_length: 64\nseed: 3\nbatch-size: 4\nshard_size: 10\nnum_proc: 1\n",
    )
    code, out_recipe, err = run_cli(monkeypatch, capsys, "precompute", "--config", str(recipe))
    assert code == 0, err
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    for key in ("settings", "reference_model", "dataset", "counts", "fingerprint"):
        assert a[key] == b[key], key
    assert [s["rows"] for s in a["shards"]] == [s["rows"] for s in b["shards"]] and len(a["shards"]) == 3

    def printed_config(out):  # the config as the run prints it, under its banner
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("kto-pipeline precompute")) + 1
        return lines[start : start + len(dataclasses.fields(PrecomputeConfig))]

    assert printed_config(out_flags) == [
        line.replace(str(tmp_path / "b"), str(tmp_path / "a")) for line in printed_config(out_recipe)
    ]


def test_train_from_a_recipe_equals_the_same_flags(tmp_path, monkeypatch, capsys, small_cache):
    flags = [
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "4",
        "--logging-steps",
        "1",
        "--learning-rate",
        "1e-3",
        "--seed",
        "0",
        "--beta",
        "0.2",
        "--lora-r",
        "4",
        "--lora-target-modules",
        "q_proj,v_proj",
        "--no-bf16",
    ]
    code, _, err = run_cli(
        monkeypatch, capsys, "train", "--cache", str(small_cache), "--output-dir", str(tmp_path / "a"), *flags
    )
    assert code == 0, err
    recipe = write(
        tmp_path,
        f"""
cache: {small_cache}
output-dir: {tmp_path / "b"}
max_steps: 2
per_device_train_batch_size: 4
logging_steps: 1
learning_rate: 1e-3   # YAML reads this as a string: accepted for a float
seed: 0
beta: 0.2
lora_r: 4
lora_target_modules: [q_proj, v_proj]
bf16: false
""",
    )
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(recipe))
    assert code == 0, err
    a, b = (json.loads((tmp_path / d / "run_config.json").read_text()) for d in "ab")
    assert b.pop("output_dir") == str(tmp_path / "b") and a.pop("output_dir") == str(tmp_path / "a")
    assert a == b and b["learning_rate"] == 1e-3 and b["lora_target_modules"] == "q_proj,v_proj"
    losses = [[r["loss"] for r in read_metrics(tmp_path / d)] for d in "ab"]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-6)


# ------------------------------------------------------------------------------------------ precedence and types


def test_command_line_overrides_the_recipe_which_overrides_the_default(tmp_path, monkeypatch, capsys, captured):
    recipe = write(tmp_path, "cache: c\noutput_dir: o\nbeta: 0.3\nlearning_rate: 5e-7\nverify: true\nmax_steps: 7\n")
    code, _, err = run_cli(
        monkeypatch, capsys, "train", "--config", str(recipe), "--beta", "0.2", "--no-verify", "--output-dir", "cli"
    )
    assert code == 0, err
    config = captured["train"]
    assert (config.cache, config.output_dir) == ("c", "cli")
    assert config.beta == 0.2 and config.verify is False  # typed flags win, even one equal to the default
    assert config.learning_rate == 5e-7 and config.max_steps == 7  # from the recipe
    assert config.warmup_ratio == 0.0 and config.seed == 42 and config.bf16 is None  # dataclass defaults


def test_recipe_values_of_every_type(tmp_path, monkeypatch, capsys, captured):
    recipe = write(
        tmp_path,
        """
cache: c
output_dir: o
beta: 1                 # an int for a float
learning_rate: 1e-6     # a string for a float (YAML 1.1 needs a dot to read a float)
max_length: null        # optional
save_total_limit: 3
router_aux_loss_coef: 0.01
bf16: null
gradient_checkpointing: true
report_to: [none]
lora_r: 8
lora_target_modules: [q_proj, k_proj, v_proj]
lr_scheduler_type: cosine
""",
    )
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(recipe))
    assert code == 0, err
    config = captured["train"]
    assert config.beta == 1.0 and isinstance(config.beta, float) and config.learning_rate == 1e-6
    assert config.max_length is None and config.save_total_limit == 3 and config.router_aux_loss_coef == 0.01
    assert config.bf16 is None and config.gradient_checkpointing is True and config.report_to == "none"
    assert config.lora_target_modules == "q_proj,k_proj,v_proj" and config.lr_scheduler_type == "cosine"


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("learnin_rate: 1e-6", "unknown key 'learnin_rate' (did you mean 'learning_rate'?)"),
        ("learnin-rate: 1e-6", "unknown key 'learnin-rate' (did you mean 'learning-rate'?)"),
        ("keep: best", "unknown key 'keep' (not an option of this command"),  # sweep's, not train's
        ("config: other.yaml", "unknown key 'config'"),
        ("beta: abc", "beta: expected a number, got 'abc'"),
        ("beta: null", "beta: expected a number, got null"),
        ("beta: true", "beta: expected a number, got true"),
        ("max_steps: 2.5", "max_steps: expected an integer, got 2.5"),
        ("max_steps: '2'", "max_steps: expected an integer, got '2'"),
        ("max_steps: true", "max_steps: expected an integer, got true"),
        ("max_length: 1e3", "max_length: expected an integer or null, got '1e3'"),
        ("verify: 'true'", "verify: expected true or false, got 'true'"),
        ("verify: 1", "verify: expected true or false, got 1"),
        ("bf16: 0", "bf16: expected true or false or null, got 0"),
        ("lr_scheduler_type: 1", "lr_scheduler_type: expected a string, got 1 (put it in quotes)"),
        ("loss_type: [kto]", "loss_type: expected a string, got a list"),
        ("report_to: [tensorboard, 3]", "report_to: expected a string or a list of strings, got a list"),
        ("cache: null", "cache: expected a string, got null"),
        ("learning_rate: 1e-6\nlearning-rate: 2e-6", "'learning_rate' and 'learning-rate' are the same option"),
        ("- beta: 0.1", "must be a mapping of option names to values (`beta: 0.1`), got a list"),
        ("beta: [0.1", "not valid YAML at line 2, column 1: expected ',' or ']'"),
        ("beta: 0.0", "--beta: must be > 0, got 0.0"),  # the dataclass's own checks, as for a flag
    ],
)
def test_bad_recipes_are_refused_naming_the_file_and_key(tmp_path, monkeypatch, capsys, captured, text, fragment):
    recipe = write(tmp_path, text + "\n")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--cache", "c", "--output-dir", "o", "--config", str(recipe))
    prefix = "" if fragment.startswith("--beta") else f"--config {recipe}: "
    assert_clean_error(code, err, prefix + fragment)
    assert "train" not in captured


def test_missing_or_unreadable_recipe_and_required_options(tmp_path, monkeypatch, capsys, captured):
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(tmp_path / "nope.yaml"))
    assert_clean_error(code, err, f"--config {tmp_path / 'nope.yaml'}: no such file")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(tmp_path))
    assert_clean_error(code, err, "is a directory")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--beta", "0.2")
    assert_clean_error(code, err, "--cache and --output-dir are required (on the command line or in --config FILE)")
    recipe = write(tmp_path, "cache: c\n")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(recipe))
    assert_clean_error(code, err, f"--output-dir is required (on the command line or in --config {recipe})")
    code, _, err = run_cli(monkeypatch, capsys, "precompute", "--model", "m")
    assert_clean_error(code, err, "--dataset and --output are required")
    code, _, err = run_cli(monkeypatch, capsys, "inspect")
    assert_clean_error(code, err, "CACHE_DIR is required")
    empty = write(tmp_path, "", "empty.yaml")  # an empty recipe sets nothing
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(empty), "--cache", "c", "--output-dir", "o")
    assert code == 0, err
    assert captured["train"] == TrainConfig(cache="c", output_dir="o")


# ------------------------------------------------------------------------------------------ the other commands


def test_sweep_recipe_takes_lists_or_scalars(tmp_path, monkeypatch, capsys, captured):
    recipe = write(
        tmp_path,
        """
cache: c
output_dir: s
keep: best
beta: [0.05, 0.1]
learning_rate: [5e-7, 1.0e-6]
max_steps: 3
loss_type: kto,apo_zero_unpaired
lora_target_modules: [q_proj, v_proj]   # one value: its commas are literal
bf16: [false]
max_length: [null, 32]
""",
    )
    code, _, err = run_cli(monkeypatch, capsys, "sweep", "--config", str(recipe), "--max-steps", "4,5")
    assert code == 0, err
    cache, out, values, keep = captured["sweep"]
    assert (cache, out, keep) == ("c", "s", "best")
    assert values["beta"] == "0.05,0.1" and values["learning_rate"] == "5e-7,1e-06" and values["max_steps"] == "4,5"
    assert values["lora_target_modules"] == "q_proj,v_proj" and values["bf16"] == "false"
    assert values["max_length"] == "none,32" and values["seed"] is None
    grid, varied = expand_grid(values)
    assert len(grid) == 2 * 2 * 2 * 2 * 2  # runs are named in the fields' order, as with flags:
    assert varied == ["beta", "loss_type", "learning_rate", "max_steps", "max_length"]
    assert {g["lora_target_modules"] for g in grid} == {"q_proj,v_proj"} and {g["max_length"] for g in grid} == {
        None,
        32,
    }

    for text, fragment in [
        ("beta: [0.1, abc]", "beta: expected a number (or a list of them), got 'abc'"),
        ("beta: 0.1,abc", "beta: expected a number (or a list of them), got 'abc'"),
        ("max_steps: [2, 2.5]", "max_steps: expected an integer (or a list of them), got 2.5"),
        ("output_dir: [a, b]", "output_dir: expected a string, got a list"),
        ("resume: true", "unknown key 'resume'"),  # a sweep sets it per run
    ]:
        bad = write(tmp_path, f"cache: c\noutput_dir: s\n{text}\n", "bad.yaml")
        code, _, err = run_cli(monkeypatch, capsys, "sweep", "--config", str(bad))
        assert_clean_error(code, err, f"--config {bad}: {fragment}")


def test_inspect_report_demo_and_generate_take_a_recipe(tmp_path, monkeypatch, capsys, captured, small_cache):
    recipe = write(tmp_path, f"cache_dir: {small_cache}\nverify: true\n")
    code, out, err = run_cli(monkeypatch, capsys, "inspect", "--config", str(recipe))
    assert code == 0 and "OK (all checksums verified)" in out, err
    code, out, err = run_cli(monkeypatch, capsys, "inspect", str(small_cache), "--config", str(recipe), "--no-verify")
    assert code == 0 and out.rstrip().endswith("OK"), err
    code, _, err = run_cli(monkeypatch, capsys, "inspect", "--config", str(write(tmp_path, "verfy: true\n", "i.yaml")))
    assert_clean_error(code, err, "unknown key 'verfy' (did you mean 'verify'?)")

    code, _, err = run_cli(
        monkeypatch, capsys, "report", "--config", str(write(tmp_path, "paths: [runs/a]\n", "r.yaml"))
    )
    assert code == 0 and captured["report"] == "runs/a", err
    recipe = write(tmp_path, "paths: [runs/a, runs/b]\noutput: both\n", "r2.yaml")
    code, _, err = run_cli(monkeypatch, capsys, "report", "--config", str(recipe))
    assert code == 0 and captured["report"] == ("runs/a", "runs/b"), err

    code, _, err = run_cli(monkeypatch, capsys, "demo", "--config", str(write(tmp_path, "tiny: true\n", "d.yaml")))
    assert code == 0 and captured["demo"] == ".demo-tiny", err
    code, _, err = run_cli(
        monkeypatch, capsys, "demo", "--config", str(write(tmp_path, "tiny: true\nmodel: m\n", "d2.yaml"))
    )
    assert_clean_error(code, err, "--model: the tiny demo builds its own model")

    recipe = write(tmp_path, "run: r\nmax-new-tokens: 4\ndo_sample: true\ntemperature: 0.7\n", "g.yaml")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--config", str(recipe), "--seed", "3")
    assert code == 0, err
    assert captured["generate"] == GenerateConfig(run="r", max_new_tokens=4, do_sample=True, temperature=0.7, seed=3)


# ------------------------------------------------------------------------------------------ docs and recipes

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_cli_reference_is_what_the_dataclasses_generate():
    """docs/cli.md is generated (`make docs`); editing a flag's help, default or type without regenerating fails."""
    from kto_pipeline.cli_docs import render

    generated = render()
    assert "| `--beta` | number | `0.1` |" in generated and "| `--cache` | text | required |" in generated
    assert (ROOT / "docs" / "cli.md").read_text() == generated, "docs/cli.md is stale: run `make docs`"


RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))


def test_example_recipes_ship():
    assert {p.name for p in RECIPES} >= {"demo.yaml", "qwen2-0.5b-kto-mix.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    """Each recipe under configs/recipes/ is read with its command's options (its first line names the command)
    and builds that command's config."""
    from kto_pipeline.recipe import read_recipe

    first_line = recipe.read_text().splitlines()[0]
    command = next(c for c in ("precompute", "train", "sweep", "generate") if f"kto-pipeline {c}" in first_line)
    specs = list(commands()[command].callback.recipe_specs)
    values = read_recipe(recipe, specs)
    assert values, recipe
    config_class = {"precompute": PrecomputeConfig, "train": TrainConfig, "generate": GenerateConfig}.get(command)
    if config_class is not None:
        defaults = {s.name: None for s in specs if s.required}
        config = config_class(**{**defaults, **values})
        assert all(getattr(config, k) == v for k, v in values.items())


def test_the_kl_seed_keeps_its_former_name(tmp_path):
    """precompute's seed of the KL partners is --kl-seed; a recipe or PrecomputeConfig(seed=...) of an earlier
    release still sets it; the command line names the new flag."""
    from kto_pipeline.recipe import read_recipe

    assert PrecomputeConfig("m", "d", "o", seed=5).kl_seed == 5
    assert "seed" not in PrecomputeConfig("m", "d", "o").to_dict()
    specs = commands()["precompute"].callback.recipe_specs
    recipe = tmp_path / "old.yaml"
    recipe.write_text("seed: 7\nmax-length: 64\n")
    assert read_recipe(recipe, list(specs)) == {"kl_seed": 7, "max_length": 64}
    params = {p.name: p for p in commands()["precompute"].params}
    assert params["kl_seed"].opts == ["--kl-seed"]


def test_a_trl_yaml_sets_the_compile_mode_and_its_backend_is_said_to_have_no_effect(tmp_path, capsys):
    """trl's (transformers') torch_compile_mode is ours by name; torch_compile_backend is read and said to have no
    effect (the layers compile with inductor)."""
    from kto_pipeline.recipe import read_recipe

    recipe = tmp_path / "trl.yaml"
    recipe.write_text("torch_compile: true\ntorch_compile_mode: reduce-overhead\ntorch_compile_backend: inductor\n")
    values = read_recipe(recipe, list(commands()["train"].callback.recipe_specs))
    assert values == {"torch_compile": True, "torch_compile_mode": "reduce-overhead"}
    assert "torch_compile_backend (trl's) has no effect here" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ trl's YAML files

TRL_YAML = """# written for `trl kto --config`, plus the one line `cache:`
model_name_or_path: {model}
dataset_name: {data}
dataset_train_split: train
output_dir: {out}
cache: {cache}
max_length: 64
learning_rate: 1.0e-3
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
max_steps: 2
logging_steps: 1
beta: 0.1
desirable_weight: 1.0
bf16: false
seed: 0
eval_strategy: "no"
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
"""


def test_a_trl_yaml_runs_both_stages_as_the_flags_do(tmp_path, monkeypatch, capsys, tiny_model_dir, unpaired_file):
    """One YAML written for `trl kto` plus `cache: DIR` runs precompute and then train, each taking its own keys (trl's
    names and ours) and skipping the other's; the cache and the run equal the same settings as flags."""
    recipe = write(
        tmp_path,
        TRL_YAML.format(model=tiny_model_dir, data=unpaired_file, out=tmp_path / "run-yaml", cache=tmp_path / "c-yaml"),
    )
    code, _, err = run_cli(monkeypatch, capsys, "precompute", "--config", str(recipe))
    assert code == 0, err
    assert "eval_strategy (trl's) has no effect here" in err
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", str(recipe))
    assert code == 0, err
    flags = cli_args(model=tiny_model_dir, dataset=unpaired_file, output=tmp_path / "c-flags", max_length=64)
    flags += ["--kl-seed", "0"]  # (`seed` in a precompute recipe is its KL seed, the name it had before)
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *flags, "--no-bf16")
    assert code == 0, err
    train_flags = cli_args(
        cache=tmp_path / "c-flags",
        output_dir=tmp_path / "run-flags",
        model=tiny_model_dir,
        max_length=64,
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        beta=0.1,
        seed=0,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules="q_proj,v_proj",
    )
    code, _, err = run_cli(monkeypatch, capsys, "train", *train_flags, "--no-bf16")
    assert code == 0, err
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("c-yaml", "c-flags"))
    assert {k: v for k, v in a["fingerprint"].items()} == b["fingerprint"]
    yaml_run, flag_run = (json.loads((tmp_path / d / "run_config.json").read_text()) for d in ("run-yaml", "run-flags"))
    assert yaml_run.pop("use_peft") is True and flag_run.pop("use_peft") is False
    for run in (yaml_run, flag_run):
        run.pop("output_dir"), run.pop("cache")
    assert yaml_run == flag_run and yaml_run["lora_r"] == 8
    losses = [[r["loss"] for r in read_metrics(tmp_path / d)] for d in ("run-yaml", "run-flags")]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("model_name_or_path: a\nmodel: a\n", "'model_name_or_path' and 'model' are the same option (--model)"),
        ("dataset_name: d\ndataset: d\n", "'dataset_name' and 'dataset' are the same option (--dataset)"),
        ("learnig_rate: 1.0\n", "unknown key 'learnig_rate' (did you mean 'learning_rate'?)"),
        ("model_name_or_pth: a\n", "unknown key 'model_name_or_pth' (did you mean 'model_name_or_path'?)"),
        # one file serves both stages: a typo gets the nearest key of either, naming the command that reads it
        ("learnin_rate: 1.0\n", "unknown key 'learnin_rate' (did you mean 'learning_rate' (train)?)"),
        ("precompute_ref_batch_sise: 8\n", "(did you mean 'precompute_ref_batch_size' (precompute)?)"),
    ],
)
def test_trl_yaml_mixed_or_misspelled_keys_are_refused(tmp_path, monkeypatch, capsys, captured, text, fragment):
    recipe = write(tmp_path, text)
    command = "train" if text.startswith(("learnig", "precompute_ref")) else "precompute"
    code, _, err = run_cli(monkeypatch, capsys, command, "--config", str(recipe))
    assert_clean_error(code, err, fragment)


def test_use_peft_takes_trls_default_rank():
    config = TrainConfig(cache="c", output_dir="o", use_peft=True)
    assert config.lora_r == 16
    assert TrainConfig(cache="c", output_dir="o", use_peft=True, lora_r=4).lora_r == 4
    assert TrainConfig(cache="c", output_dir="o").lora_r is None
