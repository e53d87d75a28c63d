"""One writer per directory (kto_pipeline/lock.py): a second writer into a directory that a live process holds
refuses at once, naming it; a lock left by a dead process is taken over with a note; readers never look."""

import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import launch, run_cli, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, train
from kto_pipeline.cache import open_cache
from kto_pipeline.lock import LOCK_FILE, directory_lock, holds_files

HOST = socket.gethostname()

# A process that holds the lock until it reads a line on stdin (or is killed). `import kto_pipeline` does not
# import torch, so the holder starts in a fraction of a second.
HOLDER = r"""
import sys
from kto_pipeline.lock import directory_lock

with directory_lock(sys.argv[1], sys.argv[2]):
    print("locked", flush=True)
    sys.stdin.readline()
print("released", flush=True)
"""


@pytest.fixture
def hold():
    """hold(path, what) -> a live child process that holds the lock of `path`; every child is killed at the end."""
    children: list[subprocess.Popen] = []

    def start(path: Path, what: str = "precompute") -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), what],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline() if ready else ""
        assert line == "locked\n", f"the holder did not take the lock: {line!r} {child.stderr.read() if ready else ''}"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()


def release(child: subprocess.Popen) -> str:
    """Let a holder leave its `with` block normally; returns its output."""
    out, _ = child.communicate("\n", timeout=30)
    assert child.returncode == 0
    return out


def kill(child: subprocess.Popen) -> None:
    """SIGKILL: no cleanup runs, the lock file stays (but the kernel drops the flock)."""
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def record(path: Path) -> dict:
    return json.loads((path / LOCK_FILE).read_text())


# ------------------------------------------------------------------------------------------ the lock


def test_second_lock_refused_at_once_naming_the_holder(tmp_path, hold):
    cache = tmp_path / "cache"
    holder = hold(cache, "precompute")
    held = record(cache)
    assert held["pid"] == holder.pid and held["host"] == HOST and held["command"] == "kto-pipeline precompute"

    started = time.monotonic()
    with pytest.raises(KTOPipelineError) as refused:
        with directory_lock(cache, "precompute", label="--output"):
            pytest.fail("a second holder got in")
    assert time.monotonic() - started < 5  # at once, not after waiting for the holder
    message = str(refused.value)
    for fragment in (
        f"--output {cache} is in use",
        f"pid {holder.pid} on host {HOST}",
        "`kto-pipeline precompute`",
        f"started {held['started']}",
        "Wait for it to finish, or choose another directory",
    ):
        assert fragment in message, (fragment, message)
    assert record(cache) == held  # the refused attempt left the holder's record alone

    assert release(holder) == "released\n"
    assert not (cache / LOCK_FILE).exists()  # the holder deleted its lock file on the way out
    with directory_lock(cache, "precompute") as lock:
        assert lock.took_over is None and record(cache)["pid"] == os.getpid()


def test_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path, hold, capsys):
    out = tmp_path / "run"
    holder = hold(out, "train")
    old = record(out)
    kill(holder)
    assert record(out) == old  # killed: the file is still there, but its flock died with the process

    with directory_lock(out, "train") as lock:
        assert lock.took_over == old
        assert record(out)["pid"] == os.getpid()
    note = capsys.readouterr().out
    assert f"took over the lock {out / LOCK_FILE} left by pid {holder.pid} on host {HOST}" in note
    assert f"started {old['started']}, no longer running" in note
    assert not (out / LOCK_FILE).exists()


def test_released_and_deleted_after_normal_exit_and_exceptions(tmp_path):
    out = tmp_path / "run"
    with directory_lock(out, "train") as lock:
        assert lock.lock_file == out / LOCK_FILE and record(out)["pid"] == os.getpid()
        assert not holds_files(out)  # the lock file alone does not make a directory "not empty"
        (out / "model.safetensors").write_text("")
        assert holds_files(out)
    assert not (out / LOCK_FILE).exists() and (out / "model.safetensors").exists()

    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with directory_lock(out, "train"):
                raise exc
        assert not (out / LOCK_FILE).exists()
        with directory_lock(out, "train") as lock:  # free again, and nothing left to take over
            assert lock.took_over is None

    # A directory that only the lock created, left empty (a run refused by a later check), is removed again.
    fresh = tmp_path / "new" / "run"
    with pytest.raises(KTOPipelineError, match="refused later"):
        with directory_lock(fresh, "train"):
            raise KTOPipelineError("refused later")
    assert not (tmp_path / "new").exists()


def test_same_process_disabled_and_file_in_the_way(tmp_path):
    out = tmp_path / "run"
    with directory_lock(out, "train"):  # flock locks belong to an open file: a second one in this process fails
        with pytest.raises(KTOPipelineError, match="This very process holds it"):
            with directory_lock(out, "train"):
                pass
    with directory_lock(tmp_path / "rank1", "train", enabled=False) as lock:  # not the main process
        assert lock is None
    assert not (tmp_path / "rank1").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(KTOPipelineError, match="--output-dir .*file is a file. Choose a directory"):
        with directory_lock(tmp_path / "file", "train", label="--output-dir"):
            pass


