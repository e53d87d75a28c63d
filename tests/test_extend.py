"""Runs you can extend: with --save-steps the last step is checkpointed too, so a finished run continues with a
larger --max-steps (or --num-train-epochs) and --resume; the learning-rate schedule is laid over the new total."""

import json

import pytest
from helpers import read_metrics, run_cli, train_config

from kto_pipeline import KTOPipelineError, train
from kto_pipeline.objectives import objective_for
from kto_pipeline.stages.train import stage as train_module

cfg = train_config


def record_forwards(monkeypatch, out):
    """Per training forward pass: the batch's example ids, and whether OUT looked finished (trainer_state.json)."""
    seen = []
    kto = objective_for("kto")
    forward = kto.forward

    def recording(accelerator, scorer, batch, *args, **kw):
        seen.append((batch["example_id"].tolist(), (out / "trainer_state.json").exists()))
        return forward(accelerator, scorer, batch, *args, **kw)

    monkeypatch.setattr(kto, "forward", recording)
    return seen


def record_saves(monkeypatch):
    steps = []
    save = train_module.save_checkpoint

    def recording(engine, module, optimizer, tokenizer, out, state, *args, **kw):
        steps.append(state.global_step)
        return save(engine, module, optimizer, tokenizer, out, state, *args, **kw)

    monkeypatch.setattr(train_module, "save_checkpoint", recording)
    return steps


def checkpoints(out):
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_finished_run_extends_from_its_last_checkpoint(small_cache, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    saves = record_saves(monkeypatch)
    train(cfg(small_cache, out, max_steps=4, save_steps=2))
    assert saves == [2, 4]  # the last step once, although it is also a multiple of --save-steps
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    # 24 rows / 4 a batch = 6 batches an epoch: step 4 is in the middle of epoch 0
    assert (state["global_step"], state["epoch_index"], state["batches_in_epoch"], state["max_steps"]) == (4, 0, 4, 4)
    four = read_metrics(out)
    capsys.readouterr()

    forwards = record_forwards(monkeypatch, out)
    result = train(cfg(small_cache, out, max_steps=6, save_steps=2, resume=True))
    printed = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoint-4'} at step 4" in printed
    assert "note: the run now has 6 steps (its checkpoint's run had 4)" in printed
    assert "step 5 trains at 0.000333 (the old schedule's next rate: 0)" in printed
    assert result.global_step == 6 and saves == [2, 4, 6]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[:4] == four  # the finished run's records, kept once
    # linear decay to 0: the 4-step run used 1e-3 .. 2.5e-4 (and its schedule ended at 0); steps 5-6 use the
    # rates of a schedule over 6 steps, 1e-3 * 2/6 and 1e-3 * 1/6 (not 0, the rate the optimizer was saved with)
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 1e-3 / 3, 1e-3 / 6])
    assert len(forwards) == 2 and not any(finished for _, finished in forwards)  # not "finished" while extending
    extension_ids = [ids for ids, _ in forwards]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    assert json.loads((out / "config.json").read_text())["kto_pipeline_run"]["max_steps"] == 6
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    # an uninterrupted 6-step run sees the same rows at steps 5-6, at the same rates
    full = tmp_path / "full"
    full_forwards = record_forwards(monkeypatch, full)
    train(cfg(small_cache, full, max_steps=6))
    assert [ids for ids, _ in full_forwards[4:]] == extension_ids
    assert [m["learning_rate"] for m in read_metrics(full)[4:]] == pytest.approx([1e-3 / 3, 1e-3 / 6])

    # the same command again: nothing left to do, nothing touched
    weights = (out / "model.safetensors").stat().st_mtime_ns
    forwards.clear()
    capsys.readouterr()
    again = train(cfg(small_cache, out, max_steps=6, save_steps=2, resume=True))
    assert "nothing to do" in capsys.readouterr().out
    assert again.global_step == 6 and forwards == [] and saves == [2, 4, 6]
    assert (out / "model.safetensors").stat().st_mtime_ns == weights and read_metrics(out) == metrics
    assert (out / "trainer_state.json").exists()

    with pytest.raises(KTOPipelineError, match="it is at step 6, past this run's 5 steps"):
        train(cfg(small_cache, out, max_steps=5, save_steps=2, resume=True))


