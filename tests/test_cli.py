"""The command line: real entry points, and every bad input ends in one readable line, exit 1."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_args, cli_cmd, run_cli, unpaired_rows, write_jsonl


def assert_clean_error(code, err, *fragments):
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith("error: ")
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    "rows,fragments",
    [
        ([{"prompt": "a", "response": "b", "label": True}] * 3, ["no 'completion' column"]),
        ([{"prompt": "a", "completion": "b", "label": "maybe"}] * 3, ["row 0: label 'maybe' is not a boolean"]),
        ([], ["holds no rows"]),
    ],
)
def test_bad_data(tmp_path, monkeypatch, capsys, tiny_model_dir, rows, fragments):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = cli_args(model=tiny_model_dir, dataset=data, output=tmp_path / "c")
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *args)
    assert_clean_error(code, err, *fragments)


def test_empty_dataset(tmp_path, monkeypatch, capsys, tiny_model_dir):
    from datasets import Dataset

    Dataset.from_dict({"prompt": [], "completion": [], "label": []}).to_parquet(str(tmp_path / "e.parquet"))
    args = cli_args(model=tiny_model_dir, dataset=tmp_path / "e.parquet", output=tmp_path / "c")
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *args)
    assert_clean_error(code, err, "holds no rows")


def test_missing_model(tmp_path, monkeypatch, capsys, unpaired_file):
    args = cli_args(model=tmp_path / "no-model", dataset=unpaired_file, output=tmp_path / "c")
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *args)
    assert_clean_error(code, err, "no such directory")


def test_output_holds_something_else(tmp_path, monkeypatch, capsys, tiny_model_dir, unpaired_file):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "thesis.tex").write_text("x")
    args = cli_args(model=tiny_model_dir, dataset=unpaired_file, output=tmp_path / "c")
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *args)
    assert_clean_error(code, err, "not a kto-pipeline cache")
    code, _, err = run_cli(
        monkeypatch, capsys, "train", "--cache", str(tmp_path / "c"), "--output-dir", str(tmp_path / "run")
    )
    assert_clean_error(code, err, "no manifest.json")


def test_max_length_above_cached_and_bad_flag(tmp_path, monkeypatch, capsys, small_cache):
    args = cli_args(cache=small_cache, output_dir=tmp_path / "r")
    code, _, err = run_cli(monkeypatch, capsys, "train", *args, "--max-length", "999")
    assert_clean_error(code, err, "--max-length 999 is above the cache's max length 64")
    code, _, err = run_cli(monkeypatch, capsys, "train", *args, "--loss-type", "dpo")
    assert_clean_error(code, err, "--loss-type: unknown 'dpo': each term must be one of kto, apo_zero_unpaired (KTO)")


def test_inspect(monkeypatch, capsys, small_cache):
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(small_cache))
    assert code == 0
    for fragment in ("reference model", "tokenizer", "dataset", "settings", "counts", "shards", "desirable", "OK"):
        assert fragment in out


@pytest.mark.slow
def test_end_to_end_with_real_processes(tmp_path, tiny_model_dir):
    """`kto-pipeline` (console script) and `python -m kto_pipeline` are the same CLI, end to end."""
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows())
    env = {**os.environ, "TQDM_DISABLE": "1"}
    script = shutil.which("kto-pipeline", path=str(Path(sys.executable).parent))
    assert script, "the console script is installed next to the interpreter"
    args = cli_args(model=tiny_model_dir, dataset=data, output=tmp_path / "cache", max_length=64)
    pre = subprocess.run([script, "precompute", *args], capture_output=True, text=True, env=env)
    assert pre.returncode == 0, pre.stderr
    assert "24 (16 desirable, 8 undesirable)" in pre.stdout
    bar = re.compile(r"\d+%\|")  # a tqdm progress bar
    assert not bar.search(pre.stderr), "TQDM_DISABLE=1 silences the reference pass's progress bar"
    for name, beta, quiet in (("a", "0.1", True), ("b", "0.5", False)):
        args = cli_args(cache=tmp_path / "cache", output_dir=tmp_path / name, beta=beta, max_steps=2)
        args += cli_args(per_device_train_batch_size=4, logging_steps=1)
        run_env = env if quiet else {k: v for k, v in env.items() if k != "TQDM_DISABLE"}
        run = subprocess.run(cli_cmd("train", *args), capture_output=True, text=True, env=run_env)
        assert run.returncode == 0, run.stderr
        assert bool(bar.search(run.stderr)) is not quiet, run.stderr  # the bar, unless TQDM_DISABLE=1
        assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 2
        assert json.loads((tmp_path / name / "run_config.json").read_text())["beta"] == float(beta)
    args = cli_args(cache=tmp_path / "nope", output_dir=tmp_path / "c")
    bad = subprocess.run(cli_cmd("train", *args), capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "no such directory" in bad.stderr


@pytest.mark.slow
def test_demo_learns(tmp_path):
    from kto_pipeline.demo.run import run_tiny_demo

    summary = run_tiny_demo(tmp_path / "demo")
    assert summary["margin_end"] > summary["margin_start"] + 1.0
    assert summary["heldout_accuracy_after"] > 0.7


def test_the_command_line_takes_trls_underscore_spellings(tiny_model_dir, unpaired_file, tmp_path, monkeypatch):
    """trl's parser takes `--max_length` as `--max-length`: so does ours, for every option of every command (and
    `--no_` for a flag's negation), never after a bare `--` nor for what is no option; trl's names for options of
    ours (`--resume_from_checkpoint`, `--model_name_or_path`) too."""
    from kto_pipeline.cli import main, trl_spellings

    argv = ["train", "--per_device_train_batch_size", "4", "--output_dir=x", "--no_gradient_checkpointing"]
    argv += ["--resume_from_checkpoint", "c", "--model-name-or-path=m", "--not_an_option", "a_b", "--", "--max_length"]
    assert trl_spellings(argv) == [
        "train",
        "--per-device-train-batch-size",
        "4",
        "--output-dir=x",
        "--no-gradient-checkpointing",
        "--resume-from",  # trl's names for options of ours
        "c",
        "--model=m",
        "--not_an_option",
        "a_b",
        "--",
        "--max_length",
    ]
    cache = tmp_path / "cache"
    argv = ["precompute", "--model", str(tiny_model_dir), "--dataset", str(unpaired_file), "--output", str(cache)]
    monkeypatch.setattr(sys, "argv", ["kto-pipeline", *argv, "--max_length", "48", "--kl_seed", "3"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["settings"]["max_length"] == 48 and manifest["settings"]["kl_seed"] == 3, manifest["settings"]
