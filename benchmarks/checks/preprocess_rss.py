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
for n in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_DATASETS_CACHE": cache}
        proc = subprocess.Popen([sys.executable, str(HERE / "preprocess_rss_run.py"), n], env=env)
        peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in peak:
                            peak[key] = max(peak[key], int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.005)
        print(n, "rows, peak MiB:", {k: round(v / 1024) for k, v in peak.items()}, flush=True)
