"""Gradient accumulation across processes: the micro-steps before an optimizer step exchange no gradients (DDP's
`no_sync`, FSDP2's `set_requires_gradient_sync`), so the gradient collectives per optimizer step are those of a run
without accumulation, and the run equals one process accumulating the same micro-batches."""

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import cli_args, launch, read_metrics, train_config
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from kto_pipeline import train

COUNTER = Path(__file__).resolve().parent / "count_collectives.py"
FSDP_ENV = dict(ACCELERATE_USE_CPU="1", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
# the gradient exchange: DDP all-reduces its buckets, FSDP2 reduce-scatters each sharded group
ENGINES = {"ddp": ({}, "allreduce_"), "fsdp2": (FSDP_ENV, "_reduce_scatter_base_")}
STEPS = 2
RUN = dict(max_steps=STEPS, logging_steps=1, learning_rate=1e-3, seed=3, train_sampling_strategy="sequential")

# Several training runs in one launch (COUNTER), one after the other in the same processes and process group, as a
# sweep through the Python API runs them: a launch costs each process its start (importing torch, transformers and
# accelerate) and the group's setup, several times the CPU time of one of these 2-step runs. Each run's collectives
# are counted apart.


def _counted_runs(tmp_path: Path, cache, env: dict, runs: dict[str, dict]) -> dict[str, dict[str, int]]:
    """The training runs `runs` ({name: options}), 2 micro-batch rows a process, in one launch of 2 processes
    (COUNTER, in the order given), each into TMP/NAME: {name: its collectives, the same on both processes}."""
    spec = tmp_path / "runs.json"
    commands = {
        name: ["train", *cli_args(cache=cache, output_dir=tmp_path / name, per_device_train_batch_size=2, **options)]
        for name, options in runs.items()
    }
    spec.write_text(json.dumps({"counts": str(tmp_path / "counts"), "runs": commands}))
    launch(2, str(spec), env=env, log_dir=tmp_path / "logs", script=COUNTER)
    counted = {}
    for name in runs:
        per_rank = [json.loads(p.read_text()) for p in sorted((tmp_path / "counts" / name).glob("rank-*.json"))]
        assert len(per_rank) == 2 and per_rank[0] == per_rank[1], (name, per_rank)
        counted[name] = per_rank[0]
    return counted


def _check_no_exchange_in_micro_steps(tmp_path: Path, cache, engine: str, counted: dict) -> None:
    """The accumulated run exchanged the gradients of the plain run, and equals one process accumulating the same
    micro-batches."""
    gradient_op = ENGINES[engine][1]
    plain, accumulated = counted["plain"], counted["accumulated"]
    print(f"{engine}: collectives of {STEPS} optimizer steps, without / with 2 micro-steps each:", plain, accumulated)
    # the same gradient exchanges per optimizer step with 2 micro-steps as with 1 (without skipping: twice as many)
    assert plain[gradient_op] >= STEPS and accumulated[gradient_op] == plain[gradient_op], (plain, accumulated)
    # and the numbers of one process accumulating the same micro-batches (2 x 2 rows a micro-step)
    train(train_config(cache, tmp_path / "one", per_device_train_batch_size=4, gradient_accumulation_steps=2, **RUN))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "accumulated")
    assert len(one) == len(two) == STEPS
    for a, b in zip(two, one, strict=True):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


