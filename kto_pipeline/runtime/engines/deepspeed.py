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

Loading under ZeRO-3 with `zero3_init_flag` (exported as ACCELERATE_DEEPSPEED_ZERO3_INIT; on in
configs/accelerate/deepspeed_zero3.yaml): the model, the policy and the reference alike, is built inside DeepSpeed's
`zero.Init`, each parameter partitioned as it is created, and the main process alone reads the weights, one module
at a time, into the module gathered whole, then partitioned again. transformers does both whenever an
`HfDeepSpeedConfig` of a ZeRO-3 config is alive (`is_deepspeed_zero3_enabled`); `load` keeps the right one alive
for the read, and none where a model must be built whole (the flag off; `whole_models`: --merge's base model). What
reads the whole weights of a partitioned model has each process send its partitions to the main process in turn
(`weights_hash`), or gathers the whole state dict on the main process (`full_state_dict`, the final model:
accelerate's `zero3_save_16bit_model`).

A checkpoint's weights and optimizer state are DeepSpeed's own checkpoint, which accelerate writes into its state.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import WeightsHash
from kto_pipeline.runtime.engines.base import Engine
from kto_pipeline.runtime.engines.sharded import most_of_all, return_freed_buffers
from kto_pipeline.runtime.launch import env_flag
from kto_pipeline.runtime.precision import Regime, autocast_forward


class DeepSpeed(Engine):
    name = "deepspeed"
    caches_whole_casts = False  # DeepSpeed runs its own autocast (ZeRO-3: weights whole only in their forward)
    fixed_parameter_addresses = False  # not checked: DeepSpeed owns their storage (ZeRO-3 gathers them each forward)
    state_holds_weights = True

    def __init__(self, world_size: int, zero_stage: int = 2, zero3_init: bool = False):
        super().__init__(world_size)
        self.zero_stage = zero_stage
        self.collective_forwards = zero_stage == 3  # ZeRO-3 gathers each module's parameters in its forward
        self.holds_whole_model = zero_stage != 3
        self.zero3_init = zero3_init and zero_stage == 3  # the model is partitioned as it loads (`load`)
        # ZeRO-3 gathers a layer's parameters in hooks on each of its modules, which a compiled layer traces: a graph
        # for each layer and graph breaks at the hooks (measured, 2 CPU processes, 4-layer Llama: 88 graph breaks,
        # torch's recompile limit passed within 3 steps, 35 s of compiling for the eager run's numbers)
        if zero_stage == 3:
            self.compile_refusal = (
                "DeepSpeed ZeRO-3 gathers each layer's parameters in hooks that compiled layers break at (a graph for "
                "every layer, graph breaks at the hooks)"
            )
        self.loaded: list[int] | None = None  # after a partitioned load: the parameters each process holds, by rank

    @classmethod
    def from_env(cls, world_size: int) -> DeepSpeed:
        """The ZeRO stage and the `zero3_init_flag` that `accelerate launch` exports from a DeepSpeed config (unset,
        the flag is on under ZeRO-3, as accelerate's own default)."""
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        if stage not in (2, 3):
            raise KTOPipelineError(
                f"DeepSpeed ZeRO-{stage}: kto-pipeline runs ZeRO-2 and ZeRO-3 "
                "(configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml)."
            )
        return cls(world_size, zero_stage=stage, zero3_init=env_flag("ACCELERATE_DEEPSPEED_ZERO3_INIT", stage == 3))

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

    # ------------------------------------------------------------------ loading

    def load(self, read, trust_remote_code: bool = False, regime: Regime | None = None):
        """Under ZeRO-3 with `zero3_init_flag`: `read()` inside `zero.Init` (module docstring), with train's DeepSpeed
        config (accelerate keeps it alive once the Accelerator is built), or without an Accelerator (precompute)
        with the scorer's, whose weights dtype is `regime`'s. Otherwise every process reads the whole model (ZeRO-3
        partitions it when its engine is built)."""
        if self.zero_stage != 3:
            return read()
        return_freed_buffers()  # the partitioned tensors gathered whole and freed go back to the system
        if not self.zero3_init:
            with self.whole_models():  # accelerate keeps a ZeRO-3 config alive whatever the flag says
                return read()
        # zero.Init has the main process initialize every module before its weights are read (transformers'
        # `initialize_weights_zero3`), which draws random numbers that one process's load does not: a fresh LoRA
        # adapter drawn after would differ from one process's
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            if self.accelerator is not None:  # train: accelerate's config of the policy, kept alive by accelerate
                model = read()
            else:
                with _transformers_zero3(scorer_config(regime or Regime("float32"))):
                    model = read()
        self._record_partitions(model)
        return model

    def _record_partitions(self, model) -> None:
        """What each process holds of `model` after a partitioned load, printed by the main process: the measure
        that it loaded partitioned."""
        import torch.distributed as dist

        parameters = list(model.parameters())
        if not all(hasattr(p, "ds_tensor") for p in parameters):
            raise KTOPipelineError(
                f"DeepSpeed ZeRO-3 with zero3_init_flag: {type(model).__name__} was not built partitioned (it has "
                "parameters outside zero.Init). Set `zero3_init_flag: false` in the accelerate config "
                "(ACCELERATE_DEEPSPEED_ZERO3_INIT=false): every process then reads the whole model."
            )
        held = [0] * self.world_size
        dist.all_gather_object(held, sum(p.ds_tensor.numel() for p in parameters))
        self.loaded = held
        if dist.get_rank() == 0:
            total = sum(p.ds_numel for p in parameters)
            each = ", ".join(f"process {rank} {n:,}" for rank, n in enumerate(held))
            print(
                f"DeepSpeed ZeRO-3: {type(model).__name__} partitioned as it loaded (zero.Init), the weights read by "
                f"the main process only: {total:,} parameters, held {each}",
                flush=True,
            )

    @contextmanager
    def whole_models(self):
        """Outside `zero.Init` (whose partitioning is a collective of every process): accelerate's DeepSpeed config
        is alive again after."""
        try:
            with _transformers_zero3(None):
                yield
        finally:
            if self.accelerator is not None:
                self.accelerator.state.deepspeed_plugin.set_deepspeed_weakref()

    def weights_hash(self, model, main: bool) -> str | None:
        """The one-process hash of a partitioned model, with no tensor gathered whole: a partitioned parameter's
        bytes are its processes' flat partitions in rank order (DeepSpeed cuts the flattened tensor into equal
        pieces, the last one padded), so each process in turn sends its own to the main process, which hashes it.
        The main process holds one partition more at a time, the others nothing more. (Gathering each tensor whole
        on every process cost the non-reading process 3x the largest tensor, measured on a 436M model.)"""
        import torch.distributed as dist

        h = WeightsHash() if main else None
        parameters = dict(model.named_parameters(remove_duplicate=False))  # tied ones under each name, as state_dict
        for name, tensor in sorted(model.state_dict().items()):
            parameter = parameters.get(name)
            if parameter is None or not hasattr(parameter, "ds_id"):  # whole on every process (buffers)
                if main:
                    h.add(name, tensor)
                continue
            if main:
                h.add_header(name, parameter.ds_tensor.dtype, parameter.ds_shape)
            group = parameter.ds_process_group
            mine, left = dist.get_rank(group), parameter.ds_numel
            for k in range(dist.get_world_size(group)):
                n = min(parameter.ds_tensor.numel(), left)  # the padding of the last partitions is not the tensor's
                left -= n
                if n == 0:
                    continue
                if k == mine:
                    if main:
                        h.add_bytes(parameter.ds_tensor.data[:n])
                    else:
                        dist.send(parameter.ds_tensor.data[:n].contiguous(), dist.get_global_rank(group, 0))
                elif main:
                    piece = parameter.ds_tensor.new_empty(n)
                    dist.recv(piece, dist.get_global_rank(group, k))
                    h.add_bytes(piece)
        return h.hexdigest() if main else None

    def prepare_scorer(self, scorer, model, regime: Regime, device):
        if self.zero_stage != 3:
            return super().prepare_scorer(scorer, model, regime, device)
        import deepspeed

        self.device = device
        autocast_forward(scorer, regime, cache=False)  # weights stay in their dtype; bf16 compute from autocast
        config = scorer_config(regime)
        fill_gathering(config["zero_optimization"], model)
        engine, *_ = deepspeed.initialize(model=scorer, config=config)
        engine.eval()  # (returns None)
        self._gathered_in_forward(*model.modules())  # every module's parameters, gathered around its forward
        return engine

    def prepare_policy(self, scorer, model, make_optimizer, loader=None, move: bool = True):
        if self.zero_stage != 3:
            return super().prepare_policy(scorer, model, make_optimizer, loader, move)
        fill_gathering(self.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"], model)
        prepared = super().prepare_policy(scorer, model, make_optimizer, loader, move)
        self._gathered_in_forward(*model.modules())  # every module's parameters, gathered around its forward
        return prepared

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
        loading = ", the model partitioned as it loads (zero.Init)" if self.zero3_init else ""
        return f"DeepSpeed ZeRO-{self.zero_stage} over {self.world_size} processes{loading}"


def scorer_config(regime: Regime) -> dict:
    """The DeepSpeed config of the frozen reference under ZeRO-3 (no optimizer; every parameter partitioned, none
    kept whole): its weights in the regime's dtype, as `zero.Init` creates them and the engine keeps them."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": regime.weights == "bfloat16"},
        "fp16": {"enabled": regime.weights == "float16"},
    }


def fill_gathering(zero: dict, model) -> None:
    """ZeRO-3's gathering settings that the config `zero` (its "zero_optimization") leaves unset or "auto", by the
    model's hidden size h. DeepSpeed's defaults keep the whole model gathered: a parameter is released only if its
    next use is further than `stage3_max_reuse_distance` (1e9 parameters) away, and the next forward, or the
    backward, always uses it again within the model's size; and gradients are reduced through a bucket of 5e8
    (2 GB in float32). Here nothing is kept gathered for reuse, only the next h^2 parameters are gathered ahead, and
    gradients are reduced by h^2 (accelerate's "auto" rule for the prefetch and reduce buckets, which it cannot apply
    to a scorer wrapping the model), so that a process holds its partition and about one layer."""
    from kto_pipeline.models import text_config

    h = text_config(model).hidden_size
    for key, value in {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_max_live_parameters": h * h,
        "stage3_max_reuse_distance": 0,
    }.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value


@contextmanager
def _transformers_zero3(config: dict | None):
    """transformers builds every model inside `zero.Init` and loads its weights partitioned while an HfDeepSpeedConfig
    of a ZeRO-3 config is alive (it holds a weak reference to it): `config`'s for the context, or none (None)."""
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    alive = HfDeepSpeedConfig(config) if config is not None else None
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del alive
