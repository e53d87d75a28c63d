"""Held-out evaluation, sweeps on one cache, reports (PNG + HTML) and TensorBoard logging."""

import csv
import json

import pytest
from helpers import cli_args, launch, read_metrics

from kto_pipeline import KTOPipelineError, TrainConfig, train
from kto_pipeline.report import write_report
from kto_pipeline.sweep import expand_grid, run_name, sweep


def test_grid_and_names():
    grid, varied = expand_grid({"beta": "0.05,0.1,0.3", "learning_rate": "5e-7,1e-6", "seed": "1", "bf16": None})
    assert len(grid) == 6 and varied == ["beta", "learning_rate"]
    assert grid[0] == {"beta": 0.05, "learning_rate": 5e-7, "seed": 1}
    assert run_name(grid[0], varied) == "beta0.05-lr5e-07"
    assert run_name({"loss_type": "apo_zero_unpaired"}, ["loss_type"]) == "apo_zero_unpaired"
    with pytest.raises(KTOPipelineError, match="--beta: cannot read 'high'"):
        expand_grid({"beta": "0.1,high"})
    with pytest.raises(KTOPipelineError, match="cannot be swept"):
        expand_grid({"cache": "a,b"})


def test_evaluation_logs_eval_metrics_and_final_eval(small_cache, tmp_path):
    out = tmp_path / "run"
    train(
        TrainConfig(
            cache=str(small_cache),
            output_dir=str(out),
            per_device_train_batch_size=4,
            max_steps=5,
            logging_steps=1,
            eval_cache=str(small_cache),
            eval_steps=2,
            learning_rate=2e-3,
            seed=0,
        )
    )
    records = read_metrics(out)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]  # every --eval-steps, and a final one
    for r in evals:
        assert 0.0 <= r["eval_reward_accuracy"] <= 1.0
        for key in (
            "eval_kl",
            "eval_rewards/chosen",
            "eval_rewards/rejected",
            "eval_rewards/margins",
            "eval_logps/chosen",
            "eval_rows",
        ):
            assert key in r
        assert r["eval_rows"] == 24  # the whole eval set
    train_records = [r for r in records if "loss" in r]
    assert len(train_records) == 5


def test_evaluation_at_step_zero_policy_is_reference(small_cache, tmp_path):
    """With lr 0 the policy stays the reference: every eval reward is 0, so no row has the right sign."""
    out = tmp_path / "run"
    train(
        TrainConfig(
            cache=str(small_cache),
            output_dir=str(out),
            per_device_train_batch_size=4,
            max_steps=1,
            eval_cache=str(small_cache),
            eval_steps=1,
            learning_rate=0.0,
        )
    )
    (final,) = [r for r in read_metrics(out) if "eval_loss" in r]
    assert abs(final["eval_rewards/chosen"]) < 1e-4 and abs(final["eval_rewards/rejected"]) < 1e-4
    assert final["eval_loss"] == pytest.approx(0.5, abs=1e-4)


def test_eval_cache_with_another_tokenizer_is_refused(small_cache, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(small_cache, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["hash"] = "sha256:0"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KTOPipelineError, match="--eval-cache .* another tokenizer"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "r"), eval_cache=str(other)))


def test_sweep_runs_grid_skips_finished_and_reports(small_cache, tmp_path, capsys):
    out = tmp_path / "sweep"
    values = {
        "beta": "0.05,0.3",
        "learning_rate": "2e-3",
        "max_steps": "3",
        "per_device_train_batch_size": "4",
        "logging_steps": "1",
        "eval_steps": "3",
    }
    rows = sweep(str(small_cache), str(out), values | {"eval_cache": str(small_cache)}, keep="best")
    assert sorted(r["run"] for r in rows) == ["beta0.05", "beta0.3"]
    accs = [r["eval_reward_accuracy"] for r in rows]
    assert accs == sorted(accs, reverse=True)  # best first
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == [r["run"] for r in rows]
    for col in ("beta", "learning_rate", "final_loss", "final_margin", "final_kl", "eval_reward_accuracy"):
        assert col in table[0]
    assert "best first" in (out / "summary.md").read_text()
    best, other = rows[0]["run"], rows[1]["run"]
    assert (out / best / "model.safetensors").exists() and not (out / other / "model.safetensors").exists()
    assert (out / other / "metrics.jsonl").exists() and (out / other / "run_config.json").exists()

    mtime = (out / best / "metrics.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    sweep(str(small_cache), str(out), values | {"eval_cache": str(small_cache)})
    assert capsys.readouterr().out.count("already finished, skipped") == 2
    assert (out / best / "metrics.jsonl").stat().st_mtime_ns == mtime

    html = write_report(out)
    plots = json.loads((out / "report" / "plots.json").read_text())
    series_plotted = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "eval_reward_accuracy")
    for series in (*series_plotted, "eval_rewards/margins"):
        png = out / "report" / (series.replace("/", "_") + ".png")
        assert png.exists() and png.stat().st_size > 1000, series
        assert set(plots[series]) == {"beta0.05", "beta0.3"}  # both runs overlaid
    assert plots["loss"]["beta0.05"] == 3 and plots["eval_reward_accuracy"]["beta0.3"] == 1
    text = html.read_text()
    assert text.count("data:image/png;base64,") == 7 and "beta0.05" in text and "<table>" in text


