"""Preemption: SIGTERM / SIGUSR1 stop a stage at its next step boundary with its work kept (train: a checkpoint of
that step; precompute: the shards written), exit status 75 and the command that continues; `train --autoresume`
continues from the newest checkpoint or starts. The multi-process versions (FSDP2, a rank SIGTERMed; a rank
SIGKILLed under torchrun --max-restarts) are in tests/test_fsdp.py."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import cli_args, cli_cmd, launch_env, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, Preempted, precompute, train
from kto_pipeline.cache import open_cache, read_manifest
from kto_pipeline.runtime.preemption import StopRequests, continue_command
from kto_pipeline.stages.precompute import shards as precompute_stage
from kto_pipeline.stages.train import stage as train_stage

RUN = dict(max_steps=6, save_steps=4, per_device_train_batch_size=4)


def _signal_after_step(monkeypatch, step: int, sig: signal.Signals) -> None:
    """This process receives `sig` right after optimizer step `step` (its bookkeeping done)."""
    after_step = train_stage.after_step

    def after_step_then_signal(run, micro_step, bar):
        after_step(run, micro_step, bar)
        if run.progress.global_step == step:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(train_stage, "after_step", after_step_then_signal)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_checkpoints_the_step_and_autoresume_equals_the_uninterrupted_run(
    small_cache, tmp_path, monkeypatch, sig
):
    """SIGTERM, SIGUSR1 (a scheduler) and Ctrl-C (SIGINT, exit status 130) alike."""
    from safetensors.torch import load_file

    train(train_config(small_cache, tmp_path / "full", **RUN))
    out = tmp_path / "stopped"
    _signal_after_step(monkeypatch, 3, sig)
    with pytest.raises(Preempted, match=rf"{sig.name} received: stopped at step 3 of 6") as stopped:
        train(train_config(small_cache, out, **RUN))
    assert stopped.value.exit_code == (130 if sig == signal.SIGINT else 75)
    assert "autoresume=True" in str(stopped.value)  # called from Python: the API's way to continue
    assert (out / "checkpoint-3" / "trainer_state.json").exists()  # not a --save-steps step: written for the stop
    assert not (out / "model.safetensors").exists() and not (out / "trainer_state.json").exists()
    monkeypatch.undo()

    train(train_config(small_cache, out, autoresume=True, **RUN))
    assert read_metrics(out) == read_metrics(tmp_path / "full")  # each step once, bit for bit
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4", "checkpoint-6"]


def test_a_stop_at_a_save_step_writes_no_second_checkpoint(small_cache, tmp_path, monkeypatch):
    out = tmp_path / "stopped"
    _signal_after_step(monkeypatch, 4, signal.SIGTERM)
    with pytest.raises(Preempted, match=r"stopped at step 4 of 6, its checkpoint written \(.*checkpoint-4\)"):
        train(train_config(small_cache, out, **RUN))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]


def test_handlers_are_given_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with StopRequests() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._note
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(None) == "SIGUSR1"  # the first one received
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


def test_a_second_ctrl_c_stops_at_once(capfd):
    """Training's first Ctrl-C is a stop request, said at once; the second raises KeyboardInterrupt there."""
    before = signal.getsignal(signal.SIGINT)
    with StopRequests(interactive=True) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(None) == "SIGINT"
        assert "Ctrl-C: stopping after this step, with a checkpoint" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # (the handler runs between two bytecodes)
    assert signal.getsignal(signal.SIGINT) == before
    with StopRequests() as stop:  # precompute's: Ctrl-C interrupts at once, its written shards kept
        assert signal.getsignal(signal.SIGINT) == before


def test_resume_from_a_runs_directory_takes_its_newest_checkpoint(small_cache, tmp_path, capsys):
    done = tmp_path / "done"
    train(train_config(small_cache, done, max_steps=4, save_steps=2))
    train(train_config(small_cache, tmp_path / "more", max_steps=6, resume_from=str(done)))
    assert f"resuming from {done / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    train(train_config(small_cache, tmp_path / "none", max_steps=2))
    with pytest.raises(KTOPipelineError, match="a run's output directory with no checkpoint in it"):
        train(train_config(small_cache, tmp_path / "x", max_steps=4, resume_from=str(tmp_path / "none")))


