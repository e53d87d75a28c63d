"""One-off check: peak anonymous vs file-backed RSS of kto-pipeline's preprocessing (load, check, tokenize with
--num-proc 1, select, pair) on the scale case's data, polled from outside every 5 ms.

    python benchmarks/checks/preprocess_rss.py 20000 200000 1000000   # after `bench.py --only scale` wrote the data
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the one hop: benchmarks/ (harness, bench_scale), as a script is run from there

from bench_scale import data_path, model_path  # noqa: E402
from harness import WORK_DIR, proc_status  # noqa: E402

KEYS = ("RssAnon", "RssFile", "VmRSS")


def main() -> None:
    work = WORK_DIR / "scale"
    model = model_path(work, "smollm2")
    for n in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TQDM_DISABLE": "1", "HF_DATASETS_CACHE": cache}
            cmd = [sys.executable, str(HERE / "preprocess_rss_run.py"), str(model), str(data_path(work, int(n)))]
            proc = subprocess.Popen(cmd, env=env)
            peak = dict.fromkeys(KEYS, 0)
            while proc.poll() is None:
                try:
                    status = proc_status(proc.pid)
                except OSError:
                    status = {}
                for key in KEYS:
                    peak[key] = max(peak[key], status.get(key, 0))
                time.sleep(0.005)
            print(n, "rows, peak MiB:", {k: round(v / 1024) for k, v in peak.items()}, flush=True)


if __name__ == "__main__":
    main()