def test_report_on_a_single_run(small_cache, tmp_path):
    out = tmp_path / "run"
    train(
        TrainConfig(
            cache=str(small_cache), output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1
        )
    )
    write_report(out)
    plots = json.loads((out / "report" / "plots.json").read_text())
    assert plots["loss"] == {"run": 2} and "eval_reward_accuracy" not in plots
    (tmp_path / "empty").mkdir()
    with pytest.raises(KTOPipelineError, match="no metrics.jsonl"):
        write_report(tmp_path / "empty")


def test_tensorboard_gets_the_same_metrics(small_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(
        TrainConfig(
            cache=str(small_cache),
            output_dir=str(out),
            per_device_train_batch_size=4,
            max_steps=3,
            logging_steps=1,
            report_to="tensorboard",
            eval_cache=str(small_cache),
            eval_steps=3,
        )
    )
    event_files = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert event_files
    acc = EventAccumulator(str(event_files[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "kl", "rewards/margins", "learning_rate", "eval_reward_accuracy"):
        assert tag in tags, tags
    losses = [e.value for e in acc.Scalars("loss")]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(out) if "loss" in r], rel=1e-6)


def test_report_to_unknown_or_missing_tracker(small_cache, tmp_path):
    with pytest.raises(KTOPipelineError, match="--report-to"):
        TrainConfig(cache=str(small_cache), output_dir=str(tmp_path), report_to="mlflowz")


@pytest.mark.slow
def test_sweep_under_two_processes_runs_the_grid_once(tmp_path, small_cache):
    out = tmp_path / "sweep"
    args = cli_args(cache=small_cache, output_dir=out, beta="0.1,0.2", max_steps=2, per_device_train_batch_size=2)
    args += cli_args(logging_steps=1, eval_cache=small_cache, per_device_eval_batch_size=5)
    proc = launch(2, "sweep", *args, env=dict(ACCELERATE_USE_CPU="1"), log_dir=tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("sweep: 2 runs") == 1
    for name in ("beta0.1", "beta0.2"):
        records = read_metrics(out / name)
        assert [r["step"] for r in records if "loss" in r] == [1, 2]  # one run, not one per process
        (final_eval,) = [r for r in records if "eval_loss" in r]
        assert final_eval["eval_rows"] == 24  # 24 rows over 2 processes in batches of 5: none counted twice
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 2


def test_list_valued_flags_are_not_split():
    grid, varied = expand_grid({"lora_target_modules": "q_proj,v_proj", "report_to": "none", "beta": "0.1,0.2"})
    assert varied == ["beta"] and all(g["lora_target_modules"] == "q_proj,v_proj" for g in grid)


def test_sweep_rerun_with_other_settings_trains_again(small_cache, tmp_path, capsys):
    out = tmp_path / "sweep"
    values = {"beta": "0.1,0.2", "max_steps": "1", "per_device_train_batch_size": "4"}
    sweep(str(small_cache), str(out), values)
    capsys.readouterr()
    sweep(str(small_cache), str(out), {**values, "max_steps": "2"})
    assert "already finished" not in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "beta0.1")] == [2]


def test_eval_set_with_no_row_at_this_length_is_refused_before_training(small_cache, tmp_path, tiny_model_dir):
    from helpers import write_jsonl

    from kto_pipeline import PrecomputeConfig, precompute

    rows = [{"prompt": "long prompt " * 8, "completion": " ok", "label": i % 2 == 0} for i in range(4)]
    eval_cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(write_jsonl(tmp_path / "e.jsonl", rows)),
            output=str(tmp_path / "ec"),
            max_length=128,
        )
    )
    with pytest.raises(KTOPipelineError, match="--eval-cache .* no row fits --max-length 64"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "r"), eval_cache=str(eval_cache)))
    assert not (tmp_path / "r").exists()
