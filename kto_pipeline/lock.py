"""One writer per directory: an advisory lock that `precompute` takes on its cache directory and `train`
on its --output-dir, before any work starts, held until the run ends.

    with directory_lock(path, "precompute", label="--output"):   # one process
        ...
    with main_process_lock(path, "train", label="--output-dir"):  # one or several (accelerate launch) processes
        ...

`flock` on `PATH/.kto-pipeline.lock`, a small JSON file naming its holder (pid, host, command, start time):
a live holder is refused at once, by name; a dead one's lock (the kernel drops a flock when its process dies)
is taken over with a note; the file is deleted on release; where flock is unsupported, the file itself is the
lock (O_EXCL). Readers never look at it. The design, and why each step is safe: docs/design.md, "One writer
per directory: the lock".
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError

LOCK_FILE = ".kto-pipeline.lock"
OWN_FILES = ".kto-pipeline."  # the lock's and runtime.launch.check_same_directory's files, never a run's

# flock errors that mean "this filesystem does not do flock" (not "someone else holds it")
_FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


@dataclass
class DirectoryLock:
    """A lock held on `path`: its file, our record in it, and the record of a dead holder it replaced."""

    path: Path
    lock_file: Path
    record: dict[str, Any]
    took_over: dict[str, Any] | None = None  # the record a dead process left, if there was one
    flock: bool = True  # False: the filesystem has no flock, the O_EXCL fallback is in use


def holds_files(path: str | Path) -> bool:
    """Whether directory `path` holds anything besides the lock file and the shared-storage check's file (for "is
    the output dir empty?")."""
    return any(not p.name.startswith(OWN_FILES) for p in Path(path).iterdir())


@contextmanager
def directory_lock(
    path: str | Path, what: str, *, enabled: bool = True, label: str | None = None
) -> Iterator[DirectoryLock | None]:
    """Hold the lock of directory `path` (created if needed, parents too) for the `with` block.

    `what` names the command in the record ("precompute", "train"); `label` names the path in errors
    (e.g. "--output-dir"). Raises KTOPipelineError at once if a live process holds the lock. With
    `enabled=False` (the other processes of a multi-process run) nothing is done and None is yielded.
    """
    if not enabled:
        yield None
        return
    path = Path(path)
    created = _make_dirs(path, label)
    try:
        fd, lock = _acquire(path, what, label)
        try:
            yield lock
        finally:
            # Delete while still holding the lock, then release (see the module docstring): a process that
            # opened the old file meanwhile sees that the path no longer names it, and starts again.
            try:
                if lock.flock or _read_record(lock.lock_file) == lock.record:
                    lock.lock_file.unlink(missing_ok=True)
            finally:
                os.close(fd)
    finally:
        for directory in reversed(created):  # deepest first; only the ones this lock made, and only if empty
            try:
                directory.rmdir()
            except OSError:
                break


@contextmanager
def main_process_lock(path: str | Path, what: str, *, label: str | None = None) -> Iterator[DirectoryLock | None]:
    """`directory_lock` for a run of one or several processes (`accelerate launch`, torchrun).

    The main process takes the lock (creating the directory); the outcome is broadcast, so that when it is refused
    every process raises the same KTOPipelineError. Then every process checks that it sees the directory the main
    process locked (`runtime.launch.check_same_directory`: on several machines it must be shared storage). The lock
    is released when the main process leaves the block.
    """
    from kto_pipeline.runtime.launch import check_same_directory, main_decides, process_state

    state = process_state()  # the stage's, if it set the process group up first (with its timeout)
    with ExitStack() as stack:
        taken: list[DirectoryLock | None] = [None]

        def take() -> dict:
            taken[0] = stack.enter_context(directory_lock(path, what, label=label))
            return {}

        main_decides(state, take)
        check_same_directory(state, path, label or "the output directory")  # a lock no other node sees guards nothing
        yield taken[0]


# ------------------------------------------------------------------------------------------ internals


