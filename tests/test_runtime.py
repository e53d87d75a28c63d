"""The runtime wing owns how a process runs: the stages and the checkpoints ask it, never decide.

These tests read the package's code (its syntax tree, not its comments or docstrings): an engine named in a stage
or a private name imported across modules is a failure, with the file and line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kto_pipeline.errors import KTOPipelineError

PACKAGE = Path(__file__).resolve().parents[1] / "kto_pipeline"
# an engine's identifier, import or string: FSDP / fully_shard, DeepSpeed / ZeRO, DDP / DistributedDataParallel
ENGINE_WORDS = re.compile(r"fsdp|fully_shard|deepspeed|\bddp\b|distributeddataparallel|zero[-_ ]?[23]\b", re.I)


def _code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every name, attribute, import and string constant of `path`, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if getattr(node, "module", None) else [])
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            found += [(node.lineno, v.value) for v in node.values if isinstance(v, ast.Constant)]
    return found


def _stage_files() -> list[Path]:
    return sorted((PACKAGE / "stages").rglob("*.py")) + [PACKAGE / "rundir" / "checkpoint.py"]


def test_stages_and_checkpoints_name_no_engine():
    named = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
        for path in _stage_files()
        for line, text in _code_tokens(path)
        if ENGINE_WORDS.search(text)
    ]
    assert not named, "ask the engine (kto_pipeline/runtime/engines), do not name it:\n" + "\n".join(named)


def test_the_check_finds_an_engine_named_in_code(tmp_path):
    """The scan above is not blind: an engine in code is found, the same word in a docstring or comment is not."""
    sample = tmp_path / "stage.py"
    sample.write_text('"""Runs under FSDP2 or DeepSpeed."""\n# DDP too\nif engine.name == "fsdp2":\n    pass\n')
    hits = [text for _, text in _code_tokens(sample) if ENGINE_WORDS.search(text)]
    assert hits == ["fsdp2"]


def test_stages_test_no_engine_kind():
    """No `engine.name == ...` or isinstance(engine, ...) in a stage: the engine answers, the stage never asks
    which."""
    asked = []
    for path in _stage_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "name" and "engine" in ast.unparse(node.value):
                asked.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and "engine" in ast.unparse(node):
                asked.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not asked, asked


def test_no_module_imports_another_modules_private_name():
    imported = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kto_pipeline"):
                imported += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not imported, "\n".join(imported)


# ------------------------------------------------------------------------------------------ the registry


@pytest.fixture
def clean_launch_env(monkeypatch):
    for key in (
        "ACCELERATE_USE_FSDP",
        "ACCELERATE_USE_DEEPSPEED",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT",
        "FSDP_VERSION",
        "FSDP_ACTIVATION_CHECKPOINTING",
    ):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_registry_picks_the_engine_the_launch_asks_for(clean_launch_env):
    from kto_pipeline.runtime.engines import engine_for

    monkeypatch = clean_launch_env
    one, ddp = engine_for(1), engine_for(2)
    assert (one.record(), str(one)) == ({"engine": "single", "world_size": 1}, "one process")
    assert (ddp.record(), str(ddp)) == ({"engine": "ddp", "world_size": 2}, "replicated (DDP) over 2 processes")
    assert not (one.collective_forwards or ddp.collective_forwards) and one.holds_whole_model

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for stage, collective in ((2, False), (3, True)):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(stage))
        engine = engine_for(2)
        assert engine.record() == {"engine": f"deepspeed-zero{stage}", "world_size": 2}
        assert engine.collective_forwards is collective and engine.state_holds_weights
        assert engine.zero3_init is (stage == 3)  # zero3_init_flag unset: on under ZeRO-3, as accelerate's default
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")
    assert not engine_for(2).zero3_init and "partitioned as it loads" not in str(engine_for(2))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    assert str(engine_for(2)) == "DeepSpeed ZeRO-3 over 2 processes, the model partitioned as it loads (zero.Init)"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    with pytest.raises(KTOPipelineError, match="ZeRO-1: kto-pipeline runs ZeRO-2 and ZeRO-3"):
        engine_for(2)

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # FSDP first: accelerate exports one or the other
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    engine = engine_for(4)
    assert engine.record() == {"engine": "fsdp2", "world_size": 4} and str(engine) == "sharded (FSDP2) over 4 processes"
    assert engine.collective_forwards and engine.state_holds_weights and not engine.holds_whole_model
    assert engine.activation_checkpointing


def test_the_main_process_decides_and_its_failure_is_everyones():
    from kto_pipeline.runtime.launch import main_decides

    class Alone:
        is_main_process, num_processes = True, 1

    assert main_decides(Alone(), lambda: {"plan": 3}) == {"plan": 3}

    def refuse():
        raise ValueError("not this one")

    with pytest.raises(ValueError, match="not this one"):  # the main process raises its own exception
        main_decides(Alone(), refuse)


# ------------------------------------------------------------------------------------------ precision


def test_precision_is_resolved_once_for_each_stage():
    import torch

    from kto_pipeline.runtime.precision import Regime, check_regime, policy_regime, reference_regime

    assert policy_regime(True) == Regime("float32", "bfloat16") and policy_regime(False) == Regime("float32")
    assert policy_regime(None) == Regime("float32")  # no GPU here: bf16 is off by default
    assert policy_regime(True).mixed_precision == "bf16" and policy_regime(False).mixed_precision == "no"
    cpu = torch.device("cpu")
    assert reference_regime("auto", True, cpu) == Regime("float32", "bfloat16")
    assert reference_regime("bfloat16", False, cpu).dtype == torch.bfloat16
    assert reference_regime("auto", None, cpu).record() == {"dtype": "float32", "autocast": None}
    assert check_regime(Regime("float32"), Regime("float32"), strict=True) is None
    warning = check_regime(Regime("float32", "bfloat16"), Regime("float32"), strict=False)
    assert warning.startswith("warning: the cache's reference ran in float32 weights under bfloat16 autocast")
    with pytest.raises(KTOPipelineError, match="--strict: the cache's reference ran in"):
        check_regime(Regime("float32", "bfloat16"), Regime("float32"), strict=True)
    if not torch.cuda.is_available():
        with pytest.raises(KTOPipelineError, match="--fp16 needs a CUDA GPU"):
            policy_regime(None, fp16=True)


# ------------------------------------------------------------------------------------------ contracts


def test_the_truncation_rule_is_written_once():
    """`max_length - len(prompt)` lives in cache.completion_room; no other module spells it."""
    spelled = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "cache" / "__init__.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"max_length\s*-\s*len\(", line)
    ]
    assert not spelled, spelled


def test_sharded_loads_return_freed_buffers_unless_the_user_set_the_threshold():
    """glibc's mmap threshold is fixed at 128 KiB for a sharded load (what MALLOC_MMAP_THRESHOLD_=131072 sets), so
    that the broadcast and all-gathered tensors freed during loading leave the process; a user's own setting wins.
    (In a fresh process each: the setting lasts for the process.)"""
    import os
    import subprocess
    import sys

    code = "from kto_pipeline.runtime.engines.sharded import return_freed_buffers; print(return_freed_buffers())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == str(sys.platform.startswith("linux"))
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    theirs = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert theirs.stdout.strip() == "False"
