"""One-off check: when does a process of a gloo group abort at exit ("terminate called without an active
exception", SIGABRT)? Launches 2 CPU processes under torchrun, N times per case, and counts the launches in which
a process aborted.

    python benchmarks/checks/teardown_abort.py 16

Cases (every process first runs one matched all-gather):
  - matched: both issue the same asynchronous collectives and leave their handles unwaited at exit;
  - unmatched: process 1 issues an asynchronous all-reduce that process 0 never joins, and both exit;
each with and without `destroy_process_group()` before exit.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import sys, time, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
out = [torch.empty(1) for _ in range(2)]
dist.all_gather(out, torch.tensor([float(rank)]))
case, destroy = sys.argv[1], sys.argv[2] == "destroy"
if case == "matched":
    works = [dist.all_reduce(torch.ones(1 << 16), async_op=True) for _ in range(4)]
elif rank == 1:
    work = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # process 0 never joins it
    time.sleep(0.2)
if destroy:
    if case == "matched":
        for w in works:
            w.wait()
    dist.destroy_process_group()
"""


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        for case in ("matched", "unmatched"):
            for destroy in ("exit", "destroy"):
                aborted = 0
                for _ in range(runs):
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                    proc = subprocess.run([*cmd, str(worker), case, destroy], capture_output=True, text=True)
                    aborted += "terminate called" in proc.stdout + proc.stderr
                print(f"{case:>9}, {destroy:>7}: {aborted}/{runs} launches with a process aborted", flush=True)


if __name__ == "__main__":
    main()
