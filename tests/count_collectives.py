"""`python tests/count_collectives.py SPEC.json ARGS`: each kto-pipeline command line of SPEC.json ({"counts": DIR,
"runs": {NAME: [ARGS]}}) in turn in this process, with ARGS (the launch's --ddp-timeout) added, every c10d
collective it issues counted into DIR/NAME/rank-R.json as {op: count}; then the process group closed as the command
line closes it. A dispatch mode sees each c10d op, the ones DDP's reducer and FSDP2's backward hooks issue from C++
included. Launched by torchrun (tests/helpers.launch)."""

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
    from kto_pipeline.cli import _close_process_group, app, trl_spellings

    spec = json.loads(Path(sys.argv[1]).read_text())
    finished = False
    try:
        for name, args in spec["runs"].items():
            with CountCollectives() as mode:
                app(args=trl_spellings([*args, *sys.argv[2:]]), prog_name="kto-pipeline", standalone_mode=False)
            out = Path(spec["counts"]) / name
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(mode.counts))
        finished = True
    finally:
        _close_process_group(finished)
