"""kto-pipeline: KTO alignment as two stages.

Stage 1, `precompute` (kto_pipeline/stages/precompute/stage.py): the frozen reference model scores every
completion and its KL completion once, into an Arrow cache (kto_pipeline/cache/__init__.py).
Stage 2, `train` (kto_pipeline/stages/train/stage.py): the policy trains alone against those cached values.

The names below are imported on first use (PEP 562), so `import kto_pipeline` and `kto-pipeline --help`
do not pay for torch.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "GenerateConfig": "kto_pipeline.config",
    "PrecomputeConfig": "kto_pipeline.config",
    "TrainConfig": "kto_pipeline.config",
    "KTOPipelineError": "kto_pipeline.errors",
    "Preempted": "kto_pipeline.errors",
    "generate_completions": "kto_pipeline.generate",
    "generate_samples": "kto_pipeline.generate",
    "label_file": "kto_pipeline.label",
    "precompute": "kto_pipeline.stages.precompute.stage",
    "train": "kto_pipeline.stages.train.stage",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kto_pipeline' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