def _make_dirs(path: Path, label: str | None) -> list[Path]:
    """Create `path` and its missing parents; returns the directories created, outermost first."""
    named = f"{label} {path}" if label else str(path)
    if path.exists() and not path.is_dir():
        raise KTOPipelineError(f"{named} is a file. Choose a directory.")
    missing = [p for p in [path, *path.parents] if not p.exists()][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KTOPipelineError(
            f"cannot create {named}: {exc.strerror or exc}. Choose a directory you can write to."
        ) from exc
    return missing


def _new_record(what: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": f"kto-pipeline {what}",
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _acquire(path: Path, what: str, label: str | None) -> tuple[int, DirectoryLock]:
    import fcntl

    lock_file = path / LOCK_FILE
    for _ in range(100):  # a new attempt only when a holder released and deleted the file under us
        try:
            fd, created = _open(lock_file)
        except FileNotFoundError:  # the file (or the empty directory) was deleted under us: try again
            path.mkdir(parents=True, exist_ok=True)
            continue
        except OSError as exc:
            raise KTOPipelineError(
                f"cannot create the lock file {lock_file}: {exc.strerror or exc}. Choose a directory you can write to."
            ) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise KTOPipelineError(_refusal(path, lock_file, _read_fd_record(fd), what, label)) from None
            except OSError as exc:
                if exc.errno not in _FLOCK_UNSUPPORTED:
                    raise
                return fd, _acquire_without_flock(fd, path, lock_file, created, what, label)
            if not _same_file(fd, lock_file):
                os.close(fd)  # we locked a file its holder has just deleted: the path names another one now
                continue
            previous = None if created else _read_fd_record(fd, retries=0)
            lock = DirectoryLock(path, lock_file, _new_record(what), took_over=previous)
            _write_record(fd, lock.record)
            if previous:
                _note_takeover(previous, lock_file)
            return fd, lock
        except BaseException:
            os.close(fd)
            raise
    raise KTOPipelineError(f"could not take the lock {lock_file}: it keeps being replaced. Run again.")


def _open(lock_file: Path) -> tuple[int, bool]:
    """Open the lock file, creating it if needed: (fd, whether this call created it). Not inherited by exec'd
    subprocesses (os.open's default); forked children (data loader workers) do share it while they live."""
    try:
        return os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(lock_file, os.O_RDWR), False


def _same_file(fd: int, lock_file: Path) -> bool:
    try:
        on_path = os.stat(lock_file)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_path.st_dev, on_path.st_ino)


def _acquire_without_flock(
    fd: int, path: Path, lock_file: Path, created: bool, what: str, label: str | None
) -> DirectoryLock:
    """No flock on this filesystem: the O_EXCL creation is the lock; an existing file's holder is checked by pid."""
    lock = DirectoryLock(path, lock_file, _new_record(what), flock=False)
    if not created:
        holder = _read_fd_record(fd)
        same_host = holder is not None and holder.get("host") == socket.gethostname()
        if not (same_host and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"])):
            raise KTOPipelineError(_refusal(path, lock_file, holder, what, label, by_pid=True))
        lock.took_over = holder
        _note_takeover(holder, lock_file)
    _write_record(fd, lock.record)
    return lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _write_record(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)  # so that a process on another NFS client can read who holds it


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _read_fd_record(fd: int, retries: int = 10) -> dict[str, Any] | None:
    """The holder's record; None if the file is empty or unreadable. A holder writes its record just after it
    takes the lock, so an empty file is read again a few times."""
    for attempt in range(retries + 1):
        record = _parse(os.pread(fd, 1 << 16, 0))
        if record is not None or attempt == retries:
            return record
        time.sleep(0.05)
    return None


def _read_record(lock_file: Path) -> dict[str, Any] | None:
    try:
        return _parse(lock_file.read_bytes())
    except OSError:
        return None


def _describe(record: dict[str, Any]) -> str:
    return (
        f"`{record.get('command', 'kto-pipeline')}` (pid {record.get('pid', '?')} on host {record.get('host', '?')}, "
        f"started {record.get('started', '?')})"
    )


def _note_takeover(previous: dict[str, Any], lock_file: Path) -> None:
    print(
        f"note: took over the lock {lock_file} left by pid {previous.get('pid', '?')} on host "
        f"{previous.get('host', '?')} ({previous.get('command', 'kto-pipeline')}, started "
        f"{previous.get('started', '?')}, no longer running)",
        flush=True,
    )


def _refusal(
    path: Path, lock_file: Path, holder: dict[str, Any] | None, what: str, label: str | None, by_pid: bool = False
) -> str:
    """The error for a lock held by another process: who holds it, and what to do. `by_pid`: the holder was judged
    alive by its pid (the fallback without flock), which a new process may have reused."""
    named = f"{label} {path}" if label else str(path)
    remove = f"delete {lock_file} and run again"
    if holder is None:
        return (
            f"{named} is in use: another process holds its lock {lock_file} (its record is empty or unreadable). "
            f"Wait for it to finish, or choose another directory; if no kto-pipeline run is using {path}, {remove}."
        )
    text = f"{named} is in use by {_describe(holder)}, which holds its lock {lock_file}. "
    here = holder.get("host") == socket.gethostname()
    pid = holder.get("pid")
    if here and pid == os.getpid():
        return text + f"This very process holds it: a second `{what}` into the same directory cannot run inside it."
    text += f"Wait for it to finish, or choose another directory for this `kto-pipeline {what}`."
    if not here:
        text += f" If that process is no longer running (its machine crashed or lost the mount), {remove}."
    elif by_pid:
        text += f" If pid {pid} is not that run (it ended and the pid was reused), {remove}."
    elif isinstance(pid, int) and not _pid_alive(pid):
        text += (
            f" Pid {pid} has ended, but a process it started (e.g. a data loader worker) still holds the lock: end "
            "that process, then run again."
        )
    return text
