"""DeepSpeed ZeRO-2 and ZeRO-3, through accelerate (`accelerate launch --config_file
configs/accelerate/deepspeed_zero2.yaml` / `deepspeed_zero3.yaml`).

Training: accelerate's `prepare` builds DeepSpeed's engine around the policy and its optimizer, and its backward
and step run DeepSpeed's. The train flags own clipping and precision: bf16 is float32 weights and forwards under
torch.autocast (DeepSpeed's `torch_autocast`), gradients reduced in float32, the regime of one process and of
FSDP2 (DeepSpeed's own bf16 mode would cast the weights to bf16).

Scoring: under ZeRO-3 the frozen reference is partitioned by DeepSpeed for inference, without an optimizer (what trl
and transformers do for a frozen model under ZeRO-3); its forward gathers each module's parameters, so every
process runs as many forwards. Under ZeRO-2 (which partitions optimizer state and gradients only) the reference is
whole on every process.

A checkpoint's weights and optimizer state are DeepSpeed's own checkpoint, which accelerate writes into its state.
"""

from __future__ import annotations

import os

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.runtime.engines.base import Engine
from kto_pipeline.runtime.launch import most_of_all
from kto_pipeline.runtime.precision import Regime, autocast_forward


class DeepSpeed(Engine):
    name = "deepspeed"
    state_holds_weights = True

    def __init__(self, world_size: int, zero_stage: int = 2):
        super().__init__(world_size)
        self.zero_stage = zero_stage
        self.collective_forwards = zero_stage == 3  # ZeRO-3 gathers each module's parameters in its forward
        self.holds_whole_model = zero_stage != 3

    @classmethod
    def from_env(cls, world_size: int) -> DeepSpeed:
        """The ZeRO stage `accelerate launch` exports from a DeepSpeed config."""
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        if stage not in (2, 3):
            raise KTOPipelineError(
                f"DeepSpeed ZeRO-{stage}: kto-pipeline runs ZeRO-2 and ZeRO-3 "
                "(configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml)."
            )
        return cls(world_size, zero_stage=stage)

    def _configure(self, max_grad_norm: float) -> None:
        """The DeepSpeed settings the train flags own; accelerate fills what the config leaves "auto" when the model
        is prepared (--gradient-accumulation-steps from the Accelerator, but clipping at a fixed 1.0)."""
        plugin = self.accelerator.state.deepspeed_plugin
        ds = plugin.deepspeed_config
        ds["gradient_clipping"] = max_grad_norm  # DeepSpeed clips inside its step; 0: no clipping
        if self.accelerator.mixed_precision == "bf16":
            ds["bf16"] = {"enabled": False}
            ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        # ZeRO-3: from_pretrained reads this config (through the weak reference accelerate took when the Accelerator
        # was built) and loads the weights partitioned, in its dtype: hand it the edited one
        plugin.set_deepspeed_weakref()

    def prepare_scorer(self, scorer, model, regime: Regime, device):
        if self.zero_stage != 3:
            return super().prepare_scorer(scorer, model, regime, device)
        import deepspeed

        self.device = device
        autocast_forward(scorer, regime, cache=False)  # weights stay in their dtype; bf16 compute from autocast
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": regime.weights == "bfloat16"},
            "fp16": {"enabled": regime.weights == "float16"},
        }
        engine, *_ = deepspeed.initialize(model=scorer, config=config)
        engine.eval()  # (returns None)
        return engine

    def agree_on_forwards(self, count: int) -> int:
        return most_of_all(count, self.device) if self.collective_forwards else count

    def close(self, module) -> None:
        """Remove the DeepSpeed engine's hooks (ZeRO-3 gathers parameters from them) and its buffers
        (`DeepSpeedEngine.destroy`), so that nothing of it is left to be torn down at interpreter exit."""
        destroy = getattr(module, "destroy", None)
        if callable(destroy):
            destroy()

    def record(self) -> dict:
        return {"engine": f"deepspeed-zero{self.zero_stage}", "world_size": self.world_size}

    def __str__(self) -> str:
        return f"DeepSpeed ZeRO-{self.zero_stage} over {self.world_size} processes"