def test_fallback_without_flock(tmp_path, monkeypatch, capsys):
    """A filesystem without flock (some NFS): the O_EXCL-created file is the lock, holders checked by pid."""
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()  # (else the lock, which created it, would remove it again, empty)
    with directory_lock(out, "precompute") as lock:
        assert not lock.flock and record(out)["pid"] == os.getpid()
    assert not (out / LOCK_FILE).exists()

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = {"pid": ended.pid, "host": HOST, "command": "kto-pipeline precompute", "started": "2026-01-01T00:00:00"}
    (out / LOCK_FILE).write_text(json.dumps(stale))
    with directory_lock(out, "precompute") as lock:
        assert lock.took_over == stale
    assert f"left by pid {ended.pid} on host {HOST}" in capsys.readouterr().out
    assert not (out / LOCK_FILE).exists()

    alive = {**stale, "pid": os.getppid()}
    (out / LOCK_FILE).write_text(json.dumps(alive))
    with pytest.raises(KTOPipelineError, match=f"pid {os.getppid()} on host {HOST}.*pid was reused"):
        with directory_lock(out, "precompute"):
            pass
    elsewhere = {**stale, "host": "other-node"}
    (out / LOCK_FILE).write_text(json.dumps(elsewhere))
    with pytest.raises(KTOPipelineError, match="on host other-node.*crashed or lost the mount.*delete"):
        with directory_lock(out, "precompute"):
            pass
    assert record(out) == elsewhere  # a refused run never touches the holder's file


# ------------------------------------------------------------------------------------------ train and readers


def test_train_refuses_an_output_dir_held_by_a_live_run(tmp_path, hold, small_cache, monkeypatch, capsys):
    out = tmp_path / "run"
    holder = hold(out, "train")  # stands in for a live `kto-pipeline train` into the same directory
    args = ("train", "--cache", str(small_cache), "--output-dir", str(out), "--max-steps", "1")
    code, stdout, err = run_cli(monkeypatch, capsys, *args, "--per-device-train-batch-size", "4")
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    assert f"--output-dir {out} is in use by `kto-pipeline train` (pid {holder.pid} on host {HOST}" in err
    assert "kto-pipeline train" not in stdout  # refused before anything started (no banner)
    assert os.listdir(out) == [LOCK_FILE]

    # The holder dies without cleanup: the next train takes its lock over (the stale lock file does not make the
    # directory "not empty") and runs to the end; the finished directory keeps no lock file.
    kill(holder)
    code, stdout, err = run_cli(monkeypatch, capsys, *args, "--per-device-train-batch-size", "4")
    assert code == 0, err
    assert f"took over the lock {out / LOCK_FILE} left by pid {holder.pid} on host {HOST}" in stdout
    assert (out / "model.safetensors").exists() and not (out / LOCK_FILE).exists()


def test_precompute_refuses_a_cache_dir_held_by_a_live_run(tmp_path, hold, tiny_model_dir, monkeypatch, capsys):
    cache, data = tmp_path / "cache", write_jsonl(tmp_path / "d.jsonl", unpaired_rows(8))
    holder = hold(cache, "precompute")  # stands in for a live `kto-pipeline precompute` writing this cache
    args = ("precompute", "--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(cache))
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 1 and "Traceback" not in err
    assert f"--output {cache} is in use by `kto-pipeline precompute` (pid {holder.pid} on host {HOST}" in err
    assert "kto-pipeline precompute" not in stdout and os.listdir(cache) == [LOCK_FILE]  # refused before any work

    kill(holder)
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert f"took over the lock {cache / LOCK_FILE} left by pid {holder.pid} on host {HOST}" in stdout
    assert open_cache(cache).manifest["complete"] and not (cache / LOCK_FILE).exists()


def test_readers_never_look_at_the_lock(tmp_path, hold, small_cache, monkeypatch, capsys):
    cache = Path(shutil.copytree(small_cache, tmp_path / "cache"))
    hold(tmp_path / "other-cache", "precompute")  # a precompute writing another cache meanwhile
    live = hold(cache, "precompute")  # and even one holding this complete cache (it found nothing to do)
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(cache), "--verify")
    assert code == 0 and "OK" in out
    assert train(train_config(cache, tmp_path / "run", max_steps=1)).global_step == 1

    kill(live)  # a lock file left in the cache by a dead process: still nothing for readers
    assert (cache / LOCK_FILE).exists()
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(cache), "--verify")
    assert code == 0 and "OK" in out and LOCK_FILE not in out
    assert len(open_cache(cache, verify=True)) == len(open_cache(small_cache))
    assert (cache / LOCK_FILE).exists()  # readers leave it alone


@pytest.mark.slow
def test_two_process_train_refused_on_every_rank(tmp_path, hold, small_cache):
    """Under torchrun only the main process takes the lock; the refusal reaches the other rank too (no hang)."""
    out = tmp_path / "run"
    holder = hold(out, "train")
    args = ["train", "--cache", str(small_cache), "--output-dir", str(out), "--per-device-train-batch-size", "2"]
    result = launch(2, *args, env=dict(ACCELERATE_USE_CPU="1"), log_dir=tmp_path / "logs", fails=True)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if "error: " in line and "is in use by" in line]
    assert len(refusals) == 2, result.stderr[-3000:]
    assert all(f"pid {holder.pid} on host {HOST}" in line for line in refusals)
    assert os.listdir(out) == [LOCK_FILE]
