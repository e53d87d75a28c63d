"""`python tests/count_collectives.py OUT_DIR ARGS`: the kto-pipeline command line (ARGS) with every c10d collective
this process issues counted, written to OUT_DIR/rank-R.json as {op: count}. A dispatch mode sees each c10d op, the
ones DDP's reducer and FSDP2's backward hooks issue from C++ included. Launched by torchrun (tests/helpers.launch)."""

import json
import os
import sys
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func._schema.name.removeprefix("c10d::")] += 1
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    out = Path(sys.argv.pop(1))
    from kto_pipeline.cli import main

    mode = CountCollectives()
    try:
        with mode:
            main()
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(mode.counts))
