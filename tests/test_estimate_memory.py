"""`kto-pipeline estimate-memory`: the simulated peak of a train step, from a model's config alone.

The command runs on a tiny Qwen2 config; its parameters are checked against a model built for real, the
simulation of our step against a real float32 step on this CPU (resident set's high water mark, within 10%),
and the package's model of trl's step against the real trl.KTOTrainer run under the same simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import KL_ON_CACHED_PROMPTS, run_cli

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory) -> Path:
    """A directory with only a config.json: no weights, no tokenizer."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("config-only")
    Qwen2Config(**TINY).save_pretrained(path)
    return path


def estimate(monkeypatch, capsys, *flags) -> tuple[int, str, str]:
    return run_cli(monkeypatch, capsys, "estimate-memory", *flags)


@pytest.fixture(scope="module")
def answer(tiny_config_dir) -> dict:
    """The --json answer for 4 rows of 64 tokens, with trl online's peak."""
    monkeypatch, capsys = pytest.MonkeyPatch(), _Capture()
    flags = ["--model", str(tiny_config_dir), "--per-device-train-batch-size", "4", "--max-length", "64"]
    with capsys:
        code, out, err = estimate(monkeypatch, capsys, *flags, "--against-trl", "--json")
    monkeypatch.undo()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return {"flags": flags, **json.loads(lines[0])}


def test_json_answer(answer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    breakdown = answer["breakdown"]
    assert set(breakdown) == {"parameters", "gradients", "optimizer", "activations", "temporaries"}
    assert answer["peak_bytes"] == sum(breakdown.values())  # every live tensor is in one category
    # float32 weights and AdamW's two moments, counted independently from a model built for real
    real = Qwen2ForCausalLM(Qwen2Config(**TINY))
    params = sum(p.numel() for p in real.parameters())
    assert breakdown["parameters"] == 4 * params + sum(b.numel() * b.element_size() for b in real.buffers())
    assert breakdown["optimizer"] >= 8 * params  # two moments a parameter (+ the step counters)
    assert breakdown["activations"] + breakdown["temporaries"] + breakdown["gradients"] > 0
    assert answer["floor_bytes"] <= answer["peak_bytes"]
    # trl online holds a reference model beside the policy: at least its weights more than the policy's step
    assert answer["trl_online_peak_bytes"] >= 4 * params + breakdown["parameters"] + breakdown["optimizer"]
    assert answer["tokens_needed"] == 4 * 64
    assert answer["settings"]["lengths"] == "full"


def test_checkpointing_and_table(monkeypatch, capsys, answer, tmp_path):
    """Checkpointing keeps each layer's input only; the KL completions run on the prompts' cached keys/values, under
    checkpointing only where a token's keys/values are at most half its hidden size (one key/value head of 16 in
    64, not two)."""
    from transformers import Qwen2Config

    code, out, err = estimate(monkeypatch, capsys, *answer["flags"], "--gradient-checkpointing", "--json")
    assert code == 0, err
    checkpointed = json.loads(out)
    assert checkpointed["breakdown"]["activations"] < answer["breakdown"]["activations"]
    assert answer["kl_forward"] == "on the prompts' cached keys/values"
    assert checkpointed["kl_forward"] == "with the prompts run again"
    code, out, err = estimate(monkeypatch, capsys, *answer["flags"], "--lengths", "kto-mix")
    assert code == 0, err
    assert "peak per device" in out and "(kto-mix)" in out and "activations" in out
    Qwen2Config(**(TINY | dict(num_key_value_heads=1))).save_pretrained(tmp_path)
    flags = ["--model", str(tmp_path), *answer["flags"][2:], "--gradient-checkpointing"]
    code, out, err = estimate(monkeypatch, capsys, *flags)
    assert code == 0, err
    assert f"  KL forward        {KL_ON_CACHED_PROMPTS}" in out, out


def test_a_pair_loss_step(monkeypatch, capsys, answer):
    """A pair loss runs each pair's prompt once and both answers with gradients: at full lengths (a quarter of
    each sequence prompt) 4 pairs need 4 x (16 + 48 + 48) tokens with gradients, more activations than KTO's 4 x 64
    (whose KL completions run without); the weights and AdamW are the same."""
    code, out, err = estimate(monkeypatch, capsys, *answer["flags"], "--loss-type", "sigmoid+sft", "--json")
    assert code == 0, err
    pairs = json.loads(out)
    assert pairs["tokens_needed"] == pairs["tokens_with_grad"] == 4 * (16 + 48 + 48)
    assert pairs["breakdown"]["activations"] > answer["breakdown"]["activations"]
    for name in ("parameters", "optimizer"):
        assert pairs["breakdown"][name] == answer["breakdown"][name]
    assert answer["floor_bytes"] < pairs["floor_bytes"] <= pairs["peak_bytes"]
    code, out, err = estimate(monkeypatch, capsys, *answer["flags"], "--loss-type", "exo_pair")
    assert code == 0 and "4 pairs x 2 answers of 64 tokens, exo_pair" in out, err
    code, _, err = estimate(monkeypatch, capsys, *answer["flags"], "--loss-type", "ipo", "--against-trl")
    assert code == 1 and "--against-trl: simulates trl.KTOTrainer's step" in err, err
    code, _, err = estimate(monkeypatch, capsys, *answer["flags"], "--loss-type", "kto+ipo")
    assert code == 1 and "--loss-type: 'kto+ipo'" in err, err


class _Capture:
    """capsys for a module-scoped fixture: stdout and stderr of the block."""

    def __enter__(self):
        import contextlib
        import io

        self.out, self.err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self.out))
        self._stack.enter_context(contextlib.redirect_stderr(self.err))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def readouterr(self):
        return self.out.getvalue(), self.err.getvalue()


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda tmp: tmp / "missing", "no such directory"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "has no config.json"),
    ],
)
def test_model_without_config(monkeypatch, capsys, tmp_path, make, fragment):
    code, out, err = estimate(monkeypatch, capsys, "--model", str(make(tmp_path)))
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith("error: --model") and fragment in err, err