def test_resume_knows_the_cache_by_its_rows_not_its_path(small_cache, tmp_path, tiny_model_dir):
    """The same cache spelled otherwise or moved continues; a cache made again in place with other rows does not."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    shutil.copytree(small_cache, cache)
    train(train_config(cache, out, max_steps=4, save_steps=2))
    train(train_config(f"{cache}/", out, max_steps=4, save_steps=2, resume=True))  # (finished: nothing to do)
    moved = cache.rename(tmp_path / "moved")
    train(train_config(moved, out, max_steps=6, save_steps=2, resume=True))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    data = write_jsonl(tmp_path / "other.jsonl", unpaired_rows(30))
    precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(moved), max_length=64, overwrite=True)
    )
    with pytest.raises(KTOPipelineError, match=r"not the rows the checkpoint trained on \(24 rows then, 30 now\)"):
        train(train_config(moved, out, max_steps=8, save_steps=2, resume=True))


def test_resuming_with_another_beta_or_rate_says_so(small_cache, tmp_path, capsys):
    out = tmp_path / "run"
    train(train_config(small_cache, out, max_steps=2, save_steps=2, beta=0.1))
    capsys.readouterr()
    train(train_config(small_cache, out, max_steps=3, save_steps=2, beta=0.3, learning_rate=2e-6, resume=True))
    printed = capsys.readouterr().out
    assert "note: resuming with other settings than the checkpoint's: --beta 0.1 -> 0.3, --learning-rate" in printed


def test_a_busy_output_dir_says_how_to_continue_it(small_cache, tmp_path):
    out = tmp_path / "run"
    train(train_config(small_cache, out, max_steps=2, save_steps=2))
    with pytest.raises(KTOPipelineError, match="newest checkpoint is checkpoint-2: --resume continues from there"):
        train(train_config(small_cache, out, max_steps=4))
    shutil.rmtree(out / "checkpoint-2")
    (out / "trainer_state.json").unlink()  # an unfinished run that wrote no checkpoint
    with pytest.raises(KTOPipelineError, match="unfinished run of these settings.*--autoresume starts it again"):
        train(train_config(small_cache, out, max_steps=2, save_steps=2))


def test_autoresume_starts_a_run_continues_it_and_refuses_another_runs_dir(small_cache, tmp_path):
    out = tmp_path / "run"
    # nothing there: it starts
    train(train_config(small_cache, out, autoresume=True, max_steps=2))
    assert read_metrics(out)[-1]["step"] == 2 and not list(out.glob("checkpoint-*"))
    # an unfinished run of the same settings that wrote no checkpoint (killed before its first): it starts again
    (out / "trainer_state.json").unlink()
    train(train_config(small_cache, out, autoresume=True, max_steps=2))
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    # another run's directory is not taken over
    (out / "trainer_state.json").unlink()
    with pytest.raises(KTOPipelineError, match="is not empty.*--autoresume found no checkpoint in it"):
        train(train_config(small_cache, out, autoresume=True, max_steps=2, seed=1))
    with pytest.raises(KTOPipelineError, match="choose one of --resume and --autoresume"):
        train_config(small_cache, out, autoresume=True, resume=True)


def test_autoresume_of_a_finished_run_has_nothing_to_do(small_cache, tmp_path):
    out = tmp_path / "run"
    train(train_config(small_cache, out, max_steps=2, save_steps=2))
    result = train(train_config(small_cache, out, autoresume=True, max_steps=2, save_steps=2))
    assert result.global_step == 2 and result.step_seconds == []


def test_continue_command_adds_the_flag_once(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/kto_pipeline/__main__.py", "train", "--output-dir", "o b"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert continue_command("--autoresume") == "`kto-pipeline train --output-dir 'o b' --autoresume`"
    monkeypatch.setattr(sys, "argv", ["kto-pipeline", "train", "--resume"])
    assert continue_command("--autoresume", unless=("--resume",)) == "`kto-pipeline train --resume`"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert continue_command() == "the same launch of `kto-pipeline train --resume`"


def test_precompute_stops_after_the_shards_in_flight_and_the_same_command_resumes(
    tmp_path, tiny_model_dir, monkeypatch
):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(40))
    config = dict(model=str(tiny_model_dir), dataset=str(data), max_length=64, shard_size=6)
    clean = precompute(PrecomputeConfig(output=str(tmp_path / "clean"), **config))
    score_round, rounds = precompute_stage._score_round, []

    def round_then_signal(run, first, *args):
        writing = score_round(run, first, *args)
        rounds.append(first)
        if len(rounds) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return writing

    monkeypatch.setattr(precompute_stage, "_score_round", round_then_signal)
    out = tmp_path / "stopped"
    with pytest.raises(Preempted, match=r"SIGUSR1 received: stopped after the shards in flight, 2/7 shards written"):
        precompute(PrecomputeConfig(output=str(out), **config))
    partial = read_manifest(out)
    assert not partial["complete"] and len(partial["shards"]) == 2
    monkeypatch.undo()
    precompute(PrecomputeConfig(output=str(out), **config))
    assert open_cache(out, verify=True).table.to_pylist() == open_cache(clean, verify=True).table.to_pylist()


@pytest.mark.slow
def test_sigterm_to_the_command_exits_75_with_the_command_that_continues(small_cache, tmp_path):
    out = tmp_path / "run"
    args = cli_args(cache=small_cache, output_dir=out, max_steps=400, save_steps=2, per_device_train_batch_size=4)
    proc = subprocess.Popen(
        cli_cmd("train", *args), env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint-2").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, (stdout[-2000:], stderr[-3000:])
    assert "stopped: SIGTERM received: stopped at step" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert f"--output-dir {out}" in stderr and stderr.rstrip().endswith("--autoresume`.")
    step = int(stderr.split("stopped at step ")[1].split()[0])
    assert (out / f"checkpoint-{step}" / "trainer_state.json").exists() and step < 400
