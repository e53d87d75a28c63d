"""How a model's products compute in a precision regime (`runtime/precision.py`): on a CPU in half precision, in
blocks of rows, so that both stages give a row the same result; the decoder layers' weights cast once a step.

The stages ask: `rows_alike` (both stages: a CPU's half-precision products computed in blocks of rows), `StepCasts`
(train: the decoder layers' weights cast to the autocast dtype once an optimizer step); the LM head's chunks call
`linear` (`scoring.head`).

Rows alike on a CPU. The two stages batch a sequence's tokens with different rows, so a product must give a row the
same result whatever the other rows of the call. A CPU's bf16 matrix product need not: on one with AMX (an Intel Xeon
with amx_bf16, torch 2.13) oneDNN chooses its kernel by the call's shape, and a (576 -> 1536) product rounds the
first rows of a 33- to 1,535-row call otherwise than in a call of 16 or of 2,000 rows (bf16 outputs a unit in the
last place apart), which moved SmolLM2's step-1 rewards off 0 by 0.03. In a call of a fixed number of rows it does
not: a row's result is then the same wherever it lies and whatever lies beside it (measured: every offset and
batch tried, for each of SmolLM2's and Qwen2-0.5B's shapes). So on a CPU, where a product runs in bf16 or fp16
(`linear`), its rows go through calls of ROW_BLOCK rows, the last padded with zeros: the decoder layers (every plain
nn.Linear of the model, made a `Linear` by `rows_alike`) and the LM head's chunks (`scoring.head`). The backward
multiplies whole, as before: step 1 compares forwards only. The cost on that CPU, one thread, a (576 -> 1536)
product of 2,400 rows: 4.7 ms against 2.9 ms in one call; float32 weights there take 22 ms, and bf16 without AMX
(oneDNN limited to AVX-512 BF16, which gives rows alike by itself) 37 ms. A GPU's products are left as they are.

Half precision on a CPU without oneDNN's half-precision kernels (no AVX-512: an AMD EPYC with AVX2 only). There
torch multiplies bf16 with ATen's reference loops, measured on such a CPU (one thread, SmolLM2-135M, 150 tokens,
under bf16 autocast): a forward 4.1 s against 0.76 s in float32, a forward and backward 26.8 s against 3.0 s; with
`half_product` 1.29 s and 3.70 s (docs/devices.md, "Precision"). Such a CPU multiplies half
precision as float32 products of the half-precision values, rounded to half precision once (`half_product`): the
products of two bf16 (or fp16) values are exact in float32 and the sums float32, as in ATen's loops and a GPU's
tensor cores, only in another order; a (512 x 576) @ (576 x 1536) product 29 ms against 190 ms. In calls of a
fixed number of rows a row's result is then the same wherever it lies and whatever lies beside it, and the same in a
call of 4 rows or more as in one of 512 (measured on that CPU for SmolLM2's and Qwen2's shapes: every offset tried,
zero padding, other neighbours; calls of 1 to 3 rows differ): there the blocks are HALF_PRODUCT_ROW_BLOCK rows,
which pads a short call less (a training step of 132 tokens on SmolLM2 pads every product to 512 rows otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kto_pipeline.runtime.precision import WEIGHT_DTYPES, Regime

HALF = (torch.bfloat16, torch.float16)
ROW_BLOCK = 512  # rows of every half-precision product on a CPU (`linear`): 1.6x one call's time there, 2.4x at 256
HALF_PRODUCT_ROW_BLOCK = 64  # the same where the CPU has no half-precision kernels (`half_product`)
# the device types whose half-precision products run in blocks of rows: a CPU's (a benchmark adds "cuda" to measure
# what blocks do to a GPU's, `benchmarks/step_one_layouts.py`)
ROW_BLOCK_DEVICES = {"cpu"}


def _row_block_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype | None:
    """The half-precision dtype a product on `device` of `dtype` inputs computes in (autocast's where it is on),
    where it runs in blocks of ROW_BLOCK rows (a CPU's); else None."""
    kind = torch.device(device).type
    if kind not in ROW_BLOCK_DEVICES:
        return None
    computes = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else dtype
    return computes if computes in HALF else None


def in_row_blocks(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a product on `device` of `dtype` inputs runs in blocks of ROW_BLOCK rows (`linear`): in half precision
    (autocast's dtype where it is on) on a CPU."""
    return _row_block_dtype(device, dtype) is not None


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, as autocast would run it; in half precision on a CPU, in calls of ROW_BLOCK rows, so that every row
    computes alike whatever the call's other rows (the module's docstring)."""
    dtype = _row_block_dtype(input.device, input.dtype)
    if dtype is None:
        return F.linear(input, weight, bias)
    cast = [None if t is None else t.to(dtype) for t in (input, weight, bias)]
    with torch.autocast(input.device.type, enabled=False):
        return torch.ops.kto_pipeline.linear_in_row_blocks(*cast, row_block(dtype, input.device.type))


def row_block(dtype: torch.dtype, device_type: str = "cpu") -> int:
    """The rows of each half-precision product of `dtype` in blocks (`linear`): ROW_BLOCK where the device's own
    kernels multiply, HALF_PRODUCT_ROW_BLOCK where `half_product` does."""
    return ROW_BLOCK if native_half_products(dtype, device_type) else HALF_PRODUCT_ROW_BLOCK


def _onednn_multiplies(name: str) -> bool:
    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):  # a build without oneDNN: ATen's loops
        return False


# whether this CPU multiplies bf16 / fp16 with oneDNN's kernels (AVX-512, AMX); where it does not, torch falls back to
# ATen's reference loops (the module's docstring). Read once: a compiled region reads the table as a constant.
NATIVE_HALF_PRODUCTS = {
    torch.bfloat16: _onednn_multiplies("_is_mkldnn_bf16_supported"),
    torch.float16: _onednn_multiplies("_is_mkldnn_fp16_supported"),
}


def native_half_products(dtype: torch.dtype, device_type: str = "cpu") -> bool:
    """Whether `device_type` multiplies `dtype` (bf16, fp16) with kernels of its own: a CPU where oneDNN's do
    (NATIVE_HALF_PRODUCTS), any other device."""
    return device_type != "cpu" or NATIVE_HALF_PRODUCTS[dtype]


def half_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T + bias in the dtype of `a` (half precision, on a CPU): torch's own product where this CPU has
    half-precision kernels, else the float32 product of the same values rounded once to that dtype."""
    if native_half_products(a.dtype, a.device.type):
        return F.linear(a, b, bias)
    # autocast off: a compiled step traces the backward under the forward's autocast, which would multiply in bf16
    with torch.autocast(a.device.type, enabled=False):
        return F.linear(a.float(), b.float(), None if bias is None else bias.float()).to(a.dtype)


@torch.library.custom_op("kto_pipeline::half_product", mutates_args=())
def _half_product_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`half_product(a, b)` (no bias), as one op that a compiled graph calls as it is."""
    return half_product(a, b)


@_half_product_op.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[0])


@torch.library.custom_op("kto_pipeline::linear_in_row_blocks", mutates_args=())
def _linear_in_row_blocks(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int
) -> torch.Tensor:
    """input @ weight.T + bias over the rows of `input` (..., K), `block` rows a call (the last zero-padded)."""
    rows = input.reshape(-1, input.shape[-1])
    whole = rows.shape[0] - rows.shape[0] % block
    out = [half_product(rows[start : start + block], weight, bias) for start in range(0, whole, block)]
    if whole < rows.shape[0]:
        tail = F.pad(rows[whole:], (0, 0, 0, block - (rows.shape[0] - whole)))
        out.append(half_product(tail, weight, bias)[: rows.shape[0] - whole])
    product = torch.cat(out) if out else rows.new_empty(0, weight.shape[0])
    return product.reshape(*input.shape[:-1], weight.shape[0])


@_linear_in_row_blocks.register_fake
def _(input, weight, bias, block):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


def _save_for_backward(ctx, inputs, output) -> None:
    input, weight, bias, _ = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """A linear layer's backward, each product whole (as F.linear's; `half_product`'s where this CPU has no
    half-precision kernels): the gradients are not compared at step 1."""
    input, weight = ctx.saved_tensors
    rows, grads = input.reshape(-1, input.shape[-1]), grad.reshape(-1, grad.shape[-1])
    if native_half_products(grads.dtype, grads.device.type):
        grad_input = (grads @ weight).reshape(input.shape) if ctx.needs_input_grad[0] else None
        grad_weight = grads.t() @ rows if ctx.needs_input_grad[1] else None
    else:  # opaque to a compiler, which would fuse the casts into a half-precision product of its own
        product = torch.ops.kto_pipeline.half_product
        grad_input = product(grads, weight.t()).reshape(input.shape) if ctx.needs_input_grad[0] else None
        grad_weight = product(grads.t(), rows.t()) if ctx.needs_input_grad[1] else None
    grad_bias = grads.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_input, grad_weight, grad_bias, None


_linear_in_row_blocks.register_autograd(_backward, setup_context=_save_for_backward)


STEP_CAST = "_kto_step_cast"  # on a decoder layer's Linear while a step is open: its (weight, bias) cast once


class Linear(torch.nn.Linear):
    """nn.Linear computing through `linear` (on a CPU in half precision, in blocks of rows), on the weight and bias
    cast once for the step where a `StepCasts` holds them (and autocast is on: a model that turns it off around a
    layer gets the float32 weights). Its parameters, state dict and everything else are nn.Linear's; `rows_alike`
    and `StepCasts` make a model's plain nn.Linear modules ones (the class only)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        cast = self.__dict__.get(STEP_CAST)
        if cast is None or not torch.is_autocast_enabled(input.device.type):
            return linear(input, self.weight, self.bias)
        return linear(input, cast[0], cast[1])


def rows_alike(model: torch.nn.Module, regime: Regime, device: torch.device) -> bool:
    """Where `regime` computes in half precision on a CPU, every plain nn.Linear of `model` made a `Linear` (in place:
    the class only), so that each row of a product computes alike in both stages. Whether it did."""
    if torch.device(device).type not in ROW_BLOCK_DEVICES or (regime.autocast is None and regime.dtype not in HALF):
        return False
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Linear
    return True


class StepCasts:
    """The decoder layers' float32 weights cast to the autocast dtype once an optimizer step, not once a call.

    Under bf16/fp16 autocast every call of a linear layer casts its weight, and a step calls each layer several times:
    the completions' forward, the KL completions', again for every micro-batch of --gradient-accumulation-steps.
    Compiled layers cast inside their graphs, a kernel a weight and call. While a `StepCasts` is open, each nn.Linear
    of the decoder layers computes on a cast made at the step's start (`open`) and dropped after its last backward
    (`close`), before the optimizer changes the weights: the same values (a cast is a rounding; autocast casts the
    input as before), the gradient reaching the float32 weight through the cast, as under autocast. The layers are
    made `Linear`s once, at construction, so that a compiled layer's graph takes the casts as inputs from the first
    step on, and given back as they were at the run's end.

    Active only where it changes the work and not the peak memory: under autocast, with an engine whose processes hold
    whole weights (one process, DDP; not FSDP2's or ZeRO-3's shards, gathered a layer at a time), without gradient
    checkpointing (its recompute would cast again inside the backward, and keeping the casts would hold a
    half-precision copy of the layers through every backward, where the forward's own casts are freed), and not where
    the layers replay CUDA graphs (a cast inside a graph costs no launch; casts given as inputs would be copied into
    the graphs' own inputs at every call). Without checkpointing the backward keeps every cast anyway, for the
    gradient of the layers' inputs. The LM head casts in its own forward and backward (`scoring.head`)."""

    def __init__(self, scorer: torch.nn.Module, regime: Regime, engine, config):
        """For training's steps on `scorer` (the policy, as its engine wrapped it): `engine` (its
        `caches_whole_casts`), `config` (gradient checkpointing)."""
        from kto_pipeline.runtime.compiled import replays_cuda_graphs

        active = regime.autocast is not None and engine.caches_whole_casts and not config.gradient_checkpointing
        active = active and not replays_cuda_graphs(scorer)  # a graph replays its casts, no launch
        self.dtype = WEIGHT_DTYPES[regime.autocast] if active else None
        self.linears = _decoder_linears(scorer) if active else []
        self.classes = [type(linear) for linear in self.linears]  # (nn.Linear, or a `rows_alike` Linear)
        for linear in self.linears:
            linear.__class__ = Linear
        self.open_now = False

    def __enter__(self) -> StepCasts:
        return self

    def __exit__(self, *exc) -> None:
        """The run's end: the casts dropped and the layers' classes back as they were."""
        self.close()
        for linear, cls in zip(self.linears, self.classes, strict=True):
            linear.__class__ = cls

    def open(self) -> None:
        """At a micro-batch's start: the casts for the step, if not made yet (idempotent)."""
        if self.open_now or not self.linears:
            return
        for linear in self.linears:
            bias = None if linear.bias is None else linear.bias.to(self.dtype)
            linear.__dict__[STEP_CAST] = (linear.weight.to(self.dtype), bias)
        self.open_now = True

    def close(self) -> None:
        """At the step's end (and on any exit): the casts are dropped (idempotent)."""
        for linear in self.linears:
            linear.__dict__.pop(STEP_CAST, None)
        self.open_now = False


def _decoder_linears(scorer: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain nn.Linear modules with floating weights of the policy's decoder layers (`decoder_body`; LoRA's
    frozen base layers and adapters alike), under the engine's and the scorer's wrappers; none where there are no
    such layers."""
    from kto_pipeline.models import decoder_body

    model = scorer
    while hasattr(model, "module"):  # DistributedDataParallel
        model = model.module
    model = getattr(model, "model", model)  # the stage's scorer wraps the causal LM
    try:
        layers = getattr(decoder_body(model), "layers", None)
    except ValueError:
        return []
    if layers is None:
        return []
    return [
        m
        for m in layers.modules()
        if type(m) in (torch.nn.Linear, Linear) and m.weight.is_floating_point() and m.weight.dtype == torch.float32
    ]
