"""One-off check: the FLOPs of the SmolLM2 case's training steps, kto-pipeline against trl online, counted by
`torch.utils.flop_counter.FlopCounterMode` around the whole training call (forward, backward, everything the
dispatcher sees), with the bench's settings (float32, batch 8, sequential order, max_length 256).

    python benchmarks/bench.py --size full --only smollm2   # writes the data and kto-pipeline's cache
    python benchmarks/checks/step_flops.py ours 8
    python benchmarks/checks/step_flops.py trl 8

At equal FLOP rates the ratio of step times cannot exceed the ratio of FLOPs per step; dividing each tool's
GFLOP per step by its median step time (RESULTS.md) gives the rate each one reached.
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the one hop: benchmarks/ (bench, harness)

from bench import smollm2_training  # noqa: E402
from harness import SMOLLM2_SIZES  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def main() -> None:
    which, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else SMOLLM2_SIZES["full"]["steps"]
    if which not in ("ours", "trl"):
        sys.exit("usage: step_flops.py ours|trl [steps]")
    with tempfile.TemporaryDirectory() as out:
        run = smollm2_training(which, steps, Path(out))
        with FlopCounterMode(display=False) as counter:
            run()
    total = counter.get_total_flops()
    by_op = {str(op): round(n / 1e9, 1) for op, n in counter.get_flop_counts()["Global"].items()}
    summary = {"tool": which, "steps": steps, "gflop": round(total / 1e9, 1)}
    print(json.dumps({**summary, "gflop_per_step": round(total / 1e9 / steps, 1), "gflop_by_op": by_op}))


if __name__ == "__main__":
    main()
