#!/bin/bash
# `make bench-gpu` on a GPU machine without network access: its own torch, transformers and accelerate; trl,
# datasets and liger-kernel from the wheels `make gpu-wheels` downloads into .whl/ here (carry .whl with the run).
#   BENCH_TIMEOUT=570 bash benchmarks/gpu_machine.sh      # the matrix (its --budget-s 480 unless given)
#   BENCH=step_one_layouts.py bash benchmarks/gpu_machine.sh               # one script alone (here: step 1 by layout)
# What it measured comes back under $OUT: the log, RESULTS-gpu.md, and runs.tgz (every worker's output and records).
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run make gpu-wheels and carry .whl"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 - <<'PY'
import importlib.metadata as m
for p in ("torch", "transformers", "accelerate", "datasets", "trl", "pyarrow", "typer", "peft", "liger-kernel", "triton"):
    try:
        print(p, m.version(p))
    except Exception as e:
        print(p, "MISSING", e)
PY
timeout "${BENCH_TIMEOUT:-570}" python3 "benchmarks/${BENCH:-bench_gpu_matrix.py}" --device cuda "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc ${PIPESTATUS[0]}"
cp benchmarks/RESULTS-gpu.md "$OUT/" 2>/dev/null
# every worker's log, cases and records (the checks' included) and the raw results, from the whole work folder
cd "benchmarks/.work/${WORK:-gpu-matrix-cuda}" 2>/dev/null &&
    find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.md' \) -size -2M \
        -not -name 'tokenizer*' | tar czf "$OUT/runs.tgz" -T - 2>/dev/null
ls -la "$OUT"