@pytest.mark.slow
def test_ddp_micro_steps_exchange_no_gradients_and_match_one_process_under_float32_and_bf16(tmp_path, small_cache):
    """Under DDP: the micro-steps before an optimizer step all-reduce no gradients, and the run equals one process
    accumulating the same micro-batches; and 2 processes under bf16 autocast with 2 micro-batches a step (the
    weights cast once a step, the casts' gradients all-reduced once) train as one process accumulating the same
    rows. One launch runs the three (without accumulation, with it, with it under bf16), in that order."""
    counted = _counted_runs(
        tmp_path,
        small_cache,
        ENGINES["ddp"][0],
        {
            "plain": dict(gradient_accumulation_steps=1, **RUN),
            "accumulated": dict(gradient_accumulation_steps=2, **RUN),
            "bf16": dict(gradient_accumulation_steps=2, bf16=True, **RUN),
        },
    )
    _check_no_exchange_in_micro_steps(tmp_path, small_cache, "ddp", counted)
    # under bf16 the casts' gradients too are exchanged once an optimizer step
    assert counted["bf16"]["allreduce_"] == counted["plain"]["allreduce_"], counted
    config = train_config(small_cache, tmp_path / "one-bf16", per_device_train_batch_size=4)
    train(dataclasses.replace(config, bf16=True, gradient_accumulation_steps=2, **RUN))
    two, one = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "one-bf16")
    assert len(one) == len(two) == STEPS
    # the processes' bf16 gradients are rounded per process, then summed (one process: the sum rounded once), so
    # after step 1 the weights differ by bf16 rounding: a reward (beta x a log-prob difference) is held to beta x one
    # bf16 unit in the last place of a nat (2**-8); on a CPU without bf16 kernels step 2's came 1.25e-4 apart
    beta = json.loads((tmp_path / "one-bf16" / "run_config.json").read_text())["beta"]
    for a, b in zip(two, one, strict=True):
        for key in ("loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (a["step"], key)
        for key in ("rewards/chosen", "rewards/rejected"):
            assert a[key] == pytest.approx(b[key], abs=beta * 2**-8), (a["step"], key)


@pytest.mark.slow
def test_fsdp2_micro_steps_exchange_no_gradients_and_match_one_process(tmp_path, small_cache):
    """As under DDP, under FSDP2 (reduce-scatters, `set_requires_gradient_sync`): one launch runs both (without
    accumulation, then with it)."""
    runs = {
        "plain": dict(gradient_accumulation_steps=1, **RUN),
        "accumulated": dict(gradient_accumulation_steps=2, **RUN),
    }
    counted = _counted_runs(tmp_path, small_cache, ENGINES["fsdp2"][0], runs)
    _check_no_exchange_in_micro_steps(tmp_path, small_cache, "fsdp2", counted)


class _WeightCasts(TorchDispatchMode):
    """Counts, per weight, the casts of `weights` (float32 parameters) to bfloat16 that reach the dispatcher."""

    def __init__(self, weights: dict[int, str]):
        super().__init__()
        self.weights, self.counts = weights, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.weights.get(args[0].data_ptr()) if args[0].dtype == torch.float32 else None
            if name is not None:
                self.counts[name] += 1
        return func(*args, **kwargs)


def _casts_and_metrics(tmp_path: Path, cache, name: str, monkeypatch, keep: bool) -> tuple[Counter, list[dict]]:
    """A bf16 run of STEPS optimizer steps, 2 micro-batches each, counting the decoder layers' weight casts (the
    counting mode on from the policy's loading to the run's end, and undone with the patches before returning)."""
    from kto_pipeline.runtime.engines.base import Engine
    from kto_pipeline.stages.train import stage

    setup, counted = stage.setup, {}

    def watched_setup(*args, **kwargs):  # the mode starts once the policy is loaded (its parameters' addresses)
        run = setup(*args, **kwargs)
        layers = {p.data_ptr(): n for n, p in run.scorer.named_parameters() if ".layers." in n and p.ndim == 2}
        counted["mode"] = mode = _WeightCasts(layers)
        mode.__enter__()
        return run

    config = train_config(cache, tmp_path / name, per_device_train_batch_size=2, gradient_accumulation_steps=2, **RUN)
    with monkeypatch.context() as patched:
        patched.setattr(Engine, "caches_whole_casts", keep)
        patched.setattr(stage, "setup", watched_setup)
        try:
            train(dataclasses.replace(config, bf16=True))
        finally:
            if "mode" in counted:
                counted["mode"].__exit__(None, None, None)
    return counted["mode"].counts, read_metrics(tmp_path / name)


def test_bf16_weights_are_cast_once_an_optimizer_step_with_the_same_numbers(tmp_path, small_cache, monkeypatch):
    """Under bf16 autocast with 2 micro-batches a step, each decoder-layer weight is cast once an optimizer step
    (autocast's cache kept across the micro-batches), not at each call; the run's numbers are those of casting at
    every call, to the bit. (On a CPU a half-precision product casts its weight at each call, `products.linear`:
    twice a micro-batch, the completions' forward and the KL completions'.)"""
    once, kept = _casts_and_metrics(tmp_path, small_cache, "kept", monkeypatch, keep=True)
    per_forward, plain = _casts_and_metrics(tmp_path, small_cache, "plain", monkeypatch, keep=False)
    print(
        "casts of each layer weight in",
        STEPS,
        "steps: kept",
        set(once.values()),
        "per forward",
        set(per_forward.values()),
    )
    assert once.keys() == per_forward.keys() and len(once) >= 14  # 2 layers x 7 linear weights
    assert set(once.values()) == {STEPS} and set(per_forward.values()) == {2 * 2 * STEPS}
    assert len(kept) == len(plain) == STEPS
    for a, b in zip(kept, plain, strict=True):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm", "logps/chosen"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert _get_current_dispatch_mode_stack() == []  # the counting is over: no mode left for the next tests


def test_step_casts_hold_a_cast_only_while_open_and_give_the_model_back_as_it_was():
    """StepCasts on a tiny Llama under bf16: the layers' linear weights cast at `open`, the same values autocast
    casts; none outside a step, none where autocast is off; after the run the layers' own class is back (the model
    pickles) and a sharded engine or gradient checkpointing leaves the model alone."""
    import pickle
    from types import SimpleNamespace

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model
    from kto_pipeline.runtime.precision import policy_regime
    from kto_pipeline.scoring.products import STEP_CAST, StepCasts

    model = build_tiny_model(build_char_tokenizer())
    regime, whole = policy_regime(True, False), SimpleNamespace(caches_whole_casts=True)
    plain = SimpleNamespace(gradient_checkpointing=False)
    with StepCasts(SimpleNamespace(model=model), regime, whole, plain) as casts:
        assert len(casts.linears) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
        linear = casts.linears[0]
        x = torch.randn(3, linear.in_features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = linear(x)
            casts.open()
            weight, bias = linear.__dict__[STEP_CAST]
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, linear.weight.to(torch.bfloat16))
            assert torch.equal(linear(x), want)  # the same values as autocast's own cast
        assert linear(x).dtype == torch.float32  # autocast off: the float32 weights, cast or not
        casts.close()
        assert STEP_CAST not in linear.__dict__
    assert "forward" not in linear.__dict__ and type(linear) is torch.nn.Linear
    pickle.loads(pickle.dumps(model))
    for engine, config in (
        (SimpleNamespace(caches_whole_casts=False), plain),
        (whole, SimpleNamespace(gradient_checkpointing=True)),
    ):
        assert StepCasts(SimpleNamespace(model=model), regime, engine, config).linears == []
    assert StepCasts(SimpleNamespace(model=model), policy_regime(False, False), whole, plain).linears == []
