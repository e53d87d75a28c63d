"""One config dataclass per stage (precompute.py, train.py, generate.py, memory.py), made of the fields in
fields.py. Each field is a command-line option: its name, type, default, `help` and `panel` (its --help panel)
are the CLI's, which kto_pipeline/recipe.py builds from them, so the Python API and the command line are
documented in one place; its `role` (fields.ROLES) says what it is to sweep, --resume and recipes.
`__post_init__` rejects bad values naming the flag; the config is printed at the start of a run and saved next to
its outputs."""

from kto_pipeline.config.fields import PANELS, base_type, field_help, field_panel, parse_value
from kto_pipeline.config.generate import GenerateConfig
from kto_pipeline.config.memory import LENGTHS, MemoryEstimateConfig
from kto_pipeline.config.precompute import PrecomputeConfig
from kto_pipeline.config.train import TrainConfig

__all__ = ["LENGTHS", "PANELS", "GenerateConfig", "MemoryEstimateConfig", "PrecomputeConfig"]
__all__ += ["TrainConfig", "base_type", "field_help", "field_panel", "parse_value"]
