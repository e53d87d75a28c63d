"""Files: their sha256 (with marks that remember a verified file, so a cache is read in full once), the hashes that
fingerprint a tokenizer and a model's weights, and writes that replace a file atomically (written under a temporary
name, flushed, fsynced, renamed, its folder fsynced). Used by the cache, the engines, `generate` and `label`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

VERIFIED_DIR_ENV = "KTO_PIPELINE_VERIFIED_DIR"  # where the marks of verified shards go (`verified_dir`)


def sha256_file(path: str | Path, into=None) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks; with `into` (a hashlib object), feed it the bytes too."""
    h = hashlib.sha256() if into is None else into
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_matches(path: Path, expected: str, again: bool = False) -> bool:
    """Whether the file at `path` has the sha256 `expected`, reading it only where no mark says it had it when last
    read (or written) as it is now (path, size, modification time, inode); `again`: read it whatever the marks say.
    A match leaves a mark (`verified_mark`), so a cache is read in full once, not by every run of a sweep."""
    mark = None if again else verified_mark(path, expected)
    if mark is not None and mark.exists():
        return True
    if sha256_file(path) != expected:
        return False
    remember_verified(path, expected)
    return True


def verified_mark(path: Path, sha256: str) -> Path | None:
    """The empty file whose presence says `path` had `sha256` as it is now; None where it cannot be named."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{sha256}"
    return verified_dir() / hashlib.sha256(key.encode()).hexdigest()[:40]


def remember_verified(path: Path, sha256: str) -> None:
    """Mark `path` as having `sha256` now (where the marks' folder cannot be written, nothing is remembered)."""
    mark = verified_mark(path, sha256)
    if mark is None:
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError:
        pass


def verified_dir() -> Path:
    """Where the marks of verified shards go: $KTO_PIPELINE_VERIFIED_DIR, else kto-pipeline/verified in the user's
    cache folder ($XDG_CACHE_HOME, else ~/.cache); never inside a cache, which may be shared or read-only."""
    if os.environ.get(VERIFIED_DIR_ENV):
        return Path(os.environ[VERIFIED_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kto-pipeline" / "verified"


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary, the special tokens and the chat template."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "added_tokens": sorted((str(t), i) for i, t in tokenizer.added_tokens_decoder.items()),
        "chat_template": tokenizer.chat_template,
    }
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class WeightsHash:
    """sha256 over each tensor's name, dtype, shape and bytes, in the order they are added (`model_weights_hash`).
    A tensor's bytes may come in pieces (`add_bytes` again), as a partitioned parameter's partitions do."""

    def __init__(self):
        self._sha = hashlib.sha256()

    def add_header(self, name: str, dtype, shape) -> None:
        self._sha.update(f"{name}|{dtype}|{tuple(shape)}".encode())

    def add_bytes(self, tensor) -> None:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            self._sha.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy of the bytes

    def add(self, name: str, tensor) -> None:
        """A whole tensor: its header, then its bytes."""
        self.add_header(name, tensor.dtype, tensor.shape)
        self.add_bytes(tensor)

    def hexdigest(self) -> str:
        return "sha256:" + self._sha.hexdigest()


def model_weights_hash(tensors) -> str:
    """Hash of the weights as loaded (names, dtypes, shapes and bytes), streamed tensor by tensor: `tensors`, the
    (name, tensor) pairs of the model's state dict in name order (`Engine.weights_hash` gives them)."""
    h = WeightsHash()
    for name, tensor in tensors:
        h.add(name, tensor)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ atomic writes


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
