"""`python -m kto_pipeline.memory measure-cpu-step < spec.json`: one real CPU step in a fresh process (the check
of the simulation, `step.cpu_check`)."""

import json
import sys

from kto_pipeline.memory.step import measure_cpu_step

if sys.argv[1:] == ["measure-cpu-step"]:
    print(json.dumps(measure_cpu_step(json.loads(sys.stdin.read()))))
else:
    raise SystemExit("usage: python -m kto_pipeline.memory measure-cpu-step < spec.json")