def test_more_epochs_continue_like_an_uninterrupted_run(small_cache, tmp_path, monkeypatch, capsys):
    """With a constant schedule the total does not matter, so 1 epoch + 1 more equals 2 epochs bit for bit: the data
    position (end of epoch 0), the optimizer, the RNG and the metrics all carry over. --save-total-limit holds."""
    from safetensors.torch import load_file

    out, full = tmp_path / "run", tmp_path / "full"
    base = dict(max_steps=-1, lr_scheduler_type="constant", save_steps=4, save_total_limit=1)
    saves = record_saves(monkeypatch)
    train(cfg(small_cache, out, num_train_epochs=1, **base))  # 6 steps: saved at 4 and at the last, 6
    assert saves == [4, 6] and checkpoints(out) == ["checkpoint-6"]
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert (state["epoch_index"], state["batches_in_epoch"]) == (1, 0)
    capsys.readouterr()
    train(cfg(small_cache, out, num_train_epochs=2, resume=True, **base))
    assert "note: the run now has 12 steps (its checkpoint's run had 6)" in capsys.readouterr().out
    assert checkpoints(out) == ["checkpoint-12"]

    train(cfg(small_cache, full, num_train_epochs=2, max_steps=-1, lr_scheduler_type="constant"))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 13)) and metrics[-1]["epoch"] == 2.0
    assert metrics == read_metrics(full)
    a, b = load_file(out / "model.safetensors"), load_file(full / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_cli_extends_a_finished_run(small_cache, tmp_path, monkeypatch, capsys):
    """What a new user types: a 4-step run, then the same command with --max-steps 6 --resume, then once more."""
    out = tmp_path / "run"
    args = ["train", "--cache", str(small_cache), "--output-dir", str(out), "--logging-steps", "1", "--save-steps", "2"]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--max-steps", "4")
    assert code == 0, err
    code, printed, err = run_cli(monkeypatch, capsys, *args, "--max-steps", "6", "--resume")
    assert code == 0, err
    assert "at step 4" in printed and "the run now has 6 steps" in printed and "train finished: 6 steps" in printed
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    code, printed, err = run_cli(monkeypatch, capsys, *args, "--max-steps", "6", "--resume")
    assert code == 0, err
    assert "nothing to do" in printed and "train finished" not in printed
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_the_phases_of_train_called_one_by_one(small_cache, tmp_path):
    """`train` is setup -> resume -> prepare_output_dir -> fit -> finish; called one by one they give the run
    `train` gives, and each leaves the run directory as its contract says: setup writes nothing, an extension
    has no finished mark (trainer_state.json) until `finish` writes the state it ended in."""
    from kto_pipeline.rundir import TrainerState, finished_at
    from kto_pipeline.runtime.peak_memory import PeakMemory
    from kto_pipeline.stages.train import stage as stage

    out, whole = tmp_path / "run", tmp_path / "whole"
    train(cfg(small_cache, whole, max_steps=6, lr_scheduler_type="constant"))
    train(cfg(small_cache, out, max_steps=4, save_steps=2, lr_scheduler_type="constant"))
    assert finished_at(out) == 4

    with PeakMemory() as peaks:  # as the stage holds it
        run = stage.setup(
            cfg(small_cache, out, max_steps=6, save_steps=2, resume=True, lr_scheduler_type="constant"), peaks
        )
        assert run.total_steps == 6 and run.resume_dir == out / "checkpoint-4" and finished_at(out) == 4
        assert stage.resume(run) is None  # restored, with steps left to train
        assert run.progress.global_step == 4 and len(run.progress.history) == 4
        stage.prepare_output_dir(run)
        assert finished_at(out) is None and not (out / "trainer_state.json").exists()
        stage.fit(run)
        assert run.progress.global_step == 6 and finished_at(out) is None
        result = stage.finish(run)
    state = TrainerState.read(out)
    assert result.global_step == state.global_step == finished_at(out) == 6
    assert (state.max_steps, state.epoch_index, state.batches_in_epoch) == (6, 1, 0)  # 6 batches an epoch
    assert state.tokens_executed >= state.tokens_needed > 0 and state.packing == "packed"
    assert state.attention_kernel == "by-tree"  # the CPU's default
    assert read_metrics(out) == read_metrics(whole)  # a constant rate: the records of the uninterrupted run
