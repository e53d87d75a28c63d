"""One precision regime end to end: the cache records how the reference computed (weights dtype, autocast), train
compares it with its own, and at step 1 (policy = reference) the rewards and the KL estimate are exactly zero under
every engine when the cache was made in the matching regime, bf16 included; in another regime they start 2e-3 off.

Exact zeros need the same computation in both stages: on the CPU attention runs sequence by sequence, each sequence
meeting only its own keys however the trees are laid out (`scoring/attention.py`; tests/test_packing.py checks it
layout by layout), and a sequence's log-prob is the float32 sum of its tokens in order in both (`cache.token_sum`).

The tiny model's weights are scaled up (x4, conftest's `scaled_model_dir`) so that precision shows."""

import json

import pytest
from helpers import launch, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, precompute, train
from kto_pipeline.cache import open_cache

FSDP_ENV = dict(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
MISMATCH = 1e-3  # bf16 vs float32 on the scaled model: about 2e-3 (rewards), 1.6e-2 (KL)


@pytest.fixture(scope="module")
def caches(tmp_path_factory, scaled_model_dir):
    root = tmp_path_factory.mktemp("precision")
    data = write_jsonl(root / "d.jsonl", unpaired_rows(16))
    made = {}
    for name, bf16 in (("float32", False), ("bf16", True)):
        config = PrecomputeConfig(
            model=str(scaled_model_dir), dataset=str(data), output=str(root / name), max_length=64, bf16=bf16
        )
        made[name] = precompute(config)
    return made


def step_one(out) -> dict:
    return read_metrics(out)[0]


def assert_zero_rewards(record: dict) -> None:
    for key in ("rewards/chosen", "rewards/rejected", "kl"):
        assert record[key] == 0.0, (key, record[key])


def test_the_cache_records_its_regime_and_train_compares(tmp_path, caches, capsys):
    fp32, bf16 = open_cache(caches["float32"]), open_cache(caches["bf16"])
    assert fp32.manifest.precision == ("float32", None) and bf16.manifest.precision == ("float32", "bfloat16")
    assert fp32.manifest.fingerprint["autocast"] is None and bf16.manifest.fingerprint["autocast"] == "bfloat16"
    # matching regimes: zero at step 1; mismatched: a warning naming both, and rewards that start off zero
    kl = {}
    for cache, bf16_on, matching in (("float32", False, True), ("bf16", True, True), ("bf16", False, False)):
        out = tmp_path / f"{cache}-{bf16_on}"
        train(train_config(caches[cache], out, max_steps=1, per_device_train_batch_size=8, bf16=bf16_on))
        warned = "warning: the cache's reference ran in" in capsys.readouterr().out
        record = step_one(out)
        kl[cache, bf16_on] = record["kl"]
        if matching:
            assert not warned
            assert_zero_rewards(record)
        else:
            assert warned
            assert abs(record["rewards/chosen"]) > MISMATCH and record["kl"] > MISMATCH
        state = json.loads((out / "trainer_state.json").read_text())
        assert state["precision"] == (
            "float32 weights under bfloat16 autocast" if bf16_on else "float32 weights, no autocast"
        )
    assert kl["float32", False] == kl["bf16", True] == 0.0 < kl["bf16", False]
    regimes = r"ran in float32 weights under bfloat16 autocast, and this run's policy runs in float32 weights, no"
    with pytest.raises(KTOPipelineError, match=f"--strict: the cache's reference {regimes}"):
        train(train_config(caches["bf16"], tmp_path / "strict", bf16=False, strict=True))
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()  # refused before anything is written


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory, caches):
    """Step 1 of one process x 8 rows under bf16, which both engines' runs are compared with (the tests only read
    it)."""
    out = tmp_path_factory.mktemp("precision-one") / "one"
    train(train_config(caches["bf16"], out, max_steps=1, per_device_train_batch_size=8, bf16=True))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_step_one_under_bf16_is_one_process_for_every_engine(tmp_path, caches, one_process_bf16, engine):
    out = tmp_path / engine
    args = ["train", "--cache", str(caches["bf16"]), "--output-dir", str(out), "--bf16", "--max-steps", "1"]
    args += ["--per-device-train-batch-size", "4", "--learning-rate", "1e-3", "--seed", "0"]
    launch(2, *args, env=FSDP_ENV if engine == "fsdp2" else None, log_dir=tmp_path / "logs")
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["distributed"]["engine"] == engine
    assert state["precision"] == "float32 weights under bfloat16 autocast"
    record, one = step_one(out), step_one(one_process_bf16)
    assert_zero_rewards(record)
    for key in ("kl", "loss", "logps/chosen"):
        assert record[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # the backward's bf16 matmuls run on 4-row instead of 8-row batches: rounded apart by about 4e-5
    assert record["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-3)


def test_a_cpu_half_precision_product_computes_every_row_in_a_call_of_the_same_rows(monkeypatch):
    """On a CPU a bf16 product may round a row by the call's shape (oneDNN's AMX kernels: SmolLM2's step-1 rewards
    0.03 off on such a machine). `products.linear` runs every call in blocks of ROW_BLOCK rows: a row's result is the
    same whatever rows share its call, the backward is F.linear's to the bit (where the CPU has half-precision
    kernels; else its products in float32, `half_product`), the LM head's chunks are whole blocks, and float32 keeps
    F.linear's one call."""
    import torch

    from kto_pipeline.scoring import products
    from kto_pipeline.scoring.head import chunked_token_logps

    functional, calls = torch.nn.functional, []

    def counted(input, weight, bias=None):
        calls.append(input.shape[0])
        return functional.linear(input, weight, bias)

    monkeypatch.setattr(products, "F", type("F", (), {"linear": staticmethod(counted), "pad": functional.pad}))
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, requires_grad=True), torch.randn(96, requires_grad=True)
    rows = torch.randn(2000, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alone = products.linear(rows[300:340], weight, bias)
        for start, stop in ((0, 2000), (290, 1100), (300, 340), (250, 900)):
            got = products.linear(rows[None, start:stop], weight, bias)[0, 300 - start : 340 - start]
            assert got.dtype == torch.bfloat16 and torch.equal(got, alone), (start, stop)
        assert set(calls) == {products.row_block(torch.bfloat16)}, calls
        want = functional.linear(rows[:700], weight, bias)
        assert (products.linear(rows[:700], weight, bias).float() - want.float()).abs().max() <= 0.05
    grads = []
    for product in (products.linear, functional.linear):
        x = rows[:700].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            product(x, weight, bias).float().square().sum().backward()
        grads.append([t.grad.clone() for t in (x, weight, bias)])
        weight.grad = bias.grad = None
    for ours, torchs in zip(*grads, strict=True):
        if products.native_half_products(torch.bfloat16):  # the same products
            assert torch.equal(ours, torchs)
        else:  # float32 products of the bf16 values against ATen's bf16 loops: the same sums (the weight's over the
            # 700 rows) in another order, each rounded once to bf16: a unit in its last place apart at most
            torch.testing.assert_close(ours, torchs, rtol=2**-7, atol=0)
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the head: blocks of rows, its chunks whole blocks
        chunked_token_logps(rows[:1100].bfloat16(), torch.randn(40000, 64), torch.randint(0, 40000, (1100,)))
    assert set(calls) == {products.row_block(torch.bfloat16)}, calls
    calls.clear()
    assert torch.equal(products.linear(rows[:700], weight, bias), functional.linear(rows[:700], weight, bias))
    assert calls == [700]  # float32: one call, whole


def test_rows_alike_makes_the_linear_layers_compute_in_blocks_only_for_a_cpus_half_precision(tmp_path):
    """Both stages make a model's plain nn.Linear modules `products.Linear` where they compute in half precision on
    a CPU (autocast or half weights), and nowhere else; the model keeps its parameters, saves and pickles."""
    import pickle

    import torch

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model
    from kto_pipeline.runtime.precision import Regime
    from kto_pipeline.scoring.products import Linear, rows_alike

    cpu = torch.device("cpu")
    for regime, device, made in (
        (Regime("float32", "bfloat16"), cpu, True),
        (Regime("bfloat16"), cpu, True),
        (Regime("float32"), cpu, False),
        (Regime("float32", "bfloat16"), torch.device("cuda"), False),
    ):
        model = build_tiny_model(build_char_tokenizer())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert rows_alike(model, regime, device) is made
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) >= 15 and all((type(m) is Linear) is made for m in linears), regime
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        pickle.loads(pickle.dumps(model))
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "config.json").exists()
