"""kto-pipeline: KTO alignment as two stages.

Stage 1, `precompute` (kto_pipeline.precompute): the frozen reference model scores every completion
and its KL completion once, into an Arrow cache (kto_pipeline.cache).
Stage 2, `train` (kto_pipeline.train): the policy trains alone against those cached values.
"""

__version__ = "0.1.0"

from kto_pipeline.config import PrecomputeConfig, TrainConfig  # noqa: E402
from kto_pipeline.errors import KTOPipelineError  # noqa: E402

__all__ = ["PrecomputeConfig", "TrainConfig", "KTOPipelineError", "precompute", "train", "__version__"]


def precompute(config: PrecomputeConfig):
    """Stage 1: see kto_pipeline.precompute.precompute."""
    from kto_pipeline.precompute import precompute as _precompute

    return _precompute(config)


def train(config: TrainConfig):
    """Stage 2: see kto_pipeline.train.train."""
    from kto_pipeline.train import train as _train

    return _train(config)