def test_bad_flags(monkeypatch, capsys, tiny_config_dir):
    code, _, err = estimate(monkeypatch, capsys, "--model", str(tiny_config_dir), "--cpu-offload")
    assert code == 1 and "--cpu-offload: needs --fsdp-world-size > 1" in err, err


def test_a_model_that_trains_padded_is_refused_by_name(monkeypatch, capsys, tmp_path):
    """A model that takes no packed layout (a conv hybrid: train pads its batches, a sequence a row) is refused with
    the reason, not simulated as packed batches (which it would not run) nor failed with a traceback."""
    from transformers import Lfm2Config

    config = dict(TINY, layer_types=["conv", "full_attention"], num_hidden_layers=2)
    Lfm2Config(**config).save_pretrained(tmp_path)
    code, _, err = estimate(monkeypatch, capsys, "--model", str(tmp_path), "--max-length", "64")
    assert code == 1 and "Traceback" not in err, err
    assert "Lfm2ForCausalLM trains padded" in err and "(Lfm2ShortConv)" in err, err


def test_simulation_matches_a_real_cpu_step():
    """A real float32 step of a 2-layer Llama on this CPU (fresh process, VmHWM) vs its simulation on fake tensors:
    what the step adds (gradients, activations, temporaries) within 10%."""
    from transformers import LlamaConfig

    from kto_pipeline.memory import cpu_check, synthetic_rows

    config = LlamaConfig(**{**TINY, "vocab_size": 32000})
    rows = synthetic_rows(8, 256, "full", config.vocab_size)
    result = cpu_check(config, rows)
    ratio = result["simulated_step_bytes"] / result["real_step_bytes"]
    assert 0.9 <= ratio <= 1.1, result
    # the tracker counts the same on real tensors as on fake ones: the fake step allocates what the real one does
    assert result["tracked_real_step_bytes"] == result["simulated_step_bytes"]


def test_trl_model_matches_real_trl(monkeypatch, tmp_path):
    """memory.simulate_trl (the package's model of trl's step) against the real trl.KTOTrainer 1.16 online, both on
    fake tensors, same rows (benchmarks/bench_memory.py compares both modes on the Qwen2 configs)."""
    from transformers import Qwen2Config

    from kto_pipeline.memory import StepSettings, simulate_trl, synthetic_rows

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_memory import trl_real_step

    config = Qwen2Config(**{**TINY, "vocab_size": 8192})
    rows = synthetic_rows(4, 96, "kto-mix", config.vocab_size)
    settings = StepSettings()
    real, trl_rows = trl_real_step(config, rows, settings, True, tmp_path)
    model = simulate_trl(config, trl_rows, settings, online=True)
    assert model.breakdown["parameters"] == real["breakdown"]["parameters"]  # policy + reference
    assert abs(model.peak_bytes / real["peak_bytes"] - 1) < 0.03, (model.peak_bytes, real)
